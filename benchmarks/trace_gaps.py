"""Where a profiled step's compute stream waits, and on what: a diagnostic, not a bench section.

`python benchmarks/trace_gaps.py TRACE.json [--min-ms 2]` reads a `torch.profiler` Chrome trace
(as `examples/train_fsdp2.py --profile-steps N` writes) and reports:

- each device stream's busy time and what fills it (NCCL, copies by direction, kernels);
- how far ahead of the device the host launched the compute stream's work, by tenths of the
  step (a host that keeps ahead is not what the step waits for);
- the compute stream's idle time, and each gap longer than `--min-ms`: the op that ended it,
  the host ops that launched that op, and the ops on other streams that ended within
  `MATCH_US` of the gap's end (what the compute stream was, in effect, waiting for).

The compute stream is the busiest stream that runs kernels and no NCCL kernel. The last list is what
makes a stall readable: a gap that ends at the microsecond another stream's copy ends waited
for that copy, whoever queued the op that ended it (under FSDP2, its all-gather's small
host-to-device copy waits behind a layer's copy back queued before it).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
from typing import Dict, List, Sequence

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
MATCH_US = 50.0  # another stream's op ending this close to a gap's end is taken as what it waited for
TENTHS = 10


@dataclasses.dataclass
class Gap:
    """An idle span of the compute stream: its start (ms into the step) and length, the ops on
    either side, the host ops that launched the op that ended it (innermost first), and the
    ops on other streams that ended with it."""

    start_ms: float
    ms: float
    before: str
    after: str
    after_bytes: object
    launched_by: List[str]
    ended_with: List[str]


def load(path) -> list:
    """The complete ("X") events of a Chrome trace."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


def device_ops(events) -> Dict[object, list]:
    """Device ops (kernels, copies, memsets) by stream, each stream's in start order."""
    streams = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in DEVICE_CATEGORIES:
            streams[e.get("args", {}).get("stream")].append(e)
    for ops in streams.values():
        ops.sort(key=lambda e: e["ts"])
    return dict(streams)


def _is_nccl(op) -> bool:
    return "nccl" in op["name"].lower()


def _kind(op) -> str:
    if _is_nccl(op):
        return "nccl"
    if op.get("cat") == "gpu_memcpy":
        words = op["name"].split()
        return f"memcpy {words[1]}" if len(words) > 1 else "memcpy"
    return op["name"][:40]


def compute_stream(streams: Dict[object, list]):
    """The busiest stream that runs kernels and no NCCL kernel (None if there is none): a copy
    stream runs only copies, and may be busier than the compute stream."""
    candidates = [s for s, ops in streams.items()
                  if any(op.get("cat") == "kernel" for op in ops) and not any(_is_nccl(op) for op in ops)]
    if not candidates:
        return None
    return max(candidates, key=lambda s: sum(op["dur"] for op in streams[s]))


def _launches(events) -> dict:
    """The runtime calls that queued device ops, by the correlation id they share with their op."""
    return {e["args"]["correlation"]: e for e in events
            if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}


def host_lead(events, ops) -> List[float]:
    """Per op of `ops`: ms from its launch call's start to the op's start (how far ahead the
    host was); ops whose launch is not in the trace are left out."""
    launches = _launches(events)
    lead = []
    for op in ops:
        launch = launches.get(op.get("args", {}).get("correlation"))
        if launch is not None:
            lead.append((op["ts"] - launch["ts"]) / 1e3)
    return lead


def _launched_by(events, launch) -> List[str]:
    """Names of the host ops enclosing a launch call on its thread, innermost first."""
    if launch is None:
        return []
    around = [e for e in events if e.get("cat") in HOST_CATEGORIES and e.get("tid") == launch.get("tid")
              and e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
    return [e["name"] for e in sorted(around, key=lambda e: e["dur"])]


def gaps(events, streams: Dict[object, list], stream, min_ms: float) -> List[Gap]:
    """The gaps of `stream` longer than `min_ms`, with what ended each (see `Gap`)."""
    ops = streams[stream]
    t0 = min(op["ts"] for s in streams.values() for op in s)
    launches = _launches(events)
    others = [op for s, o in streams.items() if s != stream for op in o]
    found = []
    for a, b in zip(ops, ops[1:]):
        idle = b["ts"] - (a["ts"] + a["dur"])
        if idle <= min_ms * 1e3:
            continue
        ended_with = [f"{_kind(op)} on stream {op['args'].get('stream')}" for op in others
                      if abs(op["ts"] + op["dur"] - b["ts"]) <= MATCH_US]
        launch = launches.get(b.get("args", {}).get("correlation"))
        found.append(Gap(start_ms=(a["ts"] + a["dur"] - t0) / 1e3, ms=idle / 1e3, before=a["name"],
                         after=b["name"], after_bytes=b.get("args", {}).get("bytes"),
                         launched_by=_launched_by(events, launch), ended_with=ended_with))
    return found


def idle_ms(ops: Sequence[dict]) -> float:
    """Time between a stream's ops, from its first start to its last end."""
    return sum(max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(ops, ops[1:])) / 1e3


def summary(path, min_ms: float = 2.0) -> List[str]:
    """The report's lines for one trace."""
    events = load(path)
    streams = device_ops(events)
    if not streams:
        return [f"{path}: no device ops in the trace"]
    t0 = min(op["ts"] for ops in streams.values() for op in ops)
    t1 = max(op["ts"] + op["dur"] for ops in streams.values() for op in ops)
    lines = [f"{path}: device span {(t1 - t0) / 1e3:.1f} ms"]
    for s, ops in sorted(streams.items(), key=lambda item: -sum(op["dur"] for op in item[1])):
        kinds = collections.Counter()
        for op in ops:
            kinds[_kind(op)] += op["dur"]
        top = ", ".join(f"{name} {us / 1e3:.1f}" for name, us in kinds.most_common(4))
        lines.append(f"  stream {s}: {len(ops)} ops, busy {sum(op['dur'] for op in ops) / 1e3:.1f} ms ({top})")
    stream = compute_stream(streams)
    if stream is None:
        return lines + ["  no stream runs kernels without NCCL: no compute stream to read"]
    ops = streams[stream]
    lead = host_lead(events, ops)
    if lead:
        tenths = [lead[k * len(lead) // TENTHS:(k + 1) * len(lead) // TENTHS] for k in range(TENTHS)]
        medians = [sorted(part)[len(part) // 2] for part in tenths if part]
        lines.append("  host ahead of the compute stream by tenth of the step (median ms): "
                     + " ".join(f"{m:.1f}" for m in medians))
    found = gaps(events, streams, stream, min_ms)
    lines.append(f"  compute stream {stream}: idle {idle_ms(ops):.1f} ms; {len(found)} gaps over {min_ms:g} ms")
    for gap in found:
        lines.append(f"    at {gap.start_ms:.1f} ms, {gap.ms:.1f} ms: ended by {gap.after[:50]}"
                     + (f" ({gap.after_bytes} bytes)" if gap.after_bytes is not None else "")
                     + (f", launched in {' < '.join(name[:40] for name in gap.launched_by[:4])}"
                        if gap.launched_by else "")
                     + (f"; ended with {', '.join(gap.ended_with)}" if gap.ended_with else ""))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="torch.profiler Chrome traces (JSON)")
    p.add_argument("--min-ms", type=float, default=2.0, help="report the compute stream's gaps longer than this")
    args = p.parse_args(argv)
    if args.min_ms < 0:
        p.error(f"--min-ms must be >= 0, got {args.min_ms}")
    for path in args.traces:
        print("\n".join(summary(path, args.min_ms)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
