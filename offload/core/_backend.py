"""Loads the compiled core `offload._C`, or records why it is not there.

`import offload` must never fail because of the extension: a user who installed
with OFFLOAD_BUILD_TARGET=none, whose build failed, or whose torch changed since the
build still gets the pure-PyTorch path. `import offload` itself says nothing; the
first use of a path that the core would serve warns once, and only on a machine with
an accelerator (on the CPU the pure-PyTorch path costs little). `python -m offload.info`
says why the core is not in use, naming a source tree that shadows an installed build.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from . import _device

_core = None
_why_not: Optional[str] = None
_build_info: dict = {}
_warned = False


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _drives(built_target: str, device_type: str) -> bool:
    """Whether a core built for `built_target` can drive `device_type`'s copies.

    The core is device-generic (c10::Stream / c10::Event, Tensor::copy_): what is
    target-specific is the CUDA kernels and the host-memory pinners. A CPU-only build
    does not drive CUDA; the CPU and a PrivateUse1 accelerator ("npu": torch_npu, or
    the test suite's stand-in) run on any build, their pool's slabs pinned only where
    the build registered a pinner for them (else HostPool keeps torch's pinned
    allocator where torch has one).
    """
    return not (built_target == "cpu" and device_type == "cuda")


def _load() -> None:
    global _core, _why_not, _build_info
    if _truthy(os.environ.get("OFFLOAD_FORCE_FALLBACK")):
        _why_not = "OFFLOAD_FORCE_FALLBACK is set"
        return
    try:
        from .. import _C  # type: ignore[attr-defined]
    except ImportError as exc:
        _why_not = _shadowing() or _unbuilt() or f"offload._C could not be imported ({exc})"
        return
    except Exception as exc:  # a broken build must not break `import offload`
        _why_not = f"offload._C failed to load: {type(exc).__name__}: {exc}"
        return
    _build_info = dict(_C.build_info())
    built_target = _build_info.get("target", "cpu")
    runtime = _device.compute_device_type()
    if not _drives(built_target, runtime):
        _why_not = (
            f"offload._C was built for the CPU only but torch sees a {runtime} device; "
            "rebuild with `pip install --no-build-isolation .` on this machine"
        )
        return
    _core = _C


def _built_core(package: Path) -> Optional[Path]:
    """The compiled core file inside an `offload` package folder, if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        found = package / f"_C{suffix}"
        if found.is_file():
            return found
    return None


def _unbuilt() -> str:
    """A sentence when this offload has no compiled core file at all (nothing failed to load)."""
    here = Path(__file__).resolve().parent.parent
    if _built_core(here) is not None:
        return ""
    return (f"offload._C could not be imported: {here} has no compiled core (installed with "
            "OFFLOAD_BUILD_TARGET=none, or its build failed); build it with `pip install --no-build-isolation .`")


def _shadowing() -> str:
    """A sentence when this offload has no compiled core but another one on sys.path has.

    The usual cause: `pip install .` put a built offload into site-packages, and Python
    run from the checkout's root imports the checkout's `offload/` (sources only) first.
    """
    here = Path(__file__).resolve().parent.parent
    if _built_core(here) is not None:
        return ""
    for entry in sys.path:
        other = Path(entry or os.getcwd()) / "offload"
        try:
            if other.resolve() == here or not other.is_dir():
                continue
        except OSError:
            continue
        built = _built_core(other)
        if built is not None:
            return (f"offload._C could not be imported: the source tree at {here} has no compiled core and shadows "
                    f"the installed build at {other}; run from another directory to use the installed build, or "
                    f"build this tree in place with `pip install --no-build-isolation -e {here.parent}`")
    return ""


_load()


def core():
    """The compiled module, or None when the pure-PyTorch path is in use."""
    if _core is None and _why_not is not None:
        _warn_once()
    return _core


def loaded_core():
    """core() without its warning: for choices made at import, so that `import offload`
    stays quiet and the first use of a copy path is what says the core is missing."""
    return _core


def why_not() -> Optional[str]:
    return _why_not


def build_info() -> dict:
    return dict(_build_info)


def torch_mismatch() -> Optional[str]:
    """A sentence when the running torch differs from the one offload was built against."""
    built = _build_info.get("torch_version")
    if built and built.split("+")[0] != torch.__version__.split("+")[0]:
        return f"offload was built against torch {built} but torch {torch.__version__} is running"
    return None


def _warn_once() -> None:
    global _warned
    if _warned or _device.accelerator_type() is None:
        return
    if _truthy(os.environ.get("OFFLOAD_FORCE_FALLBACK")):
        return  # the user asked for it; nothing to tell them
    _warned = True
    warnings.warn(
        f"offload: using the pure-PyTorch path ({_why_not}). "
        "Copies are correct but slower; `python -m offload.info` says more.",
        RuntimeWarning,
        stacklevel=3,
    )


@contextlib.contextmanager
def force_fallback():
    """Run the enclosed code on the pure-PyTorch path (tests compare both paths)."""
    global _core
    saved = _core
    _core = None
    try:
        yield
    finally:
        _core = saved


def built_for(device_type: str) -> bool:
    """Whether the loaded core has native code for `device_type`: the CPU always, else the build's target.

    A core built for the CPU only (or for Ascend) has no CUDA kernels, whatever
    torch sees at run time; callers route other devices to the pure-PyTorch path.
    (What a core can drive, its pool and copy engine, is wider: `_drives`.)
    """
    return _core is not None and (device_type == "cpu" or _build_info.get("target") == device_type)


def native_available() -> bool:
    return _core is not None
