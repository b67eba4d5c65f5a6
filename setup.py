"""Builds offload._C against the torch that is already installed.

    pip install --no-build-isolation .

OFFLOAD_BUILD_TARGET picks what is compiled:
    auto  (default) from how torch was built and which toolkits exist, never from
          whether a GPU is visible, so a build node without a GPU builds the CUDA core
    cuda  C++ core + CUDA kernels (needs a CUDA build of torch and nvcc)
    npu   C++ core + the ACL host-memory pinner for Ascend (needs torch_npu and CANN, found from
          ASCEND_TOOLKIT_HOME or ASCEND_HOME_PATH as CANN's set_env.sh exports them)
    cpu   C++ core only: the native logic, compiled and tested on a CPU-only torch
    none  pure Python: the pure-PyTorch path everywhere
MAX_JOBS caps parallel compile jobs (default: sized to cores and memory).
OFFLOAD_DEBUG=1 builds with debug information and without optimization (default: a release
build, no debug information).
"""

import glob
import json
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    # pip's build isolation runs this file in a temporary environment holding only the build
    # requirements; its folders are named pip-build-env-*. torch is deliberately not one of them.
    if any("pip-build-env" in entry for entry in sys.path):
        sys.exit(
            "offload: pip's build isolation hid torch: this build runs in a temporary environment without it.\n"
            "Build against the torch you have installed with\n"
            "    pip install --no-build-isolation .\n"
            "(an isolated build would need its own torch, and the core must match the one you run)."
        )
    sys.exit(
        f"offload: torch is not installed for {sys.executable}. Install torch first, then build offload "
        "against it with\n"
        "    pip install --no-build-isolation ."
    )

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = ("auto", "cuda", "npu", "cpu", "none")
DEBUG = os.environ.get("OFFLOAD_DEBUG", "0").strip() not in ("", "0")
STAMP = os.path.join(HERE, "build", "offload-build-stamp.json")


def _has_torch_npu() -> bool:
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return False
    return True


CANN_VARIABLES = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"


def find_cann():
    """(root, searched): the CANN toolkit holding include/acl/acl.h and lib64/libascendcl.so, or None."""
    searched = [(name, os.environ[name]) for name in CANN_VARIABLES if os.environ.get(name)]
    searched.append(("default", CANN_DEFAULT))
    for _, root in searched:
        if os.path.isfile(os.path.join(root, "include", "acl", "acl.h")) and \
                os.path.isfile(os.path.join(root, "lib64", "libascendcl.so")):
            return root, searched
    return None, searched


def _cann_not_found(searched) -> str:
    places = ", ".join(f"{where}={root}" if where != "default" else root for where, root in searched)
    return (f"CANN was not found (looked for include/acl/acl.h and lib64/libascendcl.so in {places}); "
            "source CANN's set_env.sh (it sets ASCEND_TOOLKIT_HOME) or set ASCEND_TOOLKIT_HOME")


def choose_target():
    """(target, reason): what to build and why, printed as one line."""
    asked = os.environ.get("OFFLOAD_BUILD_TARGET", "auto").strip().lower()
    if asked not in TARGETS:
        sys.exit(f"offload: OFFLOAD_BUILD_TARGET must be one of {', '.join(TARGETS)}, got {asked!r}")
    if asked == "cuda" and (torch.version.cuda is None or cpp_extension.CUDA_HOME is None):
        sys.exit(
            f"offload: OFFLOAD_BUILD_TARGET=cuda needs a CUDA build of torch (this one: {torch.__version__}) "
            f"and the CUDA toolkit (CUDA_HOME: {cpp_extension.CUDA_HOME})"
        )
    if asked == "npu" and not _has_torch_npu():
        sys.exit("offload: OFFLOAD_BUILD_TARGET=npu needs torch_npu installed (pip install offload[npu])")
    if asked == "npu" and find_cann()[0] is None:
        sys.exit(f"offload: OFFLOAD_BUILD_TARGET=npu needs CANN: {_cann_not_found(find_cann()[1])}")
    if asked != "auto":
        return asked, "OFFLOAD_BUILD_TARGET"
    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None:
        return "cuda", f"torch {torch.__version__} is a CUDA {torch.version.cuda} build and nvcc is at {cpp_extension.CUDA_HOME}"
    if _has_torch_npu():
        root, searched = find_cann()
        if root is not None:
            return "npu", f"torch_npu is installed and CANN is at {root}"
        return "cpu", f"torch_npu is installed but {_cann_not_found(searched)}; building the C++ core only"
    if torch.version.cuda is not None:
        return "cpu", f"torch is a CUDA build but no CUDA toolkit was found (set CUDA_HOME); building the C++ core only"
    return "cpu", f"torch {torch.__version__} has no accelerator build"


