"""The Ascend build without CANN: the NPU sources compile against the ACL stub headers
(csrc/stubs/acl/acl.h) with setup.py's flags, so a typo there fails here rather than on an
Ascend machine; and the ACL pinner, linked with a scripted ACL (tests/acl/), pins, unpins,
fails and steps aside as documented (csrc/core/npu/host_memory_npu.cpp)."""

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parent.parent
NPU_SOURCES = sorted((ROOT / "csrc" / "core" / "npu").glob("*.cpp"))
CXX = os.environ.get("CXX", "c++")
# setup.py's compile flags for the npu target (-O3 aside: optimisation finds no typo and costs time).
FLAGS = [
    "-std=c++17", "-fvisibility=hidden", "-fPIC", "-pthread",
    "-DOFFLOAD_WITH_NPU=1", '-DOFFLOAD_TARGET="npu"', f'-DOFFLOAD_TORCH_VERSION="{torch.__version__}"',
    f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc' / 'stubs'}",
    # torch's headers as system headers: their own warnings are not this project's.
    *(f"-isystem{path}" for path in cpp_extension.include_paths()),
]
# The stub as an older CANN spells it: no aclrtHostRegisterV2, no ACL_HOST_REG_PINNED.
WITHOUT_PINNED = ["-DOFFLOAD_ACL_STUB_WITHOUT_HOST_REG_PINNED"]


def _compiler_or_skip():
    if shutil.which(CXX) is None:
        pytest.skip(f"needs a C++ compiler ({CXX}; set CXX)")


def _compile_all(jobs):
    """Run the compile commands `jobs` ({name: argv}) side by side; {name: (returncode, stderr tail)}."""
    running = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, argv in jobs.items()}
    done = {}
    for name, proc in running.items():
        out, err = proc.communicate(timeout=600)
        done[name] = (proc.returncode, err[-4000:])
    return done


# Objects that compiled are kept here, each named by a hash of its command and of every input it
# can read (csrc/, the test sources, the compiler, torch): the same inputs on the same machine
# compile once, and any change to them compiles anew. A failed compile is never kept.
CACHE = ROOT / "build" / "npu_build"


