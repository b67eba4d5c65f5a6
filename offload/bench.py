"""`python -m offload.bench`: the main job. Runs every benchmark section that applies here.

Each section compares offload with PyTorch's own way of doing the same thing, in the
same process, and prints a table of both and their ratio (>1: offload is better).
Results go to `<out>/results.json` and, where matplotlib is installed, a PNG plot.

Sections live in the repository's `benchmarks/bench_<topic>.py`; this runner finds
them beside the package (a checkout or an editable install).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from .core import _backend, _device


def _benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "benchmarks"
    if not (here / "common.py").exists():
        sys.exit(
            f"offload.bench: the benchmarks folder was not found at {here}; run from a checkout of offload "
            "installed with `pip install --no-build-isolation -e .`"
        )
    return here


def _load_sections(folder: Path, only):
    sys.path.insert(0, str(folder))
    sections = []
    for path in sorted(folder.glob("bench_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        name = getattr(module, "SECTION", path.stem[len("bench_"):])
        if only and name not in only:
            continue
        sections.append((name, module))
    return sections


def _fmt(value, unit=""):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def print_table(rows) -> None:
    headers = ["section", "case", "offload", "baseline", "unit", "ratio", "baseline is"]
    lines = [
        [r["section"], r["case"], _fmt(r["offload"]), _fmt(r["baseline"]), r["unit"],
         "-" if r["ratio"] is None else f"{r['ratio']:.2f}x", r["baseline_name"]]
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))


def plot(rows, path: Path) -> bool:
    """GB/s against transfer size, offload against torch, for rows that carry size_bytes."""
    points = [r for r in rows if r.get("size_bytes") and r["unit"] == "GB/s" and r.get("plot")]
    if not points:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for series in sorted({r["plot"] for r in points}):
        pts = sorted((r for r in points if r["plot"] == series), key=lambda r: r["size_bytes"])
        xs = [r["size_bytes"] for r in pts]
        ax.plot(xs, [r["offload"] for r in pts], marker="o", label=f"offload {series}")
        ax.plot(xs, [r["baseline"] for r in pts], marker="x", linestyle="--", label=f"torch {series}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per transfer")
    ax.set_ylabel("GB/s")
    ax.set_title(f"offload vs torch on {_device.device_name()}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", help="folder for results.json and the plot")
    parser.add_argument("--only", nargs="*", help="run only these sections")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (default on the CPU)")
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    args = parser.parse_args(argv)

    device = _device.current_device()
    quick = args.quick or not _device.is_accelerator(device)
    sections = _load_sections(_benchmarks_dir(), args.only)
    if args.list:
        for name, module in sections:
            print(f"{name}: {'runs' if module.applies(device.type) else 'skipped'} on {device.type}")
        return 0
    from common import Context  # benchmarks/common.py, put on sys.path above

    def progress(message: str) -> None:
        print(f"  .. {message}", flush=True)

    ctx = Context(device=device, quick=quick, progress=progress)
    print(f"offload.bench on {_device.device_name(device)} ({device}), torch {torch.__version__}, "
          f"core: {'native' if _backend.native_available() else 'pure PyTorch (' + str(_backend.why_not()) + ')'}"
          f"{', quick sizes' if quick else ''}", flush=True)
    rows, failures = [], []
    todo = [(n, m) for n, m in sections if m.applies(device.type)]
    for index, (name, module) in enumerate(todo, 1):
        print(f"[{index}/{len(todo)}] {name}", flush=True)
        start = time.perf_counter()
        try:
            rows.extend(module.run(ctx))
        except Exception:  # one broken section must not hide the others' numbers
            failures.append(name)
            traceback.print_exc()
        print(f"  {name} took {time.perf_counter() - start:.1f} s", flush=True)

    print()
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": _device.device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "versions": _device.runtime_versions(),
        "native": _backend.native_available(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m offload.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "notes": ctx.notes,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))
    plotted = plot(rows, out / "transfer_bandwidth.png")
    print(f"\nwrote {out / 'results.json'}" + (f" and {out / 'transfer_bandwidth.png'}" if plotted else ""))
    if failures:
        print(f"sections that failed: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
