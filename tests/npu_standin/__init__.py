"""The npu stand-in: a test-only accelerator that makes offload's NPU path run in CPU CI.

`install()` builds (once; the build is cached under the repository's build/) and
loads standin.cpp, which registers PyTorch's PrivateUse1 device over host memory
with real c10 streams and events, renames it "npu", and registers this module's
`torch.npu` surface: the calls offload/core/_device.py makes on torch_npu's
`torch.npu` (streams, events, the current stream, synchronize, memory statistics,
RNG state). Work on the stand-in runs synchronously on the calling thread: an
event is complete when recorded. It has no pinned host memory and no DMA engine.

tests/conftest.py calls `install()` before offload is imported when
OFFLOAD_TEST_DEVICE=npu.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from pathlib import Path
from typing import Optional

import torch

_HERE = Path(__file__).resolve().parent
_BUILD = _HERE.parent.parent / "build" / "npu_standin"
_native = None
build_seconds: Optional[float] = None  # how long loading (and, when stale, compiling) took


def _load_native():
    global _native, build_seconds
    if _native is None:
        from torch.utils.cpp_extension import load

        _BUILD.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        _native = load(
            name="offload_npu_standin",
            sources=[str(_HERE / "standin.cpp")],
            build_directory=str(_BUILD),
            extra_cflags=["-O1"],
            verbose=bool(os.environ.get("OFFLOAD_STANDIN_VERBOSE")),
        )
        build_seconds = time.perf_counter() - t0
    return _native


def _index(device=None) -> int:
    if device is None:
        return _native.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "npu":
        raise ValueError(f"npu stand-in: expected an npu device, got {device}")
    return _native.current_device() if device.index is None else device.index


def _device(device=None) -> torch.device:
    return torch.device("npu", _index(device))


def _build_module() -> types.ModuleType:
    """The stand-in's `torch.npu`: the subset of torch_npu's surface offload and torch's utilities call."""
    mod = types.ModuleType("torch.npu")
    mod.__doc__ = "offload's test-only stand-in for torch_npu's torch.npu"
    mod._initialized = True  # torch.utils.checkpoint stashes device RNG state only when set

    def is_available() -> bool:
        return True

    def is_initialized() -> bool:
        return True

    def device_count() -> int:
        return _native.device_count()

    def current_device() -> int:
        return _native.current_device()

    def set_device(device) -> None:
        _native.set_device(_index(device))

    @contextlib.contextmanager
    def device(device):
        previous = _native.current_device()
        if device is not None and _index(device) >= 0:
            _native.set_device(_index(device))
        try:
            yield
        finally:
            _native.set_device(previous)

    class Stream(torch.Stream):
        """A c10 stream of the stand-in (torch.Stream with torch_npu's constructor)."""

        def __new__(cls, device=None, priority: int = 0, **kwargs):
            return super().__new__(cls, device=_device(device), priority=priority, **kwargs)

        def __init__(self, device=None, priority: int = 0, **kwargs):
            pass

    def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        """A c10 event of the stand-in (torch.Event: torch's event methods take no subclass);
        no interprocess handles (one process only)."""
        if interprocess:
            raise RuntimeError("npu stand-in: interprocess events are not supported")
        return torch.Event(device=_device(), enable_timing=enable_timing, blocking=blocking)

    def current_stream(device=None):
        return torch.accelerator.current_stream(_device(device))

    def set_stream(stream) -> None:
        torch.accelerator.set_stream(stream)

    @contextlib.contextmanager
    def stream(s):
        if s is None:
            yield
            return
        previous = torch.accelerator.current_stream(s.device)
        torch.accelerator.set_stream(s)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    def synchronize(device=None) -> None:
        _index(device)  # the device is checked; all work is already complete

    def memory_allocated(device=None) -> int:
        return _native.memory_allocated(_index(device))

    def max_memory_allocated(device=None) -> int:
        return _native.max_memory_allocated(_index(device))

    def memory_reserved(device=None) -> int:
        return _native.memory_allocated(_index(device))  # nothing is cached: reserved is allocated

    def reset_peak_memory_stats(device=None) -> None:
        _native.reset_peak_memory_stats(_index(device))

    def mem_get_info(device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return max(0, total - _native.memory_allocated(_index(device))), total

    def empty_cache() -> None:
        pass

    def get_device_properties(device=None):
        _index(device)
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="offload npu stand-in", total_memory=total, multi_processor_count=1)

    def get_device_name(device=None) -> str:
        return get_device_properties(device).name

    def get_rng_state(device="npu") -> torch.Tensor:
        return _native.get_rng_state(_index(device))

    def set_rng_state(new_state: torch.Tensor, device="npu") -> None:
        _native.set_rng_state(new_state, _index(device))

    def manual_seed(seed: int) -> None:
        _native.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF, _native.current_device())

    def manual_seed_all(seed: int) -> None:
        for i in range(_native.device_count()):
            _native.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF, i)

    def initial_seed() -> int:
        return _native.initial_seed(_native.current_device())

    def _is_in_bad_fork() -> bool:  # torch.manual_seed asks before seeding the device
        return False

    def get_amp_supported_dtype():
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported() -> bool:
        return True

    for fn in (is_available, is_initialized, device_count, current_device, set_device, device, current_stream,
               set_stream, stream, synchronize, memory_allocated, max_memory_allocated, memory_reserved,
               reset_peak_memory_stats, mem_get_info, empty_cache, get_device_properties, get_device_name,
               get_rng_state, set_rng_state, manual_seed, manual_seed_all, initial_seed, get_amp_supported_dtype,
               is_bf16_supported, _is_in_bad_fork):
        setattr(mod, fn.__name__, fn)
    mod.Stream = Stream
    mod.Event = Event
    mod.native = _native
    return mod


def installed() -> bool:
    return "torch.npu" in sys.modules and getattr(sys.modules["torch.npu"], "native", None) is _native is not None


def event_calls() -> dict:
    """The stand-in's event calls so far: events created, recorded, waited on (a stream made to
    wait), queried and destroyed. Each is a driver call on a real accelerator, so a test can bound
    the calls a piece of offload's work makes."""
    return dict(_load_native().event_calls())


def install() -> types.ModuleType:
    """Build and load the stand-in, name it "npu" and register its `torch.npu`. Idempotent."""
    if installed():
        return sys.modules["torch.npu"]
    if hasattr(torch, "npu"):
        raise RuntimeError("npu stand-in: torch already has an npu backend (torch_npu?)")
    native = _load_native()
    torch.utils.rename_privateuse1_backend("npu")
    native.register_hooks()
    mod = _build_module()
    torch._register_device_module("npu", mod)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    return mod
