"""Stress: activation offload's bitwise checks on the CPU, repeated with a fresh seed each time.

    python benchmarks/stress_activation.py [--repeats N] [--load K] [--out FILE]

Each repetition builds one scenario with a new seed: the 6-block model of the activation tests
(tests/_activation_helpers.py: blocks that save transposed, sliced, expanded and overlapping views,
a `.t()` of an activation used in a matmul, int and bool tensors), a `torch.no_grad()` pass, two
forwards and backwards whose gradients accumulate, then two forwards summed under one backward. The
offloaded model's no-grad output, losses and every parameter's gradient after each phase are
compared bit for bit (`torch.equal`) with the same scenario on the model without offload, and that
reference is run twice, so a reference that does not reproduce itself is told apart from offload
(every other repetition runs the offloaded model first, the references after it).

Variants (every combination; `--repeats` repetitions of each):
  mode        async, sync, auto, auto-budget (auto with memory_budget_bytes=0: its plan offloads
              or recomputes every layer it may) (`--modes`)
  offload     on, or the handle paused (`handle.paused()`; min_tensor_bytes=1 only, the case
              where pausing changes what runs)
  threshold   default (min_tensor_bytes 1 MiB: nothing is offloaded), mixed (1 KiB: the 8x64
              activations go, the 8x16 ones stay), all (1 byte: every eligible tensor goes)
  threads     torch.set_num_threads 1 and 2 (`--threads`), the same for reference and run
  backend     the compiled core, and the pure-PyTorch path (`--backends`; the path
              OFFLOAD_FORCE_FALLBACK=1 selects, switched in-process)
An offloaded model and its handle live for `--reuse` (5) repetitions (the first builds them, the next
copy the new seed's parameters in, as a training run's later steps), so auto mode goes on from
measuring to its plan. `--load K` runs K busy processes beside it (half spin in Python, half run
matmuls with torch's default threads). A control section, not counted as a failure, runs the
reference at one thread count and the same model without offload at another: the difference a
thread count changed between a reference and a later run makes.

Writes FILE (JSON: per variant repetitions, mismatches with the parameters that differ and their
largest difference, whether the reference reproduced itself, tensors offloaded) and prints one row
per variant. Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import itertools
import json
import os
import subprocess
import sys
import time
import warnings
from typing import List

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import offload  # noqa: E402
from offload.activation.engine import DEFAULT_MIN_TENSOR_BYTES  # noqa: E402
from offload.core import _backend  # noqa: E402
from _activation_helpers import small_model  # noqa: E402  (the tests' model, not a twin of it)

BLOCKS = 6
WIDTH = 16
ROWS = 8
THRESHOLDS = {"default": DEFAULT_MIN_TENSOR_BYTES, "mixed": 1024, "all": 1}
MODES = ("async", "sync", "auto", "auto-budget")
# Auto mode with a budget no plan meets: its plan offloads (or recomputes) every layer it may,
# where on the CPU a plan without a budget settles on offloading nothing (no bus to hide copies).
BUDGETS = {"auto-budget": ("auto", 0)}

_LOAD_SPIN = "while True: pass"
_LOAD_TORCH = "import torch\na = torch.randn(256, 256)\nwhile True: a = torch.tanh(a @ a * 1e-2)"


@dataclasses.dataclass(frozen=True)
class Variant:
    mode: str
    paused: bool
    threshold: str
    threads: int
    backend: str

    @property
    def name(self) -> str:
        return (f"{self.mode}/{'paused' if self.paused else 'on'}/{self.threshold}/"
                f"t{self.threads}/{self.backend}")


@dataclasses.dataclass
class Result:
    """What one run of the scenario gives: compared bit for bit."""
    inference: torch.Tensor  # the no-grad pass's output
    losses: List[torch.Tensor]  # two accumulated steps, then the two forwards under one backward
    accumulated: List[torch.Tensor]  # gradients after the two accumulated steps
    grads: List[torch.Tensor]  # gradients after the two forwards under one backward


def inputs(seed: int, rows: int = ROWS) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, WIDTH, generator=gen) for _ in range(5)]


def scenario(model, xs, after_backward=lambda: None) -> Result:
    """The reported sequence: a no-grad pass, two forwards and backwards accumulating into
    `.grad`, then two forwards summed under one backward."""
    with torch.no_grad():
        inference = model(xs[0])
    model.zero_grad(set_to_none=True)
    losses = []
    for x in xs[1:3]:
        loss = model(x)
        loss.backward()
        after_backward()
        losses.append(loss.detach())
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss = model(xs[3]) + model(xs[4])
    loss.backward()
    after_backward()
    losses.append(loss.detach())
    return Result(inference, losses, accumulated, [p.grad.clone() for p in model.parameters()])


def differences(got: Result, want: Result, names) -> dict:
    """What differs between two results: {} when they are bitwise equal."""
    out = {}
    if not torch.equal(got.inference, want.inference):
        out["inference"] = _max_diff(got.inference, want.inference)
    losses = [i for i, (a, b) in enumerate(zip(got.losses, want.losses)) if not torch.equal(a, b)]
    if losses:
        out["losses"] = losses
    for key in ("accumulated", "grads"):
        diff = {n: _max_diff(a, b) for n, a, b in zip(names, getattr(got, key), getattr(want, key))
                if not (a.shape == b.shape and torch.equal(a, b))}
        if diff:
            out[key] = diff
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a.double() - b.double()).abs().max().item()


class Runner:
    """The offloaded model of one variant, rebuilt every `reuse` repetitions, and its counts."""

    def __init__(self, variant: Variant, reuse: int):
        self.variant, self.reuse = variant, reuse
        self.model = self.handle = self.pool = None
        self.built_at = None
        self.step = None
        self.offloaded = 0  # tensors offloaded, summed over the steps run

    def offloaded_model(self, rep: int, ref):
        if self.handle is None or rep - self.built_at >= self.reuse:
            if self.handle is not None:
                self.handle.disable()
            self.model = copy.deepcopy(ref)
            self.pool = offload.HostPool()
            v = self.variant
            mode, budget = BUDGETS.get(v.mode, (v.mode, None))
            self.handle = offload.enable_activation_offload(self.model, mode, pool=self.pool, verbose=False,
                                                            min_tensor_bytes=THRESHOLDS[v.threshold],
                                                            memory_budget_bytes=budget)
            self.built_at, self.step = rep, None
        else:
            with torch.no_grad():
                for p, q in zip(self.model.parameters(), ref.parameters()):
                    p.copy_(q)
        return self.model

    def count(self) -> None:
        """After a backward: add the tensors its step offloaded (a paused step is no step)."""
        stats = self.handle.stats()
        if stats["step"] != self.step:
            self.step = stats["step"]
            self.offloaded += stats["tensors_offloaded"]

    def run(self, xs) -> Result:
        pause = self.handle.paused() if self.variant.paused else contextlib.nullcontext()
        with pause:
            return scenario(self.model, xs, self.count)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.disable()


def run_variant(variant: Variant, repeats: int, first_seed: int, reuse: int) -> dict:
    """`repeats` repetitions of `variant`, seeds from `first_seed`: its row. Leaves torch's thread
    count at the variant's (the caller restores it)."""
    names = [n for n, _ in small_model(n=BLOCKS, d=WIDTH).named_parameters()]
    torch.set_num_threads(variant.threads)
    backend = _backend.force_fallback() if variant.backend == "fallback" else contextlib.nullcontext()
    mismatches, unreproducible, thread_changes = [], [], 0
    start = time.perf_counter()
    with backend:
        runner = Runner(variant, reuse)
        try:
            for rep in range(repeats):
                seed = first_seed + rep
                ref = small_model(seed=seed, n=BLOCKS, d=WIDTH)
                twin = copy.deepcopy(ref)
                model = runner.offloaded_model(rep, ref)
                xs = inputs(seed)
                if rep % 2:  # the offloaded run first, then the references: neither order is special
                    got = runner.run(xs)
                    want, again = scenario(ref, xs), scenario(twin, xs)
                else:
                    want, again = scenario(ref, xs), scenario(twin, xs)
                    got = runner.run(xs)
                thread_changes += torch.get_num_threads() != variant.threads
                ref_diff = differences(again, want, names)
                if ref_diff:
                    unreproducible.append({"seed": seed, "differs": ref_diff})
                diff = differences(got, want, names)
                if diff:
                    mismatches.append({"seed": seed, "rep": rep, "handle_age": rep - runner.built_at,
                                       "reference_reproduced": not ref_diff, "differs": diff,
                                       "threads_now": torch.get_num_threads()})
                del model
        finally:
            runner.close()
    return {"variant": variant.name, **dataclasses.asdict(variant), "repetitions": repeats,
            "seconds": round(time.perf_counter() - start, 2), "mismatches": mismatches,
            "reference_unreproducible": unreproducible, "thread_count_changed": thread_changes,
            "tensors_offloaded": runner.offloaded}


