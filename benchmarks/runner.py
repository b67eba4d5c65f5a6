"""`python -m benchmarks`: the main job. Runs the benchmark sections that apply here.

Each section compares offload with PyTorch's own way of doing the same thing, in the
same process. The report leads with one headline row per capability, then a table per
section; `<out>/results.json` records every row and, per section, whether it ran, was
skipped (and why) or failed (and the error); `<out>/report.md` holds the tables and,
where matplotlib is installed, the figures go beside it. All three are rewritten after
every section, so an interrupted run keeps what finished.

The default selection fits about five minutes on one H100/H200; `--full` adds the long
sections (FULL_ONLY in their module) and sizes (`ctx.full`), as ESTIMATES lists. A run
without `--only` replaces what `--out` held; a run with `--only` merges into it, replacing
only the sections it names. The exit status is 0 unless a section failed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import offload
from benchmarks import figures, report
from benchmarks.common import missing
from offload.core import _backend, _device

HERE = Path(__file__).resolve().parent
# Packages that only some sections need: a section that finds one missing is skipped, not failed.
OPTIONAL = ("transformers", "matplotlib")


@dataclass(frozen=True)
class Estimate:
    """Rough seconds a section takes, for the plan printed at the start (an estimate, not a promise):
    at default sizes on one H100/H200 (`gpu_s`, for a FULL_ONLY section its whole run), what
    --full adds there (`full_s`, and what that is in `full_adds`), and at quick sizes on a
    2-core host without an accelerator (`cpu_quick_s`). README's "Two commands" lists the same."""
    gpu_s: float
    cpu_quick_s: float
    full_s: float = 0.0
    full_adds: str = ""
    gpus: int = 1  # a section that needs more skips itself within seconds where there are fewer


# From a default run on one H100 (a fresh machine, the first run there: cold caches cost some
# sections a few seconds), section by section, and from what --full's parts took there; the
# CPU column from quick runs on a 2-core host. The frontier's and train_fsdp2's are rougher.
ESTIMATES = {
    "activation": Estimate(48, 12, 50, "the Llama model at seq 2048 and 8192"),
    "buckets": Estimate(10, 5),
    "colocated": Estimate(21, 0),
    "compile": Estimate(270, 100),
    "copy": Estimate(22, 17),
    "frontier": Estimate(600, 60),
    "host": Estimate(37, 1, 36, "the GPU measure's Llama at seq 8192"),
    "param_offload": Estimate(8, 1, 50, "16 GiB instead of 4, three rounds of the module.to baseline instead of one"),
    "staging": Estimate(58, 13, 52, "two more DefaultStager option sets, five rounds of its training loop"),
    "train_fsdp2": Estimate(420, 0, gpus=2),
    "trainer": Estimate(31, 8, 7, "a third round"),
    "weight_sync": Estimate(45, 31, 8, "12 snapshot steps instead of 8; on 2 GPUs also a bucket-size sweep"),
}