def _inputs_digest() -> str:
    digest = hashlib.sha256()
    files = [*(ROOT / "csrc").rglob("*"), *(ROOT / "tests" / "acl").rglob("*"), *(ROOT / "tests" / "cpp").glob("*.h")]
    for path in sorted(p for p in files if p.is_file()):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    version = subprocess.run([CXX, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest.update(f"{version}\0{torch.__version__}\0{torch.__file__}".encode())
    return digest.hexdigest()


def _compile_cached(sources):
    """Compile `sources` ({name: (source, extra flags)}) to objects, side by side, reusing kept ones;
    {name: (returncode, stderr tail, object path)}."""
    CACHE.mkdir(parents=True, exist_ok=True)
    inputs = _inputs_digest()
    objects, jobs = {}, {}
    for name, (source, extra) in sources.items():
        argv = [CXX, *FLAGS, *extra, "-c", str(source)]
        key = hashlib.sha256("\0".join([inputs, *argv]).encode()).hexdigest()[:20]
        objects[name] = CACHE / f"{Path(source).stem}-{key}.o"
        if not objects[name].exists():
            jobs[name] = [*argv, "-o", f"{objects[name]}.{os.getpid()}.tmp"]
    results = _compile_all(jobs)
    for name, (rc, _) in results.items():
        partial = f"{objects[name]}.{os.getpid()}.tmp"
        if rc == 0:  # whole objects only: a compile cut short leaves no object under the final name
            os.replace(partial, objects[name])
        elif os.path.exists(partial):
            os.remove(partial)
    return {name: (*results.get(name, (0, "")), objects[name]) for name in sources}


SCRIPTED = "test_npu_pinner_against_a_scripted_acl"


@pytest.fixture(scope="module")
def npu_objects(request, tmp_path_factory):
    """Each NPU source compiled to an object against the stub, and compiled again as an older
    CANN would see it; when the scripted-ACL test is selected, its own objects too, in the same
    batch. {"results": {name: (returncode, stderr)}, "objects"/"older"/"scripted": {name: path}}."""
    _compiler_or_skip()
    assert NPU_SOURCES, "csrc/core/npu holds no sources"
    sources = {}
    for source in NPU_SOURCES:
        sources[source.name] = (source, [])
        sources[f"{source.name} (older CANN)"] = (source, WITHOUT_PINNED)
    scripted = {"host_memory.cpp": (ROOT / "csrc" / "core" / "host_memory.cpp", []),
                "test_npu_pinner.cpp": (ROOT / "tests" / "acl" / "test_npu_pinner.cpp", [f"-I{ROOT / 'tests' / 'cpp'}"])}
    if any(item.name == SCRIPTED for item in request.session.items):
        sources.update(scripted)
    compiled = _compile_cached(sources)
    return {"dir": tmp_path_factory.mktemp("npu_build"),
            "results": {name: compiled[name][:2] for name in sources if name not in scripted},
            "objects": {source.name: compiled[source.name][2] for source in NPU_SOURCES},
            "older": {source.name: compiled[f"{source.name} (older CANN)"][2] for source in NPU_SOURCES},
            "scripted": {name: compiled[name] for name in scripted if name in compiled}}


def test_npu_sources_compile_against_the_acl_stub(npu_objects):
    failed = {name: err for name, (rc, err) in npu_objects["results"].items() if rc != 0}
    assert not failed, "\n\n".join(f"{name}:\n{err}" for name, err in failed.items())
    assert all(path.stat().st_size > 0 for path in npu_objects["objects"].values())
    assert all(path.stat().st_size > 0 for path in npu_objects["older"].values())


def test_npu_pinner_references_no_acl_without_the_pinned_flag(npu_objects):
    # Against an older CANN's headers the pinner compiles to nothing: no ACL symbol is referenced,
    # so the core links without aclrtHostRegisterV2 and the pool takes torch_npu's pinned blocks.
    if shutil.which("nm") is None:
        pytest.skip("needs nm (binutils) to list an object's symbols")
    listed = {}
    for name, obj in [("current", npu_objects["objects"]["host_memory_npu.cpp"]),
                      ("older", npu_objects["older"]["host_memory_npu.cpp"])]:
        result = subprocess.run(["nm", "-u", str(obj)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        listed[name] = result.stdout
    assert "aclrtHostRegisterV2" in listed["current"] and "aclrtHostUnregister" in listed["current"]
    assert "aclrtHostRegisterV2" not in listed["older"] and "aclrtHostUnregister" not in listed["older"]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the pinner is built for Linux only")
def test_npu_pinner_against_a_scripted_acl(npu_objects):
    release = tuple(int(part) for part in platform.release().split("-")[0].split(".")[:2] if part.isdigit())
    if release <= (5, 10):
        pytest.skip(f"ACL registers pageable memory only on Linux after 5.10; this kernel is {platform.release()}")
    out = npu_objects["dir"]
    built = npu_objects["scripted"]
    failed = {name: err for name, (rc, err, _) in built.items() if rc != 0}
    assert not failed, "\n\n".join(f"{name}:\n{err}" for name, err in failed.items())
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    program = out / "test_npu_pinner"
    linked = subprocess.run([CXX, "-pthread", str(built["test_npu_pinner.cpp"][2]), str(built["host_memory.cpp"][2]),
                             str(npu_objects["objects"]["host_memory_npu.cpp"]), f"-L{torch_lib}", "-ltorch_cpu", "-lc10",
                             f"-Wl,-rpath,{torch_lib}", "-o", str(program)], capture_output=True, text=True,
                            timeout=600)
    assert linked.returncode == 0, linked.stderr[-4000:]
    # One process for the probe that succeeds and what follows it, one for the probe that fails.
    for cases in (["npu_pinner_is_registered_for_privateuse1", "npu_pinner_pins_in_place_and_unpins",
                   "npu_pinner_failure_is_out_of_memory_naming_call_size_error_and_knobs"],
                  ["npu_pinner_refused_by_the_device_is_not_used"]):
        ran = subprocess.run([str(program), *cases], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert f"{len(cases)} of {len(cases)} test cases passed" in ran.stdout


# ---------------------------------------------------------------- setup.py's npu target


def _setup_name(tmp_path, **env):
    """`python setup.py --name` (chooses the target and its sources, compiles nothing) where
    torch_npu imports (an empty stand-in package) and the CANN variables are as given."""
    fake = tmp_path / "fake_site" / "torch_npu"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text("")
    base = {k: v for k, v in os.environ.items() if k not in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH",
                                                             "OFFLOAD_BUILD_TARGET", "PYTHONPATH")}
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**base, "PYTHONPATH": str(fake.parent), **env})


# setup.py's last place to look; where CANN is installed there, "not found" cannot be shown.
CANN_DEFAULT = Path("/usr/local/Ascend/ascend-toolkit/latest")
needs_no_default_cann = pytest.mark.skipif((CANN_DEFAULT / "include" / "acl" / "acl.h").exists(),
                                           reason=f"CANN is installed at {CANN_DEFAULT}, where setup.py finds it")


def _fake_cann(root: Path) -> Path:
    (root / "include" / "acl").mkdir(parents=True)
    (root / "include" / "acl" / "acl.h").write_text("")
    (root / "lib64").mkdir()
    (root / "lib64" / "libascendcl.so").write_bytes(b"")
    return root


@needs_no_default_cann
def test_npu_setup_without_cann_names_where_it_looked(tmp_path):
    empty = tmp_path / "no_cann"
    empty.mkdir()
    result = _setup_name(tmp_path, OFFLOAD_BUILD_TARGET="npu", ASCEND_TOOLKIT_HOME=str(empty))
    assert result.returncode != 0
    assert "offload: OFFLOAD_BUILD_TARGET=npu needs CANN" in result.stderr
    assert f"ASCEND_TOOLKIT_HOME={empty}" in result.stderr and "set_env.sh" in result.stderr


# "auto" takes CUDA first where torch is a CUDA build and nvcc is found (setup.choose_target);
# an Ascend host's torch is not, so the auto choices below are asserted only where that holds.
CUDA_FIRST = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
auto_as_on_ascend = pytest.mark.skipif(CUDA_FIRST, reason="auto builds the CUDA target with this CUDA torch and nvcc")


@pytest.mark.parametrize("variable", ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"])
def test_npu_setup_finds_cann_from_its_environment(tmp_path, variable):
    cann = _fake_cann(tmp_path / "cann")
    result = _setup_name(tmp_path, OFFLOAD_BUILD_TARGET="npu", **{variable: str(cann)})
    assert result.returncode == 0, result.stderr
    assert "building target 'npu'" in result.stdout


@auto_as_on_ascend
@pytest.mark.parametrize("variable", ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"])
def test_npu_setup_auto_finds_cann_from_its_environment(tmp_path, variable):
    cann = _fake_cann(tmp_path / "cann")
    result = _setup_name(tmp_path, **{variable: str(cann)})
    assert result.returncode == 0, result.stderr
    assert "building target 'npu'" in result.stdout and f"CANN is at {cann}" in result.stdout


@needs_no_default_cann
@auto_as_on_ascend
def test_npu_setup_auto_without_cann_builds_the_cpu_core_and_says_why(tmp_path):
    empty = tmp_path / "no_cann"
    empty.mkdir()
    result = _setup_name(tmp_path, ASCEND_TOOLKIT_HOME=str(empty))
    assert result.returncode == 0, result.stderr
    assert "building target 'cpu' because torch_npu is installed but CANN was not found" in result.stdout
