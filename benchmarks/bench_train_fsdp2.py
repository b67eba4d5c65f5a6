"""`examples/train_fsdp2.py` under `torchrun --nproc-per-node 2`: activation offload and checkpoints against plain training.

    python benchmarks/bench_train_fsdp2.py                 # two accelerators, NCCL, full shapes
    python benchmarks/bench_train_fsdp2.py --device cpu --quick   # gloo, tiny model: checks the harness

Three configurations of the same shapes, each a fresh torchrun of the example:
- `off`: no activation offload, no checkpoints (the baseline of both comparisons)
- `auto`: `--activation-offload auto`
- `checkpoint`: `--checkpoint-every 1` (DCP async_save staged by offload.AsyncStager),
  the older checkpoints deleted as new ones complete
run in alternating order over the rounds (off, auto, checkpoint, then reversed), so
that drift on the machine lands on every configuration alike. Per configuration
the per-step tokens/s after the warm-up steps of every round are pooled and their
median compared with `off`'s; peak memory is rank 0's allocator peak (the largest
over the rounds). Targets: auto >= 0.97x off's tokens/s with lower peak memory;
checkpoint >= 0.95x. The checkpoint run also reports the median time a step was
blocked by the save (the previous save's write, the state dict, starting the
staging copy): when it is the gap, the storage's write rate bounds the run, not the
staging. Also a `python -m benchmarks` section, skipped with fewer than 2 accelerators.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTION = "train_fsdp2"
FULL_ONLY = True  # several minutes of torchrun launches: behind --full (or --only train_fsdp2)
REQUIRES = ("transformers",)
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_fsdp2.py"

# Activation memory matters here (tens of GiB per rank) while a step stays around a second.
# auto_steps: auto mode's runs take this many more steps, for its tuning (probes alternating with
# steps without offload) to settle before the steps that are timed; on the CPU (quick) its plan offloads
# nothing and settles at once, one step after its three measuring steps.
FULL = dict(hidden=2048, layers=16, heads=16, seq=4096, batch=2, vocab=32000, steps=14, warmup=4, rounds=2,
            auto_steps=90)
QUICK = dict(hidden=64, layers=2, heads=4, seq=32, batch=2, vocab=256, steps=5, warmup=2, rounds=1, auto_steps=2)
CONFIGS = ("off", "auto", "checkpoint")
TARGETS = {"auto": 0.97, "checkpoint": 0.95}  # tokens/s at least this share of off's

_STEP = re.compile(r"^step (\d+) loss \S+ tokens/s (\d+(?:\.\d+)?)", re.M)


def applies(device_type: str) -> bool:
    return device_type != "cpu"


def config_args(config: str, checkpoint_dir: str):
    if config == "off":
        return []
    if config == "auto":
        return ["--activation-offload", "auto"]
    if config == "checkpoint":
        return ["--checkpoint-every", "1", "--checkpoint-dir", checkpoint_dir, "--keep-checkpoints", "1"]
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


def parse_run(stdout: str, warmup: int) -> dict:
    """{'tokens_per_s': [per step after the warm-up and auto mode's tuning], 'summary': the final
    JSON line} of one run's output."""
    steps = [(int(m.group(1)), float(m.group(2))) for m in _STEP.finditer(stdout)]
    summaries = [line[len("summary "):] for line in stdout.splitlines() if line.startswith("summary {")]
    if not steps or not summaries:
        raise ValueError("train_fsdp2.py printed no step lines or no summary line; its output ends:\n" + stdout[-2000:])
    summary = json.loads(summaries[-1])
    skip = max(warmup, summary.get("tuning_steps") or 0)
    return {"tokens_per_s": [t for _, t in steps[skip:]] or [t for _, t in steps], "summary": summary}


def order(round_index: int, configs=CONFIGS):
    """The configurations of one round: forward on even rounds, reversed on odd ones."""
    return tuple(configs) if round_index % 2 == 0 else tuple(reversed(configs))


def launch(config: str, shapes: dict, device: str, extra, checkpoint_root: str, timeout_s: float) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    folder = tempfile.mkdtemp(prefix="ckpt-", dir=checkpoint_root)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--device", device, "--steps", str(shapes["steps"] + (shapes.get("auto_steps", 0) if config == "auto" else 0)),
           "--warmup-steps", str(shapes["warmup"]),
           "--batch", str(shapes["batch"]), "--seq", str(shapes["seq"]), "--hidden", str(shapes["hidden"]),
           "--layers", str(shapes["layers"]), "--heads", str(shapes["heads"]), "--vocab", str(shapes["vocab"]),
           *config_args(config, folder), *extra]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"train_fsdp2.py ({config}) exited {done.returncode}:\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-4000:]}")
    return done.stdout


