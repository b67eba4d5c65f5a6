"""`python -m benchmarks`: the main job. Runs every benchmark section that applies here.

Each section compares offload with PyTorch's own way of doing the same thing, in the
same process. The report leads with one headline row per capability, then a table per
section; `<out>/results.json` records every row and, per section, whether it ran, was
skipped (and why) or failed (and the error); `<out>/report.md` holds the tables and,
where matplotlib is installed, the figures go beside it. The exit status is 0 unless
a section failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

import offload
from offload.core import _backend, _device

HERE = Path(__file__).resolve().parent
# Packages that only some sections need: a section that finds one missing is skipped, not failed.
OPTIONAL = ("transformers", "matplotlib")


def missing(module: str) -> bool:
    """Whether `module` cannot be imported, without importing it."""
    if module in sys.modules:
        return sys.modules[module] is None  # None marks a module known to be absent
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


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
    """The reason a section does not run here, or None."""
    if not module.applies(device_type):
        return f"does not apply to {device_type}"
    absent = [name for name in getattr(module, "REQUIRES", ()) if missing(name)]
    if absent:
        return f"needs {', '.join(absent)} (not installed)"
    return None


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


def metadata(device, quick: bool, argv, notes: dict) -> dict:
    return {
        "offload": offload.__version__,
        "git": _git_commit(HERE.parent),
        "quick": quick,
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
        "notes": notes,
    }


def run_section(name, module, ctx):
    """(status dict, rows) of one section; a failure is recorded, not raised."""
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


def main(argv=None, folder: Path = HERE) -> int:
    from benchmarks import figures, report

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", help="folder for results.json, report.md and the figures")
    parser.add_argument("--only", nargs="*", help="run only these sections")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (always on the CPU)")
    parser.add_argument("--list", action="store_true", help="list the sections and whether they run here")
    args = parser.parse_args(argv)

    device = _device.current_device()
    quick = args.quick or not _device.is_accelerator(device)
    sections = load_sections(folder)
    names = [name for name, _ in sections]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        print(f"python -m benchmarks: no section {', '.join(unknown)}; sections: {', '.join(names)}", file=sys.stderr)
        return 2
    if args.list:
        for name, module in sections:
            reason = why_skipped(module, device.type)
            print(f"{name}: {'runs' if reason is None else 'skipped, ' + reason} on {device.type}")
        return 0

    from common import Context  # the sections' own copy of it (their folder is on sys.path)

    def progress(message: str) -> None:
        print(f"  .. {message}", flush=True)

    ctx = Context(device=device, quick=quick, progress=progress)
    meta = metadata(device, quick, argv, ctx.notes)
    print(report.header(meta), flush=True)
    chosen = [(n, m) for n, m in sections if not args.only or n in args.only]
    status, rows = {}, []
    for index, (name, module) in enumerate(chosen, 1):
        reason = why_skipped(module, device.type)
        if reason is not None:
            print(f"[{index}/{len(chosen)}] {name}: skipped, {reason}", flush=True)
            status[name] = {"status": "skipped", "reason": reason}
            continue
        print(f"[{index}/{len(chosen)}] {name}", flush=True)
        status[name], section_rows = run_section(name, module, ctx)
        rows += section_rows
        said = status[name]
        print(f"  {name}: {said['status']}" + (f" in {said['seconds']} s" if "seconds" in said else "")
              + (f" ({said.get('reason') or said.get('error')})" if said["status"] != "ran" else ""), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    drawn = figures.draw_all(rows, meta, out)
    text = report.render(rows, status, meta)
    print()
    print(text)
    (out / "report.md").write_text(report.markdown(rows, status, meta, drawn))
    (out / "results.json").write_text(json.dumps({"meta": meta, "sections": status, "rows": rows}, indent=2,
                                                 default=str))
    print(f"\nwrote into {out}/: " + ", ".join(["results.json", "report.md"] + [p.name for p in drawn]))
    if figures.matplotlib_missing():
        print("no figures: matplotlib is not installed (pip install matplotlib)")
    failed = [name for name, s in status.items() if s["status"] == "failed"]
    if failed:
        print(f"sections that failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