def control_thread_switch(seeds, rows_list) -> list:
    """The reference at one thread count, the same model without offload at another: what a
    thread count changed between a reference and a later run does to 'bitwise' checks."""
    names = [n for n, _ in small_model(n=BLOCKS, d=WIDTH).named_parameters()]
    rows_out = []
    for rows, seed in itertools.product(rows_list, seeds):
        xs = inputs(seed, rows)
        torch.set_num_threads(1)
        want = scenario(small_model(seed=seed, n=BLOCKS, d=WIDTH), xs)
        torch.set_num_threads(2)
        got = scenario(small_model(seed=seed, n=BLOCKS, d=WIDTH), xs)
        diff = differences(got, want, names)
        params = sorted(set(diff.get("accumulated", {})) | set(diff.get("grads", {})))
        rows_out.append({"rows": rows, "seed": seed, "loss_equal": "losses" not in diff,
                         "inference_equal": "inference" not in diff, "params_differing": len(params),
                         "params": len(names), "which": params,
                         "max_abs_diff": max([*diff.get("accumulated", {}).values(),
                                              *diff.get("grads", {}).values()], default=0.0),
                         "max_grad": max(g.abs().max().item() for g in want.accumulated + want.grads)})
    return rows_out


def variants(modes, threads, backends) -> List[Variant]:
    out = []
    for backend, mode, t in itertools.product(backends, modes, threads):
        for threshold in THRESHOLDS:
            out.append(Variant(mode, False, threshold, t, backend))
        out.append(Variant(mode, True, "all", t, backend))
    return out


