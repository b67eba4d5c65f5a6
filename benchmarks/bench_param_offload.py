"""Parameter offload and reload of a 4 GiB model (16 GiB with --full) against PyTorch's ways of
parking it on the host.

- offload: `offload.offload_params(model)` / `offload.reload_params(model)` (a pinned
  mirror allocated once, storages freed, chunked copies on the dedicated streams)
- `model.to("cpu")` / `model.to("cuda")` (pageable memory, a new allocation each time;
  one round, three with --full: a round of 16 GiB takes about 15 s)
- a per-parameter loop `host[i].copy_(p, non_blocking=True)` into pinned buffers
  allocated once, then `p.data = torch.empty(0)`; back with `p.data = host[i].to(device,
  non_blocking=True)` (what hand-written offload code in RL frameworks does)
Host wall time of each direction until the copies completed; GB/s against the bus
peak that the copy section measured in the same run, when it ran first. The target:
each direction at least 90% of the bus peak. Quick mode (CPU): 8 MiB.
"""

from __future__ import annotations

import time

import torch

import offload
from common import gbps, host_memory, row, summarize
from offload.core import _device

SECTION = "param_offload"


def applies(device_type: str) -> bool:
    return device_type in ("cuda", "npu", "cpu")


def _model(total_bytes: int, device) -> torch.nn.Module:
    # 64 square fp32 layers: 256 MiB each at 16 GiB, the size of a 7B layer's MLP weights (64 MiB at 4 GiB).
    layers = 64
    side = max(8, int((total_bytes / layers / 4) ** 0.5))
    with torch.device(device):  # initialized where it lives: 16 GiB initialized on the host takes half a minute
        return torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])


def _wall(fn, device) -> float:
    _device.synchronize(device)
    t0 = time.perf_counter()
    fn()
    _device.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def run(ctx):
    device = ctx.device
    # 4 GiB by default: the rates are the same as at 16 GiB (64 copies of 64 MiB against 256 MiB, both
    # far above the size where a copy reaches the bus rate), and pinning 16 GiB for the baseline's
    # buffers and its pageable round trips take most of half a minute.
    total = (8 << 20) if ctx.quick else (16 << 30) if ctx.full else (4 << 30)
    iters = 2 if ctx.quick else 3
    model = _model(total, device)
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    times = {k: [] for k in ("off", "on", "to_cpu", "to_dev", "loop_off", "loop_on")}

    ctx.progress(f"offload_params / reload_params of {nbytes / 2**30:.2f} GiB")
    for i in range(iters + 1):
        off = _wall(lambda: offload.offload_params(model), device)
        on = _wall(lambda: offload.reload_params(model), device)
        if i:  # the first round allocates the mirror
            times["off"].append(off)
            times["on"].append(on)

    ctx.progress("per-parameter non_blocking loop into pinned buffers")
    host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=_device.pinned_memory_supported()) for p in params]

    def loop_off():
        for h, p in zip(host, params):
            h.copy_(p.data, non_blocking=True)
        _device.synchronize(device)
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=device)

    def loop_on():
        for h, p in zip(host, params):
            p.data = h.to(device, non_blocking=True)

    for i in range(iters + 1):
        off, on = _wall(loop_off, device), _wall(loop_on, device)
        if i:
            times["loop_off"].append(off)
            times["loop_on"].append(on)
    del host

    ctx.progress("module.to('cpu') / module.to(device)")
    # About 15 s a round at 16 GiB (pageable memory): one round unless --full; it is tens of times slower.
    for i in range(iters + 1 if ctx.quick else iters if ctx.full else 1):
        off = _wall(lambda: model.to("cpu"), device)
        on = _wall(lambda: model.to(device), device)
        times["to_cpu"].append(off)
        times["to_dev"].append(on)

    med = {k: summarize(v)["median_ms"] for k, v in times.items()}
    size = f"{nbytes / 2**30:.1f} GiB" if nbytes >= 1 << 30 else f"{nbytes / 2**20:.0f} MiB"
    extra = dict(bytes=nbytes)
    rows = []
    for direction, ours, to_key, loop_key in [("offload (D2H)", "off", "to_cpu", "loop_off"),
                                              ("reload (H2D)", "on", "to_dev", "loop_on")]:
        ours_gbps = gbps(nbytes, med[ours])
        # The copy section (bench_copy.py), when it ran first, left the measured bus peaks here.
        peak = ctx.notes.get("bus_peak_d2h_gbps" if ours == "off" else "bus_peak_h2d_gbps")
        pct = 100 * ours_gbps / peak if peak else None
        said = {"headline": f"Parameter offload: {size} to host"} if ours == "off" else {}
        rows.append(row(SECTION, f"{direction} {size}", offload=ours_gbps,
                        baseline=gbps(nbytes, med[to_key]), unit="GB/s", baseline_name="module.to(...)",
                        pct_of_bus_peak=pct, bus_peak_gbps=peak, **extra, **said))
        rows.append(row(SECTION, f"{direction} {size}", offload=ours_gbps,
                        baseline=gbps(nbytes, med[loop_key]), unit="GB/s",
                        baseline_name=f"per-param non_blocking loop, {host_memory()}", **extra))
    del model
    _device.empty_cache()
    return rows
