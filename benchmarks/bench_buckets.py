"""Bucket packing with a cast (fp32 sources -> bf16 buckets) against PyTorch's ways of doing it.

For the Qwen2.5-1.5B tensor list (339 tensors) and a Llama-3-8B-like list, every
method packs the same plan (same buckets, same offsets) into a reused bucket
buffer, bucket after bucket:
- offload: `pack_into` (one multi-tensor kernel per bucket and dtype pair)
- a Python loop of slice copies `bucket[a:b].view(bf16).copy_(src)`
- `torch._foreach_copy_` into views made beforehand (its best case)
- `torch.cat` of `.to(bf16)` casts (what many RL frameworks do)
and a single large device-to-device copy of the same bytes as the HBM ceiling.
Bandwidth counts bytes read plus bytes written. The target: offload at least
80% of the copy ceiling and faster than `_foreach_copy_`.
"""

from __future__ import annotations

import torch

from common import gbps, row, time_ms
from model_shapes import label, llama3_8b, materialize, qwen2_5_1_5b
from offload.core import _device
from offload.weights.bucket_pack import pack_into
from offload.weights.bucket_planner import default_bucket_bytes, plan_buckets

SECTION = "buckets"
REQUIRES = ("transformers",)  # the tensor lists come from transformers' model configs


def applies(device_type: str) -> bool:
    return device_type in ("cuda", "npu", "cpu")


def _case(ctx, label, shapes, dtype=torch.bfloat16, headline=False):
    device = ctx.device
    sources = materialize(shapes, torch.float32, device)
    bucket_bytes = (4 << 20) if ctx.quick else default_bucket_bytes(device)
    plan = plan_buckets(sources, bucket_bytes, dtype=dtype)
    per_bucket = [plan.bucket_entries(k) for k in range(plan.num_buckets)]
    buf = torch.empty(max(plan.bucket_sizes), dtype=torch.uint8, device=device)
    read = sum(t.numel() * t.element_size() for t in sources.values())
    written = sum(plan.bucket_sizes)
    moved = read + written
    srcs = [[sources[e.name] for e in entries] for entries in per_bucket]
    flat = [[sources[e.name].reshape(-1)[e.start : e.start + e.numel] for e in entries] for entries in per_bucket]
    views = [[buf[e.offset : e.offset + e.nbytes].view(e.torch_dtype) for e in entries] for entries in per_bucket]

    def offload_pack():
        for entries, s in zip(per_bucket, srcs):
            pack_into(buf, s, entries, "bench")

    def slice_loop():
        for entries, s in zip(per_bucket, srcs):
            for e, t in zip(entries, s):
                chunk = t.reshape(-1)[e.start : e.start + e.numel]
                buf[e.offset : e.offset + e.nbytes].view(e.torch_dtype).copy_(chunk)

    def foreach():
        for f, v in zip(flat, views):
            torch._foreach_copy_(v, f)

    def cat_casts():
        for f in flat:
            torch.cat([t.to(dtype) for t in f])

    big_src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    big_dst = torch.empty_like(big_src)

    def d2d():
        big_dst.copy_(big_src)

    iters = 3 if ctx.quick else 20
    results = {}
    for name, fn in [("offload", offload_pack), ("slices", slice_loop), ("foreach", foreach), ("cat", cat_casts),
                     ("d2d", d2d)]:
        ctx.progress(f"{label}: {name}")
        results[name] = time_ms(fn, device, warmup=2, iters=iters)
    peak = gbps(2 * big_src.numel(), results["d2d"]["median_ms"])
    ours = gbps(moved, results["offload"]["median_ms"])
    extra = dict(tensors=len(shapes), buckets=plan.num_buckets, bytes_moved=moved,
                 offload_ms=results["offload"]["median_ms"], peak_gbps=peak, pct_of_peak=100 * ours / peak)
    rows = [row(SECTION, f"{label} pack fp32->bf16 vs d2d copy peak", offload=ours, baseline=peak, unit="GB/s",
                baseline_name="one large D2D copy (ceiling)", **extra)]
    for name, what in [("foreach", "torch._foreach_copy_"), ("slices", "Python loop of slice copies"),
                       ("cat", "torch.cat of .to(bf16)")]:
        said = {"headline": f"Bucket packing fp32->bf16: {label}"} if headline and name == "cat" else {}
        rows.append(row(SECTION, f"{label} pack fp32->bf16", offload=results["offload"]["median_ms"],
                        baseline=results[name]["median_ms"], unit="ms", baseline_name=what, higher_is_better=False,
                        spread_pct=results["offload"]["spread_pct"], **said))
    del sources, buf, big_src, big_dst
    _device.empty_cache()
    return rows


def run(ctx):
    rows = _case(ctx, label("Qwen2.5-1.5B", ctx.quick), qwen2_5_1_5b(ctx.quick))
    rows += _case(ctx, label("Llama-3-8B", ctx.quick), llama3_8b(ctx.quick), headline=True)
    return rows
