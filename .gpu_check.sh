#!/usr/bin/env bash
# GPU check for fix/stage-host (issue 5): AsyncStager.stage() host time on the steady-state path.
# Run from the repository root on the H100. Prints:
#   1. the build result and `pytest tests/test_staging.py` (all must pass; the CUDA tests included)
#   2. "ptr helper: True" (torch._C._tensors_data_ptrs_at_indices_equal present, the one-call pointer check)
#   3. blocked_ms of saves 3..12 (from stager.metrics()) for 4000 bf16 tensors x 256 KiB, median and list
#   4. per save, averaged over saves 3..12: the time in each stager method and helper (nested: _enqueue
#      includes copy_to_host, which includes core.copy_to_host); "python" = mean blocked minus core.copy_to_host
set -uo pipefail
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 python -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -2
python -m pytest tests/test_staging.py -q -p no:cacheprovider 2>&1 | tail -4
python - <<'PY'
import functools, statistics, time
import torch
import offload
from offload import staging

print("torch", torch.__version__, "ptr helper:", staging._ptrs_at_equal is not None)
times = {}


def timed(owner, name, label=None):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(label or name, []).append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)


for name in ("_stage", "_resolve", "_acquire_set", "_enqueue"):
    timed(staging.AsyncStager, name)
timed(staging, "copy_to_host", "copy_to_host (wrapper+core)")
from offload import _backend, _device
if _backend.core() is not None and hasattr(_backend.core(), "copy_to_host"):
    timed(_backend.core(), "copy_to_host", "  of it: core.copy_to_host")
for name in ("new_event", "current_stream", "copy_streams", "is_accelerator"):
    timed(_device, name, "_device." + name)
timed(staging.StagingFuture, "__init__", "StagingFuture()")
timed(staging.StateTree, "build", "tree.build (in result())")

torch.manual_seed(0)
state = {"model": {f"layer{i}.weight": torch.randn(128 << 10, device="cuda").to(torch.bfloat16) for i in range(4000)}}
tensors = list(state["model"].values())
stager = offload.AsyncStager()
SAVES = 12
for save in range(SAVES):
    torch._foreach_add_(tensors, 1)
    torch.cuda.synchronize()
    if save == 2:
        times.clear()
    out = stager.stage(state).result()
    if save == SAVES - 1:
        ok = all(torch.equal(out["model"][f"layer{i}.weight"], tensors[i].cpu()) for i in (0, 1777, 3999))
        print("last save bit-exact (3 sampled tensors):", ok)
    del out
blocked = [m["blocked_ms"] for m in stager.metrics()[2:]]
print("blocked_ms saves 3..12: median %.3f  [%s]" % (statistics.median(blocked), ", ".join("%.2f" % b for b in blocked)))
print("copy GB/s saves 3..12:", ["%.1f" % m["gbps"] for m in stager.metrics()[2:] if m["gbps"]])
n = SAVES - 2
for label, values in times.items():
    print("  %-28s %.3f ms/save" % (label, sum(values) / n * 1e3))
native = sum(times.get("  of it: core.copy_to_host", [])) / n * 1e3
print("  python (blocked - core)      %.3f ms/save" % (statistics.mean(blocked) - native))
stager.close()
PY