def measure(shapes: dict, device: str = "auto", extra=(), checkpoint_root=None, progress=print,
            timeout_s: float = 600, log_dir=None, configs=CONFIGS) -> dict:
    """Each of `configs` over the rounds: {config: {'tokens_per_s', 'step_ms', 'peak_memory_bytes', ...}}.
    `log_dir`: where each run's output (rank 0's step lines, auto mode's plan) is kept, if given."""
    root = checkpoint_root or tempfile.mkdtemp(prefix="offload-bench-fsdp2-")
    os.makedirs(root, exist_ok=True)
    pooled = {c: [] for c in configs}
    summaries = {c: [] for c in configs}
    try:
        for r in range(shapes["rounds"]):
            for config in order(r, configs):
                t0 = time.perf_counter()
                stdout = launch(config, shapes, device, list(extra), root, timeout_s)
                if log_dir is not None:
                    os.makedirs(log_dir, exist_ok=True)
                    Path(log_dir, f"{config}-round{r + 1}.log").write_text(stdout)
                run = parse_run(stdout, shapes["warmup"])
                pooled[config] += run["tokens_per_s"]
                summaries[config].append(run["summary"])
                progress(f"round {r + 1}/{shapes['rounds']} {config}: {statistics.median(run['tokens_per_s']):.0f} "
                         f"tokens/s, peak {run['summary']['peak_memory_bytes'] / 2**30:.2f} GiB "
                         f"({time.perf_counter() - t0:.0f} s)")
    finally:
        if checkpoint_root is None:
            shutil.rmtree(root, ignore_errors=True)
    out = {}
    for config in configs:
        s = summaries[config]
        out[config] = {
            "tokens_per_s": statistics.median(pooled[config]),
            "tokens_per_s_min": min(pooled[config]), "tokens_per_s_max": max(pooled[config]),
            "steps_timed": len(pooled[config]),
            "peak_memory_bytes": max(x["peak_memory_bytes"] for x in s),
            "checkpoint_ms": statistics.median(x["checkpoint_ms"] for x in s),
            "offloaded_bytes": max((x.get("offloaded_bytes") or 0) for x in s),
            "exposed_wait_ms": statistics.median((x.get("exposed_wait_ms") or 0.0) for x in s),
            "layers_offloaded": max((x.get("layers_offloaded") or 0) for x in s),
            "plan_settled": all(x.get("plan_settled", True) for x in s),
        }
    return out


def verdicts(results: dict) -> dict:
    """Ratios against `off` and whether each target is met."""
    base = results["off"]
    out = {}
    for config in (c for c in ("auto", "checkpoint") if c in results):
        ratio = results[config]["tokens_per_s"] / base["tokens_per_s"]
        memory = (results[config]["peak_memory_bytes"] / base["peak_memory_bytes"]
                  if base["peak_memory_bytes"] else None)
        met = ratio >= TARGETS[config] and (config != "auto" or memory is None or memory < 1.0)
        met = met and results[config].get("plan_settled", True)  # tuning steps are not the steady state
        out[config] = {"tokens_ratio": ratio, "memory_ratio": memory, "target": TARGETS[config], "met": met}
    return out


def table(results: dict, verdict: dict) -> str:
    lines = [f"{'config':<11} {'tokens/s':>10} {'(min-max)':>19} {'peak GiB':>9} {'vs off':>8} {'mem vs off':>10} "
             f"{'ckpt ms':>8} {'target':>8}"]
    for config in (c for c in CONFIGS if c in results):
        r, v = results[config], verdict.get(config)
        lines.append(
            f"{config:<11} {r['tokens_per_s']:>10.0f} {r['tokens_per_s_min']:>9.0f}-{r['tokens_per_s_max']:<9.0f} "
            f"{r['peak_memory_bytes'] / 2**30:>9.2f} "
            + (f"{v['tokens_ratio']:>7.3f}x " if v else f"{'-':>8} ")
            + (f"{v['memory_ratio']:>9.3f}x " if v and v["memory_ratio"] is not None else f"{'-':>10} ")
            + f"{r['checkpoint_ms']:>8.1f} "
            + (f"{'met' if v['met'] else 'MISSED':>8} (>= {v['target']:.2f}x)" if v else f"{'baseline':>8}"))
    return "\n".join(lines)