def start_load(k: int) -> list:
    """K busy processes: even ones spin in Python, odd ones run matmuls on torch's default threads."""
    return [subprocess.Popen([sys.executable, "-c", _LOAD_TORCH if i % 2 else _LOAD_SPIN],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(k)]


def stop_load(procs) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(timeout=30)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="repetitions of each variant")
    parser.add_argument("--load", type=int, default=0, help="busy processes to run beside it")
    parser.add_argument("--out", default="", help="JSON file to write")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", default="1,2", help="torch.set_num_threads values")
    parser.add_argument("--backends", default="native,fallback")
    parser.add_argument("--reuse", type=int, default=5, help="repetitions an offloaded model and handle live for")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--no-control", action="store_true", help="skip the thread-switch control")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.reuse < 1 or args.load < 0:
        parser.error(f"--repeats and --reuse must be >= 1 and --load >= 0, got {args.repeats}, {args.reuse}, "
                     f"{args.load}")
    warnings.filterwarnings("ignore", category=UserWarning)
    modes = [m for m in args.modes.split(",") if m]
    threads = [int(t) for t in args.threads.split(",") if t]
    backends = [b for b in args.backends.split(",") if b]
    skipped = []
    if "native" in backends and not _backend.native_available():
        backends.remove("native")
        skipped.append(f"native: {_backend.why_not()}")
    threads_before = torch.get_num_threads()
    load = start_load(args.load)
    rows, seed = [], args.seed
    start = time.perf_counter()
    try:
        for variant in variants(modes, threads, backends):
            rows.append(run_variant(variant, args.repeats, seed, args.reuse))
            seed += args.repeats  # a fresh seed for every repetition of the run
        control = [] if args.no_control else control_thread_switch(seeds=(0, 1), rows_list=(ROWS, 512))
    finally:
        stop_load(load)
        torch.set_num_threads(threads_before)
    seconds = time.perf_counter() - start
    failed = [r for r in rows if r["mismatches"] or r["reference_unreproducible"] or r["thread_count_changed"]]
    summary = {
        "torch": torch.__version__, "native": _backend.native_available(), "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
        "load_processes": args.load, "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(),
        "repetitions": sum(r["repetitions"] for r in rows), "seconds": round(seconds, 1),
        "mismatching_variants": len(failed), "skipped": skipped, "variants": rows, "control_thread_switch": control,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    print(f"{'variant':<36} {'reps':>5} {'mismatch':>8} {'ref!=ref':>8} {'offloaded/rep':>13} {'s':>6}")
    for r in rows:
        print(f"{r['variant']:<36} {r['repetitions']:>5} {len(r['mismatches']):>8} "
              f"{len(r['reference_unreproducible']):>8} {r['tensors_offloaded'] / r['repetitions']:>13.1f} "
              f"{r['seconds']:>6}")
    for line in skipped:
        print(f"skipped {line}")
    if control:
        print("control (not a failure): reference at 1 thread, the same model without offload at 2")
        for c in control:
            print(f"  rows {c['rows']:>4} seed {c['seed']}: loss equal {c['loss_equal']}, "
                  f"{c['params_differing']}/{c['params']} gradients differ by up to {c['max_abs_diff']:.3g} "
                  f"(largest gradient {c['max_grad']:.3g})")
    print(f"{summary['repetitions']} repetitions in {seconds:.0f} s with {args.load} load processes: "
          f"{len(failed)} variants with a mismatch" + (f"; wrote {args.out}" if args.out else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
