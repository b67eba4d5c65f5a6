"""benchmarks/probe_peak.py's reading of an allocator trace: the peak of what a step allocated,
and what is live there by allocation site; the device calls it makes refuse the host."""

import pytest
import torch

from benchmarks import probe_peak
from offload.core import _device


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def _alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr, size):
    return {"action": "free_completed", "addr": addr, "size": size, "frames": []}


INDUCTOR = _frame("/tmp/torchinductor_root/ab/cabc.py", 120, "call")
TRANSPORT = _frame("/x/offload/activation/compiled/transport.py", 157, "group_prefetch")
TORCH = _frame("/x/torch/_tensor.py", 10, "backward")


def test_probe_peak_finds_the_peak_and_what_is_live_there():
    trace = [
        _free(99, 1 << 20),  # allocated before the trace began: not counted
        _alloc(1, 100, TORCH, INDUCTOR),
        _alloc(2, 300, TORCH, TRANSPORT),
        _alloc(3, 50, TORCH, INDUCTOR),
        _free(2, 300),
        _alloc(4, 200, TORCH),  # the peak came before: 450 bytes after the third alloc
        _free(1, 100),
    ]
    found = probe_peak.peak_composition(trace)
    assert found.peak_bytes == 450 and found.at_event == 3
    assert found.by_site == [("transport.py:157 group_prefetch", 300, 1), ("cabc.py:120 call", 150, 2)]
    assert [size for size, _ in found.largest] == [300, 100, 50]
    assert found.largest[0][1] == ["_tensor.py:10 backward", "transport.py:157 group_prefetch"]


def test_probe_peak_site_falls_back_to_the_innermost_frame():
    assert probe_peak.site_of([TORCH, _frame("/x/torch/nn/functional.py", 5, "linear")]) == "_tensor.py:10 backward"
    assert probe_peak.site_of([]) == "(no stack)"


@pytest.mark.skipif(_device.accelerator_type() is not None, reason="the host's refusal")
def test_probe_peak_device_calls_refuse_the_host():
    with pytest.raises(RuntimeError, match="record_memory_history needs an accelerator, got device cpu"):
        _device.record_memory_history(torch.device("cpu"), True)
    with pytest.raises(RuntimeError, match="memory_snapshot needs an accelerator, got device cpu"):
        _device.memory_snapshot(torch.device("cpu"))
    assert probe_peak.main([]) == 2
