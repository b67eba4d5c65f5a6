"""A stager's metrics records: the copy time's handles let go and bounded, a failed copy's
timing dropped, and the staging benchmark's rows naming the saves they measured."""

import pytest
import torch

import offload
from _staging_helpers import assert_same, snapshot
from offload.core import _device

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_staging_spent_handles_let_go_by_result_and_bounded(backend, device):
    """A read copy time's handles are let go by a later result(), not inside stage(), and a
    caller that never asks for results holds at most a few saves' worth of them."""
    from offload.staging import metrics

    if not _device.is_accelerator(device):
        pytest.skip("copies are timed on an accelerator only (the host copies are synchronous)")
    stager = offload.AsyncStager(ring_size=1)
    tensors = {f"t{i}": torch.randn(64, device=device) for i in range(100)}
    seen = 0
    for save in range(10):
        if save:
            del future  # its staged dict would keep the ring's one set busy: the next stage() would wait
        future = stager.stage(tensors)
        future.exception()  # waits for the copy without result()
        # A private read: the handles kept until a later future frees them are no user's concern to see.
        assert len(stager._log.spent) <= metrics.SPENT_KEPT
        seen = max(seen, len(stager._log.spent))
    if backend == "native":
        # Copy times were read and their handles kept. Asserted for the native core only: the
        # fallback's copies may complete before their record is read, and the bound may have
        # cleared them by the 10th save.
        assert seen > 0
    staged = future.result()
    assert stager._log.spent == []
    assert_same(staged, snapshot(tensors))
    del staged
    stager.close()


def test_staging_timing_of_a_failed_copy_is_dropped():
    """A copy that failed on the core's worker raises from its handle's copy_seconds(); the
    save's future reports that error, and its metrics record drops the timing instead of
    raising it again from every later stage(), metrics() and close()."""
    from offload.staging import metrics

    class Failed:
        def copy_seconds(self):
            raise RuntimeError("offload: the copy worker failed")

    record = {"_timing": {"cuda:0": [Failed()]}, "copy_ms": None, "gbps": None, "bytes": 1 << 20}
    metrics.resolve_timing(record)
    assert record["_timing"] is None and record["copy_ms"] is None and record["gbps"] is None


def test_staging_benchmark_rows_say_which_saves_were_measured(device, monkeypatch):
    """benchmarks/bench_staging.py measures slow baselines over fewer saves: each row's
    label names the saves its medians cover, for offload and for the baseline."""
    import pathlib
    import sys

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import bench_staging
        from common import Context

        monkeypatch.setattr(bench_staging, "_size_cases", lambda quick: [("8 tensors x 2 KiB", 8, 1 << 10)])
        rows = bench_staging._staging_rows(Context(device, quick=True, progress=lambda message: None))
    finally:  # the benchmarks' modules stay out of other tests' imports
        sys.modules.pop("bench_staging", None)
        sys.modules.pop("common", None)
    later = [r for r in rows if "first save" not in r["case"]]
    assert later and any(r.get("baseline_saves") == bench_staging.SLOW_SAVES for r in later)
    for r in later:
        assert f"saves 2-{bench_staging.SAVES}" in r["case"], r
        theirs = r.get("baseline_saves")
        if theirs is not None and theirs != bench_staging.SAVES:
            assert f"baseline: saves 2-{theirs}" in r["case"], r
        else:
            assert "baseline: saves" not in r["case"], r
