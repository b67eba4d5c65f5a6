"""Weight update at scale, on paper: a small model of one trainer-to-rollout weight update.

What it models: `WeightSender(senders=[...])` / `WeightReceiver` (docs/weight_sync.md, "Many
senders"; Note [many senders] in offload/weights/many_senders.py). N trainer ranks each send
about 1/N of the model's bytes (after the cast), each by broadcast on a group of its own with
every receiver; R rollout ranks each receive the whole model (a broadcast does not skip a
member: a tensor-parallel receiver drops what it does not keep after it has arrived).

    time = fill + max over links (bytes on the link / the link's rate) + buckets x latency

- fill: one bucket packed plus one bucket unpacked (the pipeline's first and last stages,
  which the transfer cannot hide); the bucket is min(bucket_bytes, B / N).
- links (B = model bytes after the cast, G = GPUs per host, all rates one direction):
  - each sender's B/N bytes leave once (a broadcast sends a byte once however many receivers
    there are), over NVLink when senders and receivers share one host, else over the
    sender's own NIC;
  - each rollout host takes the whole model B once, spread over its G NICs (NCCL's channels
    ride every NIC of a host): B / (G x NIC rate);
  - each rollout GPU takes the whole model B over NVLink (from the GPU of its host that took
    the byte off the wire, or from the sender on one host): B / NVLink rate.
  The links work side by side (buckets pipeline, two in flight per sender), so the slowest one
  bounds the transfer.
- buckets x latency: a fixed cost per bucket (the collective's launch, events, the host's
  bookkeeping), counted for every bucket a receiver takes, one after another: its one host
  thread walks the senders' buckets round-robin. A receiver holds two buckets per sender
  (2 x N x bucket_bytes), so with many senders its memory budget caps the bucket size and the
  count grows: bucket = min(bucket_bytes, receiver budget / (2 N)).

Rates. NVLink: the one `dist.broadcast` of all the bytes between two H200s (the weight-sync
section's ceiling, the same run as the measured points). Pack and unpack: the kernels alone
over one buffer, fp32 -> bf16 (the colocated section, one H200). NIC: stated, not measured
(400 Gb/s, one per GPU, as HGX H100/H200 hosts carry them), used at its wire rate, so the
inter-host terms are bounds. The per-bucket latency is fitted (least squares) to every measured
two-GPU sync of benchmarks/RESULTS.md ("Weight sync"): the two default rows and the same run's
bucket-size sweep (64 MiB to 1 GiB); `calibration()` and `sweep_check()` say how close the model
then is to each (within 10%). There is no held-out point: every measurement went into the fit. No
multi-host point is measured here: the rows beyond one host are the formula applied with these
rates, not measurements.

Run: `python benchmarks/model_weight_update.py [--json out.json]` (CPU, instant).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import List, Optional, Sequence, Tuple

GB = 1e9
MIB = 1 << 20
GIB = 1 << 30
BF16_BYTES = 2  # bytes per parameter after the cast to bf16

# The measured points, from benchmarks/RESULTS.md. "Weight sync", two H200s over NVLink
# (2026-11-23): offload's sync time and rate (bytes = time x rate) and the one-broadcast
# ceiling of the same run; fp32 weights sent as bf16, 256 MiB buckets (the default of that
# run: RESULTS.md at commit d1b232d).
# "Colocated weight update", one H200 (2026-11-27): the fp32 -> bf16 pack kernel and the
# unpack kernel alone over one buffer, same tensor lists (benchmarks/model_shapes.py).


@dataclass(frozen=True)
class MeasuredSync:
    name: str
    seconds: float  # offload's sync, end to end
    bytes_per_s: float  # offload's rate in the same row
    ceiling_bytes_per_s: float  # one dist.broadcast of all the bytes, same run
    pack_s: float  # pack kernel alone, one buffer (colocated section)
    unpack_s: float  # unpack kernel alone, one buffer (colocated section)
    bucket_bytes: int = 256 * MIB

    @property
    def model_bytes(self) -> float:
        return self.seconds * self.bytes_per_s


MEASURED = (
    MeasuredSync("Qwen2.5-1.5B fp32->bf16", 11.5e-3, 309.8 * GB, 368.9 * GB, 2.96e-3, 2.09e-3),
    MeasuredSync("Llama-3-8B fp32->bf16", 48.2e-3, 332.9 * GB, 371.1 * GB, 13.4e-3, 9.35e-3),
)


# The same run's bucket-size sweep (RESULTS.md at commit d1b232d; the current RESULTS.md
# keeps only the default rows): (name of a MEASURED point, bucket MiB, offload's rate).
SWEEP = (
    ("Qwen2.5-1.5B fp32->bf16", 64, 290.9 * GB), ("Qwen2.5-1.5B fp32->bf16", 128, 305.7 * GB),
    ("Qwen2.5-1.5B fp32->bf16", 512, 304.8 * GB), ("Qwen2.5-1.5B fp32->bf16", 1024, 283.3 * GB),
    ("Llama-3-8B fp32->bf16", 64, 309.6 * GB), ("Llama-3-8B fp32->bf16", 128, 296.4 * GB),
    ("Llama-3-8B fp32->bf16", 512, 320.6 * GB), ("Llama-3-8B fp32->bf16", 1024, 324.7 * GB),
)


@dataclass(frozen=True)
class Rates:
    """The link and kernel rates one update runs at (bytes/s unless named otherwise)."""

    nvlink_bytes_per_s: float
    nic_gbps: float  # one NIC per GPU, in Gb/s (stated)
    gpus_per_host: int
    pack_bytes_per_s: float  # bucket bytes (after the cast) packed per second
    unpack_bytes_per_s: float
    bucket_latency_s: float  # fixed cost per bucket a receiver takes

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbps * 1e9 / 8


@dataclass(frozen=True)
class Update:
    """One weight update: what moves, from how many senders to how many receivers."""

    model_bytes: float  # after the cast
    senders: int  # trainer ranks N, each sending about 1/N
    receivers: int  # rollout ranks R, each taking the whole model
    bucket_bytes: int  # the bucket size asked for
    receiver_budget_bytes: Optional[float] = None  # memory a receiver spares for 2 x N buckets

    def __post_init__(self):
        if self.model_bytes <= 0 or self.senders < 1 or self.receivers < 1 or self.bucket_bytes < 1:
            raise ValueError(f"model_weight_update: need model_bytes > 0, senders, receivers and bucket_bytes "
                             f">= 1, got {self.model_bytes}, {self.senders}, {self.receivers}, {self.bucket_bytes}")


@dataclass(frozen=True)
class Estimate:
    seconds: float
    fill_s: float
    transfer_s: float
    latency_s: float
    bound: str  # the link whose bytes bound the transfer
    bucket_bytes: int  # the bucket size used (after the receiver's budget)
    buckets: int  # buckets a receiver takes


def one_host(update: Update, rates: Rates) -> bool:
    """Senders and receivers fit on one host: everything moves over NVLink."""
    return update.senders + update.receivers <= rates.gpus_per_host


def bucket_used(update: Update) -> int:
    """The bucket size after a receiver's budget for two buckets per sender."""
    size = update.bucket_bytes
    if update.receiver_budget_bytes is not None:
        size = min(size, int(update.receiver_budget_bytes // (2 * update.senders)))
    if size < 1:
        raise ValueError(f"model_weight_update: a receiver budget of {update.receiver_budget_bytes} bytes "
                         f"leaves no room for 2 x {update.senders} buckets")
    return size


def estimate(update: Update, rates: Rates) -> Estimate:
    """The formula of the module docstring."""
    b, n = update.model_bytes, update.senders
    share = b / n
    bucket = bucket_used(update)
    first = min(bucket, share)
    fill = first / rates.pack_bytes_per_s + first / rates.unpack_bytes_per_s
    links = {"receiver NVLink": b / rates.nvlink_bytes_per_s}
    if one_host(update, rates):
        links["sender NVLink"] = share / rates.nvlink_bytes_per_s
    else:
        links["sender NIC"] = share / rates.nic_bytes_per_s
        links["receiver host NICs"] = b / (rates.gpus_per_host * rates.nic_bytes_per_s)
    bound = max(links, key=links.get)
    buckets = n * math.ceil(share / bucket)
    latency = buckets * rates.bucket_latency_s
    return Estimate(fill + links[bound] + latency, fill, links[bound], latency, bound, bucket, buckets)


def measured_rates(nic_gbps: float = 400.0, gpus_per_host: int = 8) -> Rates:
    """Rates from the measured points, the per-bucket latency fitted to every measured sync (the
    two default rows and the bucket-size sweep: 64 MiB to 1 GiB buckets, 4 to 240 of them)."""
    nvlink = sum(m.ceiling_bytes_per_s for m in MEASURED) / len(MEASURED)
    pack = sum(m.model_bytes / m.pack_s for m in MEASURED) / len(MEASURED)
    unpack = sum(m.model_bytes / m.unpack_s for m in MEASURED) / len(MEASURED)
    rates = Rates(nvlink, nic_gbps, gpus_per_host, pack, unpack, bucket_latency_s=0.0)
    # Least squares on t_i = base_i + n_i * L, with base_i the model without latency. Fitted to
    # the two default rows alone, L came out a fifth too high at 240 buckets of 64 MiB: most of
    # a bucket's fixed cost hides under the transfer of the one before it.
    fits = [(estimate(Update(b, 1, 1, bucket), rates), seconds) for b, bucket, seconds in _measured_points()]
    num = sum(e.buckets * (seconds - e.seconds) for e, seconds in fits)
    den = sum(e.buckets ** 2 for e, _ in fits)
    return replace(rates, bucket_latency_s=max(0.0, num / den))


def _measured_points() -> List[Tuple[float, int, float]]:
    """(model bytes, bucket bytes, measured seconds) of every measured sync."""
    points = [(m.model_bytes, m.bucket_bytes, m.seconds) for m in MEASURED]
    for name, mib, rate in SWEEP:
        m = next(p for p in MEASURED if p.name == name)
        points.append((m.model_bytes, mib * MIB, m.model_bytes / rate))
    return points


def _measured_update(m: MeasuredSync) -> Update:
    return Update(m.model_bytes, senders=1, receivers=1, bucket_bytes=m.bucket_bytes)


@dataclass(frozen=True)
class CalibrationRow:
    name: str
    model_bytes: float
    measured_s: float
    model_s: float
    ceiling_s: float  # the one-broadcast bound of the same run
    bucket_bytes: int = 256 * MIB

    @property
    def error(self) -> float:
        return self.model_s / self.measured_s - 1


def calibration(rates: Rates) -> List[CalibrationRow]:
    return [CalibrationRow(m.name, m.model_bytes, m.seconds, estimate(_measured_update(m), rates).seconds,
                           m.model_bytes / m.ceiling_bytes_per_s) for m in MEASURED]


def sweep_check(rates: Rates) -> List[CalibrationRow]:
    """The model against the bucket-size sweep of the same run (part of the fit)."""
    rows = []
    for name, mib, rate in SWEEP:
        m = next(p for p in MEASURED if p.name == name)
        e = estimate(Update(m.model_bytes, 1, 1, mib * MIB), rates)
        rows.append(CalibrationRow(name, m.model_bytes, m.model_bytes / rate, e.seconds,
                                   m.model_bytes / m.ceiling_bytes_per_s, mib * MIB))
    return rows


# Published figures (bf16: 2 bytes a parameter). verl names no model with its rate: its bytes
# are its time x its rate.
@dataclass(frozen=True)
class Anchor:
    name: str
    case: str
    model_bytes: float
    gpus: int
    seconds: float
    trainers: int  # the layout this model is run on beside the figure
    rollout: int

    @property
    def bytes_per_s(self) -> float:
        return self.model_bytes / self.seconds

    @property
    def bytes_per_s_per_gpu(self) -> float:
        return self.bytes_per_s / self.gpus


# checkpoint-engine and verl share GPUs between training and inference; beside them this model
# runs half and half on the same count (as the table does), Perplexity's on its own 256 -> 128.
ANCHORS = (
    Anchor("MoonshotAI checkpoint-engine", "Qwen3-235B, 8 x H800", 235e9 * BF16_BYTES, 8, 6.22, 4, 4),
    Anchor("MoonshotAI checkpoint-engine", "Kimi-K2 1T, 256 x H20", 1e12 * BF16_BYTES, 256, 16.04, 128, 128),
    Anchor("verl checkpoint engines", "NCCL, 4 x 8 H100, 8.25 GB/s", 7.0 * 8.25 * GB, 32, 7.0, 16, 16),
    Anchor("Perplexity RDMA point-to-point", "Kimi-K2 1T, 256 trainer -> 128 inference GPUs",
           1e12 * BF16_BYTES, 384, 1.3, 256, 128),
)

GPU_COUNTS = (8, 64, 256, 1024)
MODELS = (("8B", 8e9), ("70B", 70e9), ("235B", 235e9), ("1T", 1e12))
GPU_MEMORY_BYTES = 141 * GB  # one H200


@dataclass(frozen=True)
class TableRow:
    gpus: int
    model: str
    params: float
    model_bytes: float
    trainers: int
    rollout: int
    seconds: float
    bytes_per_s: float  # model bytes / seconds: the update's rate, what each rollout GPU takes
    bytes_per_s_per_gpu: float  # the same over every GPU of the job
    transfer_s: float
    bound: str
    latency_s: float
    bucket_bytes: int
    buckets: int
    fits: bool  # the bf16 weights fit in the rollout GPUs' memory


def table(rates: Rates, bucket_bytes: int, receiver_budget_bytes: float) -> List[TableRow]:
    rows = []
    for gpus in GPU_COUNTS:
        trainers = rollout = gpus // 2  # half and half, on hosts of their own beyond one host
        for name, params in MODELS:
            b = params * BF16_BYTES
            e = estimate(Update(b, trainers, rollout, bucket_bytes, receiver_budget_bytes), rates)
            rows.append(TableRow(gpus, name, params, b, trainers, rollout, e.seconds, b / e.seconds,
                                 b / e.seconds / gpus, e.transfer_s, e.bound, e.latency_s, e.bucket_bytes, e.buckets,
                                 b <= rollout * GPU_MEMORY_BYTES))
    return rows


def _size(n: float) -> str:
    return f"{n / GIB:g} GiB" if n >= GIB else f"{n / MIB:g} MiB"


def _where(transfer_s: float, bound: str, buckets: int, latency_s: float) -> str:
    return f"{bound} {transfer_s:.2f} s + {buckets:,} buckets {latency_s:.2f} s"


def render(rows: Sequence[TableRow], anchors: Sequence[Tuple[Anchor, Estimate]], cal: Sequence[CalibrationRow],
           sweep: Sequence[CalibrationRow], notes: Sequence[str]) -> str:
    out = ["Assumptions:"] + [f"- {a}" for a in notes]
    out += ["", "Calibration (two H200s over NVLink, one sender, one receiver; the default rows, then the "
            "same run's bucket sweep; the per-bucket latency is fitted to all of them):", "",
            "| case | bytes | bucket | measured | model | model is | one broadcast (same run) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in list(cal) + list(sweep):
        out.append(f"| {c.name} | {c.model_bytes / GB:.2f} GB | {_size(c.bucket_bytes)} | {c.measured_s * 1e3:.1f} ms "
                   f"| {c.model_s * 1e3:.1f} ms | {c.error:+.1%} | {c.ceiling_s * 1e3:.1f} ms |")
    out += ["", "| GPUs (trainers + rollout) | model | bf16 bytes | bucket | seconds | model bytes/s | "
            "bytes/s per GPU | where the time goes (+ fill) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        note = "" if r.fits else "; weights exceed the rollout GPUs' memory"
        out.append(f"| {r.gpus} ({r.trainers} + {r.rollout}) | {r.model} | {r.model_bytes / GB:,.0f} GB | "
                   f"{_size(r.bucket_bytes)} | {r.seconds:.2f} | {r.bytes_per_s / GB:.0f} GB/s | "
                   f"{r.bytes_per_s_per_gpu / GB:.2f} GB/s | "
                   f"{_where(r.transfer_s, r.bound, r.buckets, r.latency_s)}{note} |")
    out += ["", "Published figures (bytes at 2 a parameter; bytes/s = bytes / seconds; per GPU: over every GPU "
            "named) beside this model on the same bytes and GPU count:", "",
            "| who | case | bytes | seconds | bytes/s | bytes/s per GPU | this model (trainers + rollout) | "
            "model's s | model's bytes/s per GPU |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a, e in anchors:
        out.append(f"| {a.name} | {a.case} | {a.model_bytes / GB:,.0f} GB | {a.seconds:g} | "
                   f"{a.bytes_per_s / GB:,.0f} GB/s | {a.bytes_per_s_per_gpu / GB:.2f} GB/s | "
                   f"{a.trainers} + {a.rollout} | {e.seconds:.2f} | "
                   f"{a.model_bytes / e.seconds / (a.trainers + a.rollout) / GB:.2f} GB/s |")
    return "\n".join(out)


def beside_anchors(rates: Rates, bucket_bytes: int, receiver_budget_bytes: float) -> List[Tuple[Anchor, Estimate]]:
    return [(a, estimate(Update(a.model_bytes, a.trainers, a.rollout, bucket_bytes, receiver_budget_bytes), rates))
            for a in ANCHORS]


def assumptions(rates: Rates, bucket_bytes: int, receiver_budget_bytes: float) -> List[str]:
    g = rates.gpus_per_host
    return [
        f"bf16 weights (2 bytes a parameter); half the GPUs train, half roll out; hosts of {g} GPUs, "
        f"trainer and rollout hosts separate beyond one host (8 GPUs: 4 + 4 on one host, NVLink only)",
        f"NVLink {rates.nvlink_bytes_per_s / GB:.0f} GB/s (one dist.broadcast between two H200s, measured); "
        f"NIC {rates.nic_gbps:g} Gb/s per GPU (stated, at wire rate: {rates.nic_bytes_per_s / GB:.0f} GB/s)",
        f"pack {rates.pack_bytes_per_s / GB:,.0f} GB/s, unpack {rates.unpack_bytes_per_s / GB:,.0f} GB/s "
        f"(kernels alone, one H200, measured); per-bucket latency {rates.bucket_latency_s * 1e3:.3f} ms "
        f"(fitted to every measured sync: the two default rows and the bucket sweep)",
        f"bucket {_size(bucket_bytes)} (the default on an H200), capped by a receiver budget of "
        f"{_size(receiver_budget_bytes)} for its 2 x N buckets; every rollout GPU takes the whole model",
    ]


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nic-gbps", type=float, default=400.0, help="one NIC per GPU, Gb/s")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--bucket-mib", type=int, default=1024, help="bucket size asked for (default: H200's default)")
    p.add_argument("--receiver-budget-gib", type=float, default=8.0, help="memory a receiver spares for its buckets")
    p.add_argument("--json", help="write the table, calibration and assumptions here")
    args = p.parse_args(argv)
    rates = measured_rates(args.nic_gbps, args.gpus_per_host)
    bucket, budget = args.bucket_mib * MIB, args.receiver_budget_gib * GIB
    rows, cal, sweep = table(rates, bucket, budget), calibration(rates), sweep_check(rates)
    anchors, notes = beside_anchors(rates, bucket, budget), assumptions(rates, bucket, budget)
    print(render(rows, anchors, cal, sweep, notes))
    result = {"rates": asdict(rates), "assumptions": notes,
              "calibration": [dict(asdict(c), error=c.error) for c in cal],
              "sweep_check": [dict(asdict(c), error=c.error) for c in sweep],
              "rows": [asdict(r) for r in rows],
              "anchors": [dict(asdict(a), bytes_per_s=a.bytes_per_s, bytes_per_s_per_gpu=a.bytes_per_s_per_gpu,
                               model=asdict(e)) for a, e in anchors]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
