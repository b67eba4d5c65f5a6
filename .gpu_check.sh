#!/usr/bin/env bash
# GPU check for fix/defer (deferred enqueue of a reused device-to-host copy):
# builds, runs the CUDA copy tests, then times copy_to_host(out=<handle>) with and
# without defer=True for 4,000 bf16 tensors of 128 Ki elements (256 KiB each).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 python -m pip install --no-build-isolation --no-deps -e . -q
python -m pytest tests/test_copy.py -m cuda -q
python - <<'PY'
import statistics, time
import torch
import offload
from offload import _device

device = torch.device("cuda")
ts = [torch.randn(128 * 1024, device=device).to(torch.bfloat16) for _ in range(4000)]
nbytes = sum(t.numel() * t.element_size() for t in ts)
h = offload.copy_to_host(ts, group_bytes=32 << 20)
h.wait()

def run(defer):
    blocked, rates, ok = [], [], True
    for k in range(15):
        for t in ts[:: 97]:
            t.add_(1)  # change a few tensors, queued before the call
        _device.synchronize(device)
        t0 = time.perf_counter()
        handle = offload.copy_to_host(ts, out=h, defer=defer, timing=True)
        blocked.append(time.perf_counter() - t0)
        handle.wait()
        seconds = handle.copy_seconds()
        rates.append(nbytes / seconds / 1e9 if seconds else float("nan"))
        if k in (0, 14):
            ok = ok and all(torch.equal(s.cpu().view(torch.int16), d.view(torch.int16)) for s, d in zip(ts, handle.tensors))
    return blocked, rates, ok

for defer in (False, True, False, True):  # twice each, interleaved, so drift shows
    blocked, rates, ok = run(defer)
    print(f"defer={defer!s:5} caller blocked median {statistics.median(blocked)*1e3:.3f} ms "
          f"(min {min(blocked)*1e3:.3f}, max {max(blocked)*1e3:.3f}); copy {statistics.median(rates):.1f} GB/s "
          f"median (min {min(rates):.1f}); bitwise {'OK' if ok else 'MISMATCH'}")
PY