def load_sections(folder: Path):
    """(name, module) of every bench_<topic>.py in `folder`, in name order.

    The sections import their helpers by plain name (`from common import row`), as they
    also do when a probe script runs them directly, so their folder goes on sys.path.
    """
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    sections = []
    for path in sorted(folder.glob("bench_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module  # spawned workers find their target by module name
        spec.loader.exec_module(module)
        sections.append((getattr(module, "SECTION", path.stem[len("bench_"):]), module))
    return sections


def why_skipped(module, device_type: str):
    """The reason a section cannot run here, or None."""
    if not module.applies(device_type):
        return f"does not apply to {device_type}"
    absent = [name for name in getattr(module, "REQUIRES", ()) if missing(name)]
    if absent:
        return f"needs {', '.join(absent)} (not installed)"
    return None


def _seconds(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 600 else f"{seconds / 60:.0f} min"


def estimate_s(name: str, accelerator: bool, quick: bool, full: bool, gpus: int = 1) -> Optional[float]:
    """Seconds section `name` is expected to take here, or None where there is no estimate."""
    e = ESTIMATES.get(name)
    if e is None or (accelerator and quick):
        return None
    if not accelerator:
        return e.cpu_quick_s
    if gpus < e.gpus:
        return 0.0
    return e.gpu_s + (e.full_s if full else 0.0)


def _full_only_reason(name: str, accelerator: bool, quick: bool) -> str:
    e = ESTIMATES.get(name)
    needs = e.gpus if e else 1
    seconds = estimate_s(name, accelerator, quick, True, needs)
    where = "here" if not accelerator else "on one H100/H200" if needs == 1 else f"on {needs} GPUs"
    return "runs with --full" + (f" (about {_seconds(seconds)} {where})" if seconds else "") + f" or --only {name}"


def plan_text(plan, accelerator: bool, quick: bool, full: bool, gpus: int = 1) -> str:
    """The sections this run takes, each with its estimated duration, and their total."""
    where = ("one H100/H200, default sizes" + (" and --full" if full else "")) if accelerator and not quick else \
        "quick sizes on a 2-core host" if not accelerator else "no estimates for --quick on an accelerator"
    lines = [f"Plan (estimated durations: {where}; yours differ):"]
    total, unknown = 0.0, False
    for name, reason in plan:
        if reason is not None:
            lines.append(f"  {name:14} skipped, {reason}")
            continue
        seconds = estimate_s(name, accelerator, quick, full, gpus)
        e = ESTIMATES.get(name)
        extra = f"  (--full adds {_seconds(e.full_s)}: {e.full_adds})" if (
            e and e.full_adds and accelerator and not quick and not full) else ""
        if e and accelerator and gpus < e.gpus:
            extra = f"  (needs {e.gpus} GPUs: skips itself here)"
        lines.append(f"  {name:14} {'?' if seconds is None else 'about ' + _seconds(seconds)}{extra}")
        total += seconds or 0.0
        unknown = unknown or seconds is None
    lines.append(f"  {'total':14} " + ("?" if unknown and not total else f"about {_seconds(total)}"
                                        + (" (and the sections without an estimate)" if unknown else "")))
    return "\n".join(lines)


def _git_commit(root: Path):
    """{'commit', 'local_changes'} when `root` is a git checkout, else None."""
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30).stdout.strip()
        changes = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "local_changes": bool(changes)} if commit else None


def _driver(device_type: str):
    """The accelerator driver's version, from the vendor's tool (torch does not report it)."""
    tools = {"cuda": ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]}
    if device_type not in tools or shutil.which(tools[device_type][0]) is None:
        return None
    try:
        out = subprocess.run(tools[device_type], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0].strip() if out.strip() else None


def metadata(device, quick: bool, full: bool, argv, notes: dict) -> dict:
    return {
        "offload": offload.__version__,
        "git": _git_commit(HERE.parent),
        "quick": quick,
        "full": full,
        "device": _device.device_name(device),
        "device_type": device.type,
        "driver": _driver(device.type),
        "torch": torch.__version__,
        "runtime": _device.runtime_versions(),
        "core": "native" if _backend.native_available() else f"pure PyTorch ({_backend.why_not()})",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m benchmarks " + " ".join(argv),
        "performance_result": _device.is_accelerator(device),
        "pinned_memory": _device.pinned_memory_supported(),
        "notes": notes,
    }


def run_section(name, module, ctx):
    """(status dict, rows) of one section; a failure is recorded, not raised."""
    try:
        return _run_section(name, module, ctx)
    finally:
        # What the section allocated goes back to the device: a section that spawns processes
        # on the same device (colocated) would otherwise find this process's cached blocks
        # of the last section's model in its way.
        gc.collect()
        _device.empty_cache()


def _run_section(name, module, ctx):
    before = len(ctx.skipped)
    start = time.perf_counter()
    try:
        rows = list(module.run(ctx))
    except ModuleNotFoundError as error:
        if error.name in OPTIONAL or error.name in getattr(module, "REQUIRES", ()):
            return {"status": "skipped", "reason": f"needs {error.name} (not installed)"}, []
        traceback.print_exc()
        return {"status": "failed", "error": f"{type(error).__name__}: {error}"}, []
    except Exception as error:  # one broken section must not hide the others' numbers
        traceback.print_exc()
        return {"status": "failed", "error": f"{type(error).__name__}: {error}",
                "seconds": round(time.perf_counter() - start, 1)}, []
    for r in rows:
        r.setdefault("section", name)
    return {"status": "ran", "seconds": round(time.perf_counter() - start, 1), "rows": len(rows),
            "skipped_rows": ctx.skipped[before:]}, rows