def default_max_jobs() -> str:
    """Each nvcc/g++ job on torch headers takes 1-2 GB; keep below memory (flash-attention's rule)."""
    cores = os.cpu_count() or 1
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gb = 8
    return str(max(1, min(cores, int(mem_gb // 3))))


def links_libstdcxx_statically(cxx: str) -> bool:
    """True when `cxx` has no shared libstdc++ and would copy it into offload._C.

    Seen on a GPU host whose CXX was a private gcc build: the extension then carried
    its own libstdc++ beside torch's, and its first formatted error message crashed
    in locale code. Asking the compiler where libstdc++.so is answers without
    building anything: it echoes the bare name when it has none.
    """
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return found == "libstdc++.so"


def choose_compiler() -> None:
    cxx = os.environ.get("CXX", "c++")
    if not links_libstdcxx_statically(cxx):
        return
    system = shutil.which("g++", path="/usr/bin:/bin") or shutil.which("c++", path="/usr/bin:/bin")
    if system and not links_libstdcxx_statically(system):
        print(f"offload: {cxx} has no shared libstdc++, so offload._C would carry a second copy beside torch's; "
              f"building with {system} instead (set CXX to choose another)", flush=True)
        os.environ["CXX"] = system
        if os.environ.get("CC") and links_libstdcxx_statically(os.environ["CC"]):
            os.environ["CC"] = shutil.which("gcc", path="/usr/bin:/bin") or os.environ["CC"]
    else:
        print(f"offload: warning: {cxx} has no shared libstdc++; offload._C may crash when it formats an error. "
              "Set CXX to a compiler with a shared libstdc++ (the one torch was built with).", flush=True)


def extensions(target: str):
    if target == "none":
        return []
    os.environ.setdefault("MAX_JOBS", default_max_jobs())
    choose_compiler()
    # csrc/core: the native core, no Python headers; csrc/python: its pybind11
    # bindings and the module entry point; csrc/core/cuda: what only CUDA needs.
    sources = sorted(glob.glob(os.path.join("csrc", "core", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "python", "*.cpp")))
    torch_version = torch.__version__
    macros = [
        ("OFFLOAD_TARGET", f'"{target}"'),
        ("OFFLOAD_TORCH_VERSION", f'"{torch_version}"'),
    ]
    include_dirs = [os.path.join(HERE, "csrc", "include")]
    # Python's own CFLAGS (which torch's build puts first on every compile line) hold -g: a
    # release core would carry ~45 MB of debug information. -g0 after them wins.
    cxx = (["-O0", "-g"] if DEBUG else ["-O3", "-g0"]) + ["-std=c++17", "-fvisibility=hidden"]
    if target == "cuda":
        sources += sorted(glob.glob(os.path.join("csrc", "core", "cuda", "*.cu")))
        sources += sorted(glob.glob(os.path.join("csrc", "core", "cuda", "*.cpp")))
        macros += [("OFFLOAD_WITH_CUDA", "1"), ("OFFLOAD_CUDA_VERSION", f'"{torch.version.cuda}"')]
        # -lineinfo: source lines for profilers, no debug information; -G (device debug) only in a debug build.
        nvcc = (["-O0", "-g", "-G"] if DEBUG else ["-O3", "-lineinfo"]) + ["-std=c++17", "--expt-relaxed-constexpr"]
        return [
            cpp_extension.CUDAExtension(
                "offload._C",
                sources,
                include_dirs=include_dirs,
                define_macros=macros,
                extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            )
        ]
    link = {}
    if target == "npu":
        # csrc/core/npu: the ACL pinner. It uses ACL's C API only, so CANN's headers and
        # libascendcl suffice; torch_npu's headers are not needed.
        cann = find_cann()[0]
        sources += sorted(glob.glob(os.path.join("csrc", "core", "npu", "*.cpp")))
        macros += [("OFFLOAD_WITH_NPU", "1")]
        include_dirs.append(os.path.join(cann, "include"))
        lib = os.path.join(cann, "lib64")
        link = {"library_dirs": [lib], "runtime_library_dirs": [lib], "libraries": ["ascendcl"]}
    return [
        cpp_extension.CppExtension(
            "offload._C", sources, include_dirs=include_dirs, define_macros=macros, extra_compile_args=cxx, **link
        )
    ]


def build_stamp(root: str) -> dict:
    """What the compiled core depends on, as one hash: every file under csrc/, setup.py and
    pyproject.toml, the environment (sys.prefix), torch's version and location, and the build
    switches. A build writes it to build/offload-build-stamp.json; scripts/_setup.py computes it
    with this same function (read from this file) and skips its build while the two match."""
    import hashlib

    digest = hashlib.sha256()
    names = sorted(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                   for folder, _, files in os.walk(os.path.join(root, "csrc")) for name in files)
    for name in names + ["setup.py", "pyproject.toml"]:
        digest.update(name.encode())
        with open(os.path.join(root, name), "rb") as f:
            digest.update(f.read())
    for value in (sys.prefix, torch.__version__, torch.__file__,
                  os.environ.get("OFFLOAD_BUILD_TARGET", "auto").strip().lower(),
                  os.environ.get("OFFLOAD_DEBUG", "0").strip()):
        digest.update(b"\0" + value.encode())
    return {"hash": digest.hexdigest(), "python": sys.executable, "torch": torch.__version__}


def write_build_stamp(native: bool) -> None:
    """Record a finished build, so that the two commands (scripts/) skip theirs after a user's
    `pip install --no-build-isolation -e .`."""
    os.makedirs(os.path.dirname(STAMP), exist_ok=True)
    with open(STAMP, "w") as f:
        json.dump({**build_stamp(HERE), "native": native}, f, indent=2)


class BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    def run(self):
        super().run()
        write_build_stamp(native=True)


class BuildPy(build_py):
    def run(self):
        super().run()
        if TARGET == "none":  # nothing to compile: build_ext does not run
            write_build_stamp(native=False)


TARGET, REASON = choose_target()
print(f"offload: building target '{TARGET}' because {REASON}", flush=True)

setup(
    packages=find_packages(include=["offload", "offload.*"]),
    ext_modules=extensions(TARGET),
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
)
