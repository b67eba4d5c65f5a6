"""The reported sequence (a no-grad pass, two accumulated steps, two forwards under one backward)
bitwise with and without offload, repeated with fresh seeds (benchmarks/stress_activation.py);
and why a step that offloads nothing cannot change what backward reads."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import offload
from offload.core import _device
from offload.activation.engine import DEFAULT_MIN_TENSOR_BYTES
from _activation_helpers import one_thread, pool  # noqa: F401 (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `pytest` run as a script, not `python -m pytest` from the checkout
    sys.path.insert(0, ROOT)
from benchmarks import stress_activation as stress  # noqa: E402

pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)


# (mode, paused, threshold): nothing, some and all offloaded, and the handle paused, in every mode
# (auto-budget: a plan that offloads and recomputes).
FAST_VARIANTS = [("async", False, "default"), ("sync", False, "mixed"), ("auto", False, "all"), ("async", False, "all"),
                 ("auto-budget", False, "all"), ("sync", True, "all")]


@pytest.mark.filterwarnings("ignore:.*cannot meet memory_budget_bytes=0:UserWarning")  # auto-budget's, by design
def test_activation_stress_scenario_bitwise(backend):
    """Five fresh seeds per variant, one handle across them, each bitwise the model without
    offload, whose own second run reproduces it."""
    for mode, paused, threshold in FAST_VARIANTS:
        row = stress.run_variant(stress.Variant(mode, paused, threshold, 1, backend), repeats=5, first_seed=1000,
                                 reuse=5)
        assert not row["mismatches"] and not row["reference_unreproducible"], row
        assert row["thread_count_changed"] == 0
        assert (row["tensors_offloaded"] > 0) == (threshold != "default" and not paused), row


class _Saver(torch.autograd.Function):
    """Saves an activation, its transpose and a slice of it, and a tensor that needs no grad."""

    @staticmethod
    def forward(ctx, x, index, seen):
        ctx.seen = seen
        ctx.save_for_backward(x, x.t(), x[1:, ::2], index)
        seen["x"], seen["index"] = x, index
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.seen["saved"] = ctx.saved_tensors
        return grad * 2, None, None


class _Layer(nn.Module):
    def __init__(self, seen):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.seen = seen

    def forward(self, x):
        h = self.lin(x)
        return _Saver.apply(h, (h.detach() > 0).long(), self.seen)


@pytest.mark.parametrize("min_tensor_bytes", [DEFAULT_MIN_TENSOR_BYTES, 1])
def test_activation_stress_below_the_threshold_backward_reads_the_tensor_itself(min_tensor_bytes, backend, pool):
    """Below min_tensor_bytes the pack hook keeps (tensor, version) and the unpack hook returns
    that tensor: backward reads the very storage forward saved (a tensor that needs no grad is
    the same object; autograd rewraps one that does, over the same storage), so nothing there
    can differ from a run without offload. Above it, the same check sees the restored copy."""
    seen = {}
    model = nn.Sequential(_Layer(seen), nn.Linear(16, 16))
    handle = offload.enable_activation_offload(model, "sync", layers=["0", "1"], min_tensor_bytes=min_tensor_bytes,
                                               pool=pool, verbose=False)
    model(torch.randn(8, 16)).square().mean().backward()
    x, index = seen["x"], seen["index"]
    saved = seen["saved"]
    stats = handle.stats()
    for got, want in zip(saved, (x, x.t(), x[1:, ::2], index)):
        assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want)
    same_storage = [t.untyped_storage().data_ptr() == want.untyped_storage().data_ptr()
                    for t, want in zip(saved, (x, x, x, index))]
    if min_tensor_bytes == DEFAULT_MIN_TENSOR_BYTES:
        assert stats["tensors_offloaded"] == 0 and stats["tensors_kept"] >= 4
        assert all(same_storage) and saved[3] is index
        assert [t.storage_offset() for t in saved] == [t.storage_offset() for t in (x, x.t(), x[1:, ::2], index)]
    else:
        assert stats["tensors_offloaded"] >= 4
        assert not any(same_storage) and saved[3] is not index
    handle.disable()


@pytest.mark.slow
def test_activation_stress_script(tmp_path):
    """The script itself: every variant at one thread, a few repetitions, no mismatch; its JSON."""
    out = tmp_path / "stress.json"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stress_activation.py"), "--repeats",
                             "2", "--threads", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads(out.read_text())
    rows = summary["variants"]
    backends = 2 if summary["native"] else 1
    assert len(rows) == backends * len(stress.MODES) * (len(stress.THRESHOLDS) + 1)
    assert all(r["repetitions"] == 2 and not r["mismatches"] and not r["reference_unreproducible"] for r in rows)
    assert summary["control_thread_switch"]  # recorded, not judged: it depends on torch's CPU kernels
