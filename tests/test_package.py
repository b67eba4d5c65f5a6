"""The package as a user meets it: imports everywhere, says which core it uses and
why, chooses its build target as documented, and names no accelerator outside the
device module."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import offload
from offload.core import _backend

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, **env):
    full_env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_FORCE_FALLBACK"}
    full_env.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


def test_package_names_no_accelerator_outside_the_device_module():
    pattern = re.compile(r"torch\." + r"cuda\.")  # split so this file does not match itself
    offenders = []
    for folder in ("offload", "benchmarks", "tests", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() == "offload/core/_device.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


# Every "cuda" string literal in offload/ outside the device module, with why it names CUDA.
_CUDA_LITERALS = {
    ("offload/core/_backend.py", 'device_type == "cuda"'): "a CPU-only build has no CUDA kernels",
    ("offload/weights/bucket_pack.py", '("cpu", "cuda")'): "the bucket kernels exist for the CPU and CUDA only",
    ("offload/weights/link.py", 'device.type == "cuda"'): "SMs left to a collective are a CUDA kernel's cap",
}
_CUDA_LITERAL_FILES = {
    "offload/core/_device.py": "the one module that knows cuda from npu from cpu",
    "offload/info.py": "reports what the build and the runtime are, CUDA's among them",
}


def test_package_cuda_strings_only_where_explained():
    pattern = re.compile(r"""["']cuda["']""")
    offenders = []
    for path in (ROOT / "offload").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel in _CUDA_LITERAL_FILES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and not any(rel == f and snippet in line for f, snippet in _CUDA_LITERALS):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == [], "a device-generic path names CUDA; ask offload.core._device instead, or explain it here"


def test_package_public_api_is_importable():
    for name in offload.__all__:
        assert hasattr(offload, name), name


def test_package_import_leaves_dynamo_unimported_until_an_engine_is_made():
    # dynamo costs over a second per process; offload needs it only to keep its hooks out of a
    # compiled layer's graph (Note [not traced, lazily]).
    result = run_python("import sys, torch, offload; before = 'torch._dynamo' in sys.modules; "
                        "offload.activation_offload(); print(before, 'torch._dynamo' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def test_package_imports_when_the_fallback_is_forced():
    result = run_python("import offload; from offload.core import _backend; "
                        "print(offload.native_available(), _backend.why_not())", OFFLOAD_FORCE_FALLBACK="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False OFFLOAD_FORCE_FALLBACK is set"


def test_package_imports_without_the_compiled_core():
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'offload._C':\n"
        "            raise ImportError('no compiled core in this install')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, offload\n"
        "from offload.core import _backend\n"
        "print(offload.native_available()); print(_backend.why_not())\n"
        "x = torch.arange(5, device=offload.core._device.current_device())\n"
        "print(offload.copy_to_host([x]).wait()[0].tolist())\n"
    )
    result = run_python(blocker)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "False"
    assert "could not be imported" in lines[1] and "no compiled core" in lines[1]
    assert lines[2] == "[0, 1, 2, 3, 4]"


@pytest.mark.parametrize("forced", [False, True])
def test_package_warns_once_when_an_accelerator_has_no_compiled_core(forced):
    # An accelerator is made to appear (accelerator_type patched) and the core cannot be imported:
    # the first use says so once, later uses stay quiet; a forced fallback says nothing.
    script = (
        "import sys, warnings\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'offload._C':\n"
        "            raise ImportError('no compiled core in this install')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import offload\n"
        "from offload.core import _backend, _device\n"
        "_device.accelerator_type = lambda: 'cuda'\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(3):\n"
        "        assert _backend.core() is None\n"
        "print(len(seen))\n"
        "print(seen[0].message if seen else '')\n"
    )
    result = run_python(script, **({"OFFLOAD_FORCE_FALLBACK": "1"} if forced else {}))
    assert result.returncode == 0, result.stderr
    count, message = (result.stdout.strip().splitlines() + [""])[:2]
    if forced:
        assert count == "0"
    else:
        assert count == "1" and "pure-PyTorch path" in message and "no compiled core" in message


def test_package_info_reports_versions_and_backends():
    result = subprocess.run([sys.executable, "-m", "offload.info"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    import torch

    assert torch.__version__ in result.stdout
    assert "copy engine:" in result.stdout and "host pool:" in result.stdout
    expected = "native" if _backend.native_available() else "pure PyTorch"
    assert re.search(r"core\s+: " + expected, result.stdout)


def test_package_info_says_why_the_fallback_is_used():
    result = subprocess.run([sys.executable, "-m", "offload.info"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OFFLOAD_FORCE_FALLBACK": "1"})
    assert result.returncode == 0, result.stderr
    assert "pure PyTorch (OFFLOAD_FORCE_FALLBACK is set)" in result.stdout


@pytest.mark.parametrize("target, expected", [("none", "building target 'none'"), ("cpu", "building target 'cpu'")])
def test_package_setup_reports_the_chosen_target(target, expected):
    result = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OFFLOAD_BUILD_TARGET": target})
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


def test_package_setup_rejects_an_unknown_target():
    result = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OFFLOAD_BUILD_TARGET": "tpu"})
    assert result.returncode != 0
    assert "OFFLOAD_BUILD_TARGET must be one of auto, cuda, npu, cpu, none, got 'tpu'" in result.stderr


def test_package_build_info_matches_the_running_torch():
    if not _backend.native_available():
        pytest.skip(f"needs the compiled core: {_backend.why_not()}")
    info = _backend.build_info()
    assert {"target", "torch_version", "build_date", "features"} <= set(info)
    assert "a_host_pool" in info["features"] and "b_copy_engine" in info["features"]
    assert _backend.torch_mismatch() is None


@pytest.mark.parametrize("isolated", [True, False])
def test_package_setup_says_why_torch_is_missing(tmp_path, isolated):
    # pip's isolated build puts folders named pip-build-env-* on sys.path and leaves torch out.
    folder = tmp_path / ("pip-build-env-test" if isolated else "plain") / "site"
    folder.mkdir(parents=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is not in this environment')\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    result = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(folder)})
    assert result.returncode != 0
    if isolated:
        assert "pip's build isolation hid torch" in result.stderr
        assert "pip install --no-build-isolation ." in result.stderr
    else:
        assert f"torch is not installed for {sys.executable}" in result.stderr


def test_package_names_a_source_tree_that_shadows_an_installed_build(tmp_path):
    # A clone's offload/ (sources only) imported ahead of an installed offload that has its core.
    import importlib.machinery

    source, installed = tmp_path / "clone", tmp_path / "site-packages"
    for dest in (source, installed):
        for path in (ROOT / "offload").rglob("*.py"):
            target = dest / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text())
    (installed / "offload" / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    script = (
        "import sys\n"
        "class Block:\n"  # the clone has no core; an editable install elsewhere must not serve one
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'offload._C':\n"
        "            raise ImportError('no compiled core here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import offload\n"
        "from offload.core import _backend\n"
        "print(_backend.why_not())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_FORCE_FALLBACK"}
    result = subprocess.run([sys.executable, "-c", script], cwd=source, capture_output=True, text=True, timeout=300,
                            env={**env, "PYTHONPATH": str(installed)})
    assert result.returncode == 0, result.stderr
    said = result.stdout.strip()
    assert f"the source tree at {source / 'offload'} has no compiled core" in said
    assert f"shadows the installed build at {installed / 'offload'}" in said


def test_package_info_says_what_has_run_where():
    result = subprocess.run([sys.executable, "-m", "offload.info"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    target = _backend.build_info().get("target", "none (no compiled core)")
    assert re.search(r"build target\s+: " + re.escape(target) + "\n", result.stdout)
    assert re.search(r"host pinner\s+: \S", result.stdout)
    assert "not measured on an NPU" in result.stdout and "OFFLOAD_TEST_DEVICE=npu" in result.stdout
    assert "python -m benchmarks" in result.stdout


def test_package_info_names_the_host_pinner_with_and_without_the_core_query():
    from offload import info

    class Core:  # a core that answers the query
        def __init__(self, registered):
            self.registered = registered

        def host_pinner_registered(self, device_type):
            return device_type in self.registered

    assert info.host_pinner(None, None).startswith("none: no compiled core")
    assert info.host_pinner(Core({"npu"}), "cpu") == "none: a cpu build pins nothing (slabs stay pageable)"
    assert info.host_pinner(Core({"npu"}), "npu").startswith("ACL aclrtHostRegisterV2 (ACL_HOST_REG_PINNED), "
                                                               "registered; checked against the device")
    assert "lacks ACL_HOST_REG_PINNED" in info.host_pinner(Core(set()), "npu")
    assert info.host_pinner(Core({"cuda"}), "cuda") == "cudaHostRegister, registered"
    assert info.host_pinner(object(), "npu").endswith(": not reported by this core")  # a core without the query


def test_package_core_reports_no_host_pinner_on_a_cpu_build():
    core = _backend.loaded_core()
    if core is None or not hasattr(core, "host_pinner_registered"):
        pytest.skip("needs a compiled core with host_pinner_registered")
    if _backend.build_info().get("target") != "cpu":
        pytest.skip(f"needs a cpu build, this one is {_backend.build_info().get('target')}")
    assert [core.host_pinner_registered(t) for t in ("cpu", "cuda", "npu")] == [False, False, False]
    with pytest.raises(ValueError, match="device_type must be 'cpu', 'cuda' or 'npu', got 'tpu'"):
        core.host_pinner_registered("tpu")
