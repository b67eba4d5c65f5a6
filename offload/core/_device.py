"""The one module that knows CUDA from Ascend (torch_npu) from a CPU-only torch.

Everything else in offload asks this module for the compute device, its streams,
events, memory statistics and host-allocation calls. Keeping the accelerator
namespace (`torch.cuda`, `torch.npu`) behind these functions is what lets the
same engine run on NVIDIA and Ascend: nowhere else in the package may name it.

On a CPU-only torch the "compute device" is the CPU itself. Streams and events do
not exist there, so the helpers below degrade to synchronous no-ops and the
engine's logic (planning, packing, pooling, hooks) still runs in CI.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Optional

import torch

try:  # Ascend: importing torch_npu registers the "npu" device with torch.
    import torch_npu  # noqa: F401

    _HAS_TORCH_NPU = True
except Exception:  # pragma: no cover - depends on the machine
    _HAS_TORCH_NPU = False


@functools.lru_cache(maxsize=None)
def accelerator_type() -> Optional[str]:
    """'cuda', 'npu', or None when torch sees no accelerator.

    "npu" is whatever backend registered torch's `npu` device module: torch_npu on
    Ascend, or the test suite's stand-in device (tests/npu_standin), which takes
    this same branch.
    """
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return None


def compute_device_type() -> str:
    """The device type tensors are offloaded *from*: the accelerator, else 'cpu'."""
    return accelerator_type() or "cpu"


def _module(device_type: str):
    """The torch.<accelerator> namespace; only this file may touch it."""
    if device_type == "cuda":
        return torch.cuda
    if device_type == "npu":
        return torch.npu
    raise ValueError(f"offload: no accelerator module for device type {device_type!r}")


def is_accelerator(device: torch.device) -> bool:
    return device.type in ("cuda", "npu")


def device_count(device_type: str) -> int:
    """How many devices of `device_type` torch sees (the CPU counts as one; 0 for a type
    this torch has no runtime for)."""
    if device_type == "cpu":
        return 1
    if not is_accelerator(torch.device(device_type)) or accelerator_type() != device_type:
        return 0
    return int(_module(device_type).device_count())


def current_device() -> torch.device:
    kind = accelerator_type()
    if kind is None:
        return torch.device("cpu")
    return torch.device(kind, _module(kind).current_device())


def normalize_device(device=None) -> torch.device:
    """torch.device with an explicit index for accelerators ('cuda' -> 'cuda:0')."""
    if device is None:
        return current_device()
    device = torch.device(device)
    if is_accelerator(device) and device.index is None:
        if accelerator_type() != device.type:
            # Asking the runtime of an accelerator torch lacks for its current device fails
            # with an assertion ("Torch not compiled with CUDA enabled"), not an error to act on.
            others = f"its accelerator is {accelerator_type()}" if accelerator_type() else "it has only the cpu"
            raise ValueError(f"torch here has no {device.type} device; {others}")
        return torch.device(device.type, _module(device.type).current_device())
    return device


def multiprocessor_count(device=None) -> int:
    """Streaming multiprocessors (CUDA) or AI cores (Ascend) of `device`; 0 on the CPU or where torch does not say."""
    device = normalize_device(device)
    if not is_accelerator(device):
        return 0
    props = _module(device.type).get_device_properties(device)
    return int(getattr(props, "multi_processor_count", 0) or 0)


def device_name(device=None) -> str:
    device = normalize_device(device)
    if not is_accelerator(device):
        return "cpu"
    return _module(device.type).get_device_name(device.index)


# ---------------------------------------------------------------- streams


# device type -> a reader of the current stream's (stream id, device index, device type) by
# device index: a tuple, where torch.cuda.current_stream builds a Stream object through a
# device guard (tens of microseconds a call, and the activation engine asks many times a step).
_STREAM_KEYS = {"cuda": getattr(torch._C, "_cuda_getCurrentStream", None)}
_current_streams: dict = {}  # that tuple -> the Stream object made for it (a view: owns nothing)


def current_stream(device=None):
    """The stream compute is queued on; None on the CPU (everything is synchronous)."""
    if type(device) is torch.device and device.index is not None:  # the hot path: the engine's device
        read = _STREAM_KEYS.get(device.type)
        if read is not None:
            key = read(device.index)
            stream = _current_streams.get(key)
            if stream is None:
                if len(_current_streams) >= 64:  # streams made and dropped by the thousand
                    _current_streams.clear()
                stream = _current_streams[key] = _module(device.type).current_stream(device)
            return stream
    device = normalize_device(device)
    if not is_accelerator(device):
        return None
    return _module(device.type).current_stream(device)


def new_stream(device=None, priority: int = 0):
    device = normalize_device(device)
    if not is_accelerator(device):
        return None
    return _module(device.type).Stream(device=device, priority=priority)


_copy_streams: dict = {}
_copy_streams_lock = threading.Lock()


def copy_streams(device=None):
    """(device-to-host, host-to-device) streams of `device`, created once per process.

    Two dedicated streams so the two directions use both copy engines at once and
    neither waits behind compute queued on the current stream.
    """
    pair = _copy_streams.get(device)
    if pair is not None:  # the hot path: one dict lookup
        return pair
    device = normalize_device(device)
    if not is_accelerator(device):
        return None, None
    with _copy_streams_lock:
        pair = _copy_streams.get(device)
        if pair is None:
            pair = (new_stream(device), new_stream(device))
            _copy_streams[device] = pair
        return pair


def stream_context(stream):
    """`with stream_context(s):` makes s current; a no-op for None (CPU)."""
    if stream is None:
        return contextlib.nullcontext()
    return _module(stream.device.type).stream(stream)


def new_event(device=None, timing: bool = False):
    if type(device) is not torch.device or device.index is None:
        device = normalize_device(device)
    if not is_accelerator(device):
        return None
    return _module(device.type).Event(enable_timing=timing)


def synchronize(device=None) -> None:
    device = normalize_device(device)
    if is_accelerator(device):
        _module(device.type).synchronize(device)


def record_stream(tensor: torch.Tensor, stream) -> None:
    """Tell the caching allocator `tensor` is in use on `stream` (no-op on CPU)."""
    if stream is not None and is_accelerator(tensor.device):
        tensor.record_stream(stream)


# ---------------------------------------------------------------- memory


def memory_allocated(device=None) -> int:
    device = normalize_device(device)
    if not is_accelerator(device):
        return 0
    return _module(device.type).memory_allocated(device)


def max_memory_allocated(device=None) -> int:
    device = normalize_device(device)
    if not is_accelerator(device):
        return 0
    return _module(device.type).max_memory_allocated(device)


def memory_reserved(device=None) -> int:
    """Device memory the caching allocator holds (allocated or cached); 0 on the CPU."""
    device = normalize_device(device)
    if not is_accelerator(device):
        return 0
    return _module(device.type).memory_reserved(device)


def reset_peak_memory_stats(device=None) -> None:
    device = normalize_device(device)
    if is_accelerator(device):
        _module(device.type).reset_peak_memory_stats(device)


def mem_get_info(device=None):
    """(free, total) bytes of device memory; (0, 0) on the CPU."""
    device = normalize_device(device)
    if not is_accelerator(device):
        return 0, 0
    return _module(device.type).mem_get_info(device)


def record_memory_history(device, enabled: bool, max_entries: int = 400_000) -> None:
    """Start (with each allocation's Python stack) or stop the allocator's record of allocations
    and frees on `device`'s kind of accelerator, which `memory_snapshot` returns. A diagnostic's
    tool: recording costs host time per allocation."""
    memory = _allocator_memory(device, "record_memory_history")
    if enabled:
        memory._record_memory_history(max_entries=max_entries, stacks="python")
    else:
        memory._record_memory_history(enabled=None)


def memory_snapshot(device) -> dict:
    """The allocator's snapshot of `device`'s kind (its `device_traces` hold what
    `record_memory_history` recorded)."""
    return _allocator_memory(device, "memory_snapshot")._snapshot()


def _allocator_memory(device, fn: str):
    """The `memory` module of `device`'s accelerator kind; the host has no device allocator to record."""
    device = normalize_device(device)
    if not is_accelerator(device):
        raise RuntimeError(f"offload: {fn} needs an accelerator, got device {device}")
    return _module(device.type).memory


def empty_cache() -> None:
    kind = accelerator_type()
    if kind is not None:
        _module(kind).empty_cache()


@functools.lru_cache(maxsize=None)
def pinned_memory_supported() -> bool:
    """Whether torch can page-lock host memory here: only where it has an accelerator
    whose runtime provides a pinned host allocator (CUDA's always does; another
    backend is asked once, with a one-byte allocation)."""
    kind = accelerator_type()
    if kind is None:
        return False
    if kind == "cuda":
        return True
    try:
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:  # a backend without a host allocator (NotImplementedError is one)
        return False
    return True


def empty_pinned(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor from torch's own pinned allocator (plain memory on CPU)."""
    return torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=pinned_memory_supported())


def host_empty_cache() -> None:
    """Release torch's cached pinned blocks (torch >= 2.5 exposes this)."""
    release = getattr(torch._C, "_host_emptyCache", None)
    if release is not None and pinned_memory_supported():
        release()


def is_pinned(tensor: torch.Tensor) -> bool:
    if not pinned_memory_supported() or tensor.device.type != "cpu":
        return False
    return tensor.is_pinned()


def _sleep_kernel(device: torch.device):
    """The backend's sleep kernel (`_sleep(cycles)` of its device module), or None: the CPU,
    or a backend without one."""
    return getattr(_module(device.type), "_sleep", None) if is_accelerator(device) else None


def spin(device, cycles: int) -> None:
    """Queue a kernel that busy-waits `cycles` clock cycles (tests and benchmarks
    use it to hold a stream so that ordering bugs show). A no-op on the CPU."""
    device = normalize_device(device)
    sleep = _sleep_kernel(device)
    if sleep is not None:
        with _module(device.type).device(device):  # the kernel runs on the current device
            sleep(int(cycles))
    elif device.type == "npu":  # pragma: no cover - no sleep kernel; a large matmul holds the stream
        a = torch.empty(4096, 4096, device=device)
        for _ in range(max(1, int(cycles) // 50_000_000)):
            a @ a


# Cycles of the backend's sleep kernel a hold's rate is timed over, once per device.
_HOLD_CALIBRATION_CYCLES = 20_000_000


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_second(device: torch.device) -> float:
    """The rate of the backend's sleep kernel on `device`, timed once with events (the host waits)."""
    stream = current_stream(device)
    spin(device, 1000)  # the first launch loads the kernel
    start, end = new_event(device, timing=True), new_event(device, timing=True)
    start.record(stream)
    spin(device, _HOLD_CALIBRATION_CYCLES)
    end.record(stream)
    end.synchronize()
    return _HOLD_CALIBRATION_CYCLES / max(start.elapsed_time(end) / 1e3, 1e-6)


def hold(device, seconds: float) -> bool:
    """Queue about `seconds` of waiting on `device`'s current stream, without compute or
    memory traffic; False where nothing was queued: the backend has no sleep kernel (the CPU,
    or a backend whose device module lacks `_sleep`), or the stream is capturing a graph.

    Auto mode holds the stream as a measured step starts, so that the host queues the
    step's work before the device runs it, and event timestamps then time the device's
    work, not the host's pace (Note [measured at the device's pace] in
    activation/auto/measure.py).
    """
    device = normalize_device(device)
    if seconds <= 0 or _sleep_kernel(device) is None:
        return False
    capturing = getattr(_module(device.type), "is_current_stream_capturing", None)
    if capturing is not None and capturing():  # a graph would replay the wait every time
        return False
    spin(device, max(1, int(seconds * _sleep_cycles_per_second(device))))
    return True


# ---------------------------------------------------------------- versions


def runtime_versions() -> dict:
    """Versions of the accelerator runtime torch was built with."""
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if _HAS_TORCH_NPU:  # pragma: no cover - Ascend only
        versions["torch_npu"] = getattr(torch_npu, "__version__", "unknown")
        versions["cann"] = getattr(getattr(torch.version, "cann", None), "__str__", lambda: None)()
    return versions


def nvtx_range(name: str):
    """An NVTX/msTX range on accelerators that have one; a no-op elsewhere."""
    kind = accelerator_type()
    if kind == "cuda":
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


# ---- activation offload


def set_device(device) -> None:
    """Make `device` the current accelerator of this process (no-op for the CPU)."""
    device = torch.device(device)
    if is_accelerator(device):
        _module(device.type).set_device(device)


# ---- interprocess events (colocated weight sync)


def new_ipc_event(device=None):
    """An event another process on the same device can wait on; None on the CPU (no events there)."""
    device = normalize_device(device)
    if not is_accelerator(device):
        return None
    return _module(device.type).Event(interprocess=True)


def ipc_event_handle(event):
    """The picklable handle another process opens with `open_ipc_event`; None for None (CPU)."""
    return None if event is None else event.ipc_handle()


def open_ipc_event(device, handle):
    """The event of `handle` (from `ipc_event_handle` in another process) on `device`; None for None."""
    if handle is None:
        return None
    device = normalize_device(device)
    return _module(device.type).Event.from_ipc_handle(device, handle)