def accelerators() -> int:
    import torch

    if not torch.accelerator.is_available():
        return 0
    return torch.accelerator.device_count()


def run(ctx):
    """The runner's section: full shapes on two accelerators (rank 0's figures), three rows."""
    from common import row

    if accelerators() < 2:
        ctx.skip("train_fsdp2 (all configurations)", "needs 2 accelerators (torchrun --nproc-per-node 2)")
        return []
    shapes = QUICK if ctx.quick else FULL
    results = measure(shapes, progress=ctx.progress)
    verdict = verdicts(results)
    ctx.progress("\n" + table(results, verdict))
    off, auto, ckpt = results["off"], results["auto"], results["checkpoint"]
    where = f"hidden {shapes['hidden']}, {shapes['layers']} layers, seq {shapes['seq']}, batch {shapes['batch']}/rank"
    return [
        row(SECTION, f"auto offload tokens/s ({where})", offload=auto["tokens_per_s"], baseline=off["tokens_per_s"],
            unit="tokens/s", baseline_name="no offload", headline="train_fsdp2 (2 ranks): auto offload tokens/s",
            target=f">= {TARGETS['auto']:.2f}x the tokens/s, lower peak memory", target_met=verdict["auto"]["met"]),
        row(SECTION, f"auto offload peak memory ({where})", offload=auto["peak_memory_bytes"] / 2**30,
            baseline=off["peak_memory_bytes"] / 2**30, unit="GiB", baseline_name="no offload",
            higher_is_better=False),
        row(SECTION, f"checkpoint every step tokens/s ({where})", offload=ckpt["tokens_per_s"],
            baseline=off["tokens_per_s"], unit="tokens/s", baseline_name="no checkpoint",
            checkpoint_blocked_ms=ckpt["checkpoint_ms"], target=f">= {TARGETS['checkpoint']:.2f}x the tokens/s",
            target_met=verdict["checkpoint"]["met"]),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="passed to train_fsdp2.py: auto, cpu (gloo) or an accelerator type")
    p.add_argument("--quick", action="store_true", help="a tiny model, one round (checks the harness)")
    p.add_argument("--rounds", type=int, help="rounds over the configurations (default: 2, quick: 1)")
    p.add_argument("--steps", type=int, help="steps per run, warm-up included")
    p.add_argument("--checkpoint-root", default=None,
                   help="folder for the checkpoint run's files (default: a temporary folder; choose fast storage)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per torchrun")
    p.add_argument("--logs", default=None, help="keep each run's output in this folder")
    p.add_argument("--configs", nargs="+", choices=CONFIGS[1:], default=list(CONFIGS[1:]),
                   help="configurations to run beside off (the baseline, always run)")
    p.add_argument("extra", nargs="*", help="further train_fsdp2.py flags, after --, e.g. -- --param-dtype bf16")
    args = p.parse_args(argv)
    shapes = dict(QUICK if args.quick else FULL)
    if args.rounds:
        shapes["rounds"] = args.rounds
    if args.steps:
        shapes["steps"] = args.steps
    if args.device != "cpu" and not args.quick and accelerators() < 2:
        print(f"{Path(__file__).name}: needs 2 accelerators (torchrun --nproc-per-node 2), torch sees "
              f"{accelerators()}; pass --device cpu --quick to check the harness on the CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = measure(shapes, args.device, args.extra, args.checkpoint_root, timeout_s=args.timeout,
                      log_dir=args.logs, configs=("off", *dict.fromkeys(args.configs)))
    verdict = verdicts(results)
    print(f"train_fsdp2.py, 2 ranks, {args.device}: {json.dumps({k: v for k, v in shapes.items()})} "
          f"{' '.join(args.extra)} ({time.perf_counter() - t0:.0f} s)")
    print(table(results, verdict))
    if args.out:
        Path(args.out).write_text(json.dumps({"shapes": shapes, "extra": args.extra, "results": results,
                                              "verdicts": verdict}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