# Where --only may merge: the earlier results must come from the same device, torch and sizes.
SAME_RUN_KEYS = ("device", "device_type", "torch", "quick")


def earlier_results(out: Path, meta: dict):
    """(results, None) of `out`'s results.json for an --only run to merge into (None when there are
    none), or (None, the reason it cannot)."""
    path = out / "results.json"
    if not path.exists():
        return None, None
    try:
        earlier = json.loads(path.read_text())
        earlier_meta, _, _ = earlier["meta"], earlier["sections"], earlier["rows"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"{path} cannot be read ({type(error).__name__}: {error})"
    differ = [k for k in SAME_RUN_KEYS if earlier_meta.get(k) != meta[k]]
    if differ:
        said = ", ".join(f"{k} {earlier_meta.get(k)!r} there, {meta[k]!r} here" for k in differ)
        return None, f"{path} holds results of another kind of run ({said})"
    return earlier, None


class Output:
    """The folder a run writes: results.json, report.md and the figures, rewritten after every
    section from this run's sections and, for an --only run, the earlier run's others."""

    def __init__(self, folder: Path, order, earlier: Optional[dict]):
        self.folder = folder
        self.order = list(order)
        self.earlier = earlier or {"meta": {"notes": {}}, "sections": {}, "rows": []}
        self.figures = figures.Drawn()

    def merged(self, meta: dict, status: dict, rows):
        """(meta, sections, rows): this run's sections, and the earlier run's that this one has not run."""
        kept = {n: s for n, s in self.earlier["sections"].items() if n not in status}
        names = [n for n in self.order if n in status or n in kept]
        names += [n for n in kept if n not in names]  # a section whose file is gone
        sections = {n: status[n] if n in status else kept[n] for n in names}
        place = {n: i for i, n in enumerate(names)}
        ordered = sorted([r for r in self.earlier["rows"] if r.get("section") not in status] + list(rows),
                         key=lambda r: place.get(r.get("section"), len(place)))
        notes = {**self.earlier["meta"].get("notes", {}), **meta["notes"]}  # e.g. the bus peaks of a copy run
        return {**meta, "notes": notes}, sections, ordered

    def write(self, meta: dict, status: dict, rows) -> None:
        meta, sections, rows = self.merged(meta, status, rows)
        self.folder.mkdir(parents=True, exist_ok=True)
        figures.draw_all(rows, meta, self.folder, self.figures)
        _replace(self.folder / "results.json",
                 json.dumps({"meta": meta, "sections": sections, "rows": rows}, indent=2, default=str))
        _replace(self.folder / "report.md",
                 report.markdown(rows, sections, meta, self.figures.paths, self.figures.notes))

    def render(self, meta: dict, status: dict, rows) -> str:
        meta, sections, rows = self.merged(meta, status, rows)
        return report.render(rows, sections, meta)


def _replace(path: Path, text: str) -> None:
    """Write `path` whole or not at all: an interrupt mid-write leaves the previous file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _list(sections, device) -> None:
    accelerator = _device.is_accelerator(device)
    gpus = _device.device_count(device.type) if accelerator else 0
    for name, module in sections:
        reason = why_skipped(module, device.type)
        if reason is not None:
            print(f"{name}: skipped, {reason}")
            continue
        seconds = estimate_s(name, accelerator, not accelerator, False, gpus)
        e = ESTIMATES.get(name)
        said = [] if seconds is None else [f"about {_seconds(seconds)}"]
        if e and e.full_adds and accelerator:
            said.append(f"--full adds {_seconds(e.full_s)}: {e.full_adds}")
        when = " with --full or --only" if getattr(module, "FULL_ONLY", False) else ""
        print(f"{name}: runs on {device.type}{when}" + (f" ({'; '.join(said)})" if said else ""))


def main(argv=None, folder: Path = HERE, started: Optional[float] = None) -> int:
    """`started`: the `time.perf_counter()` the run's process began at, for the start-up time
    reported at the end (`python -m benchmarks` passes when its package began to load)."""
    began = time.perf_counter() if started is None else started
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", help="folder for results.json, report.md and the figures")
    parser.add_argument("--only", nargs="*", help="run only these sections, merging them into --out's results")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (always on the CPU)")
    parser.add_argument("--full", action="store_true",
                        help="also the long sections and sizes (the frontier sweep, the big Llama sweeps, ...)")
    parser.add_argument("--list", action="store_true", help="list the sections and whether they run here")
    args = parser.parse_args(argv)

    device = _device.current_device()
    accelerator = _device.is_accelerator(device)
    quick = args.quick or not accelerator
    sections = load_sections(folder)
    names = [name for name, _ in sections]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        print(f"python -m benchmarks: no section {', '.join(unknown)}; sections: {', '.join(names)}", file=sys.stderr)
        return 2
    if args.list:
        _list(sections, device)
        return 0

    from common import Context  # the sections' own copy of it (their folder is on sys.path)

    def progress(message: str) -> None:
        print(f"  .. {message}", flush=True)

    ctx = Context(device=device, quick=quick, full=args.full, progress=progress)
    meta = metadata(device, quick, args.full, argv, ctx.notes)
    out = Path(args.out)
    earlier = None
    if args.only:
        earlier, problem = earlier_results(out, meta)
        if problem:
            print(f"python -m benchmarks: {problem}; --only merges only into results of the same device, torch and "
                  "sizes (--quick or not). Pass --out to write elsewhere, or run without --only to replace them.",
                  file=sys.stderr)
            return 2
    output = Output(out, names, earlier)

    chosen = [(n, m) for n, m in sections if not args.only or n in args.only]
    plan = []
    for name, module in chosen:
        reason = why_skipped(module, device.type)
        if reason is None and getattr(module, "FULL_ONLY", False) and not (args.full or args.only):
            reason = _full_only_reason(name, accelerator, quick)
        plan.append((name, reason))
    print(report.header(meta), flush=True)
    gpus = _device.device_count(device.type) if accelerator else 0
    print(plan_text(plan, accelerator, quick, args.full, gpus), flush=True)
    print(f"Writing into {out}/ after every section: results.json, report.md and the figures"
          + (f" (merged with the {len(earlier['sections'])} sections there)" if earlier else ""), flush=True)

    status, rows = {}, []
    stamp = {"date": meta["date"], "command": meta["command"], "full": args.full}
    clock = {"start": time.perf_counter() - began, "sections": 0.0, "writing": 0.0}

    def write() -> None:
        t0 = time.perf_counter()
        output.write(meta, status, rows)
        clock["writing"] += time.perf_counter() - t0

    for index, ((name, module), (_, reason)) in enumerate(zip(chosen, plan), 1):
        if reason is not None:
            print(f"[{index}/{len(chosen)}] {name}: skipped, {reason}", flush=True)
            status[name] = {"status": "skipped", "reason": reason, **stamp}
            write()
            continue
        print(f"[{index}/{len(chosen)}] {name}", flush=True)
        start = time.perf_counter()
        try:
            said, section_rows = run_section(name, module, ctx)
        except KeyboardInterrupt:
            status[name] = {"status": "interrupted", "seconds": round(time.perf_counter() - start, 1), **stamp}
            write()
            print(f"\ninterrupted in {name}; {out}/ holds the sections that finished", file=sys.stderr)
            return 130
        clock["sections"] += time.perf_counter() - start
        status[name] = {**said, **stamp}
        rows += section_rows
        write()
        print(f"  {name}: {said['status']}" + (f" in {said['seconds']} s" if "seconds" in said else "")
              + (f" ({said.get('reason') or said.get('error')})" if said["status"] != "ran" else ""), flush=True)

    print()
    print(output.render(meta, status, rows))
    drawn = [p.name for p in output.figures.paths]
    print(f"\nwrote into {out}/: " + ", ".join(["results.json", "report.md"] + drawn))
    for note in output.figures.notes:
        print(note)
    if figures.matplotlib_missing():
        print("no figures: matplotlib is not installed (pip install matplotlib)")
    print(f"took {_seconds(time.perf_counter() - began)}: start-up {clock['start']:.0f} s, sections "
          f"{clock['sections']:.0f} s, writing results and figures {clock['writing']:.0f} s")
    failed = [name for name, s in status.items() if s["status"] == "failed"]
    if failed:
        print(f"sections that failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
