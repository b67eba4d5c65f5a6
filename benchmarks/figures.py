"""The main job's figures, drawn from the rows' figure fields (see common.py):

- activation_memory_time.png: peak activation memory against step time, one point per
  way of saving activations, one panel per model, the Pareto frontier drawn;
- transfer_bandwidth.png: GB/s against bytes per tensor, one tensor and many, offload
  against PyTorch's copies, the measured bus peak as a line;
- staging_weight_sync.png: caller-blocked time and GB/s of checkpoint staging and weight
  sync against DCP's DefaultStager and per-tensor loops;
- activation_frontier.png: auto mode's plan at each memory budget against checkpointing or
  offloading the first k layers, peak activation memory against step time, one panel per model.

Each is skipped when its rows are absent (a section skipped) or matplotlib is not installed,
and a memory figure where the device keeps no memory statistics (every peak reads 0): `draw_all`
says why in its notes. Legends sit below the axes, where they cover no data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.common import missing

ACTIVATION = "activation_memory_time.png"
TRANSFER = "transfer_bandwidth.png"
STAGING = "staging_weight_sync.png"
FRONTIER = "activation_frontier.png"
OFFLOAD_COLOR = "tab:blue"
# Ways of saving activations: (label in the legend, marker, PyTorch's own way?)
WAYS = {
    "none": ("PyTorch: no offload", "o", True),
    "checkpoint": ("PyTorch: activation checkpointing", "s", True),
    "save_on_cpu": ("PyTorch: save_on_cpu(pin_memory)", "D", True),  # "save_on_cpu" where nothing is pinned
    "async": ("offload: async", "^", False),
    "auto": ("offload: auto", "v", False),
    "async+checkpoint": ("offload: async + checkpointing", "P", False),
}


class NotDrawn(Exception):
    """A figure whose rows exist but would show nothing: the reason, for the report."""


def matplotlib_missing() -> bool:
    return missing("matplotlib")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(what: str, meta: dict) -> str:
    title = f"{what}\n{meta['device']}, {meta['date']}"
    if not meta["performance_result"]:
        title += " (no accelerator: functional check, not a performance result)"
    return title


def _legend_below(fig, axes) -> None:
    """One legend for the figure, below its axes: inside them it covers bars and points."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(3, len(entries)), fontsize=7, frameon=False)


def _finish(plt, fig, what: str, meta: dict, path: Path) -> bool:
    """Title the figure, lay it out, put the legend below it and write it to `path`."""
    fig.suptitle(_title(what, meta), fontsize=10)
    fig.tight_layout()
    _legend_below(fig, fig.axes)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the saved area grows to hold the legend
    plt.close(fig)
    return True


def _needs_memory_statistics(peaks) -> None:
    if all(not p for p in peaks):
        raise NotDrawn("every peak reads 0 GiB: this device keeps no memory statistics (the CPU), so there is "
                       "nothing to plot")


def _way_label(way: str, meta: dict) -> str:
    label = WAYS[way][0]
    if way == "save_on_cpu" and not meta.get("pinned_memory", True):
        label = "PyTorch: save_on_cpu"  # pin_memory=False: a CPU-only torch has no pinned memory
    return label


def _memory_time_axes(ax, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("training step time (ms)")
    ax.set_ylabel("peak activation memory (GiB)")
    ax.grid(True, alpha=0.3)


def pareto(points):
    """The points no other point beats on both step time and memory, by step time."""
    front, best = [], float("inf")
    for x, y in sorted(points):
        if y < best:
            front.append((x, y))
            best = y
    return front


def activation(rows, meta, path: Path) -> bool:
    rows = [r for r in rows if r.get("figure") == "activation" and r.get("way") in WAYS]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        return False
    _needs_memory_statistics(r["peak_bytes"] for r in rows)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        points = []
        for r in (r for r in rows if r["model"] == model):
            _, marker, theirs = WAYS[r["way"]]
            x, y = r["offload"], r["peak_bytes"] / 2**30
            points.append((x, y))
            ax.scatter([x], [y], marker=marker, s=60, label=_way_label(r["way"], meta),
                       color="tab:gray" if theirs else OFFLOAD_COLOR, edgecolors="black", linewidths=0.5, zorder=3)
        front = pareto(points)
        ax.plot([p[0] for p in front], [p[1] for p in front], linestyle="--", color="tab:green", linewidth=1,
                label="Pareto frontier", zorder=2)
        _memory_time_axes(ax, model)
    return _finish(plt, fig, "Activation memory against step time (lower left is better)", meta, path)


def _size_label(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


def transfer(rows, meta, path: Path) -> bool:
    rows = [r for r in rows if r.get("figure") == "transfer"]
    directions = [d for d in ("D2H", "H2D") if any(r["direction"] == d for r in rows)]
    if not directions:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(directions), figsize=(6 * len(directions), 4.6), squeeze=False, sharey=True)
    for ax, direction in zip(axes[0], directions):
        mine = [r for r in rows if r["direction"] == direction]
        single = sorted((r for r in mine if r["tensors"] == 1), key=lambda r: r["bytes_per_tensor"])
        if single:
            xs = [r["bytes_per_tensor"] for r in single]
            ax.plot(xs, [r["offload"] for r in single], marker="o", color=OFFLOAD_COLOR, label="offload, one tensor")
            ax.plot(xs, [r["baseline"] for r in single], marker="x", linestyle="--", color="tab:gray",
                    label=f"PyTorch {single[0]['baseline_name']}, one tensor")
        many = [r for r in mine if r["tensors"] > 1]
        for k, r in enumerate(many):
            ax.scatter([r["bytes_per_tensor"]], [r["offload"]], marker="*", s=160, color=OFFLOAD_COLOR,
                       edgecolors="black", linewidths=0.5, zorder=3, label="offload, many tensors" if k == 0 else None)
            ax.scatter([r["bytes_per_tensor"]], [r["baseline"]], marker="X", s=70, color="tab:orange", zorder=3,
                       label=f"PyTorch {r['baseline_name']}, many tensors" if k == 0 else None)
            ax.annotate(f"{r['tensors']} tensors", (r["bytes_per_tensor"], r["offload"]), textcoords="offset points",
                        xytext=(6, 4), fontsize=7)
        peak = meta["notes"].get(f"bus_peak_{direction.lower()}_gbps")
        if peak and meta["performance_result"]:
            ax.axhline(peak, color="tab:red", linestyle=":", label=f"bus peak, measured ({peak:.1f} GB/s)")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["bytes_per_tensor"] for r in mine})
        ax.set_xticks(ticks)
        ax.set_xticklabels([_size_label(t) for t in ticks], fontsize=7, rotation=30)
        ax.set_xlabel("bytes per tensor")
        ax.set_ylabel("bandwidth (GB/s)")
        ax.set_title(f"{direction} ({'device to host' if direction == 'D2H' else 'host to device'})", fontsize=10)
        ax.grid(True, alpha=0.3)
    return _finish(plt, fig, "Transfer bandwidth: offload against PyTorch's copies", meta, path)


def _panel_value(r):
    if r["panel"] == "gbps" and r["unit"] == "ms":  # a time over the bytes moved
        return (r["bytes"] / (r["offload"] * 1e6) if r["offload"] else None,
                r["bytes"] / (r["baseline"] * 1e6) if r["baseline"] else None)
    return r["offload"], r["baseline"]


def staging(rows, meta, path: Path) -> bool:
    rows = [r for r in rows if r.get("figure") == "staging_weight_sync"]
    panels = [p for p in ("blocked", "gbps") if any(r["panel"] == p for r in rows)]
    if not panels:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    baselines = list(dict.fromkeys(r["baseline_name"] for r in rows if r["baseline"] is not None))
    colors = {name: plt.get_cmap("Set2")(k % 8) for k, name in enumerate(baselines)}
    for ax, panel in zip(axes[0], panels):
        mine = [r for r in rows if r["panel"] == panel]
        groups = list(dict.fromkeys(r["group"] for r in mine))
        series = ["offload"] + [b for b in baselines if any(r["baseline_name"] == b for r in mine)]
        width = 0.8 / len(series)
        labelled = set()
        for g, group in enumerate(groups):
            values = {}
            for r in (r for r in mine if r["group"] == group):
                ours, theirs = _panel_value(r)
                values["offload"] = ours
                if theirs is not None:
                    values[r["baseline_name"]] = theirs
            for s, name in enumerate(series):
                if values.get(name) is None:
                    continue
                label = None if name in labelled else name
                labelled.add(name)
                ax.bar(g - 0.4 + width * (s + 0.5), values[name], width, label=label, edgecolor="black",
                       color=OFFLOAD_COLOR if name == "offload" else colors[name], linewidth=0.4)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, fontsize=7, rotation=20, ha="right")
        ax.set_yscale("log")  # the ways differ by orders of magnitude
        if panel == "blocked":
            ax.set_ylabel("caller blocked per save (ms, log scale, lower is better)")
            ax.set_title("Time the training loop waits", fontsize=10)
        else:
            ax.set_ylabel("bandwidth (GB/s, log scale, higher is better)")
            ax.set_title("Bytes moved per second", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    return _finish(plt, fig, "Checkpoint staging and weight sync: offload against DCP's DefaultStager and "
                   "per-tensor loops", meta, path)


# The frontier's hand-written plans: (label, marker, colour) per family.
FAMILIES = {
    "checkpoint": ("PyTorch: checkpoint the first k layers", "s", "tab:gray"),
    "offload": ("offload the first k layers (async)", "D", "tab:orange"),
}


def frontier(rows, meta, path: Path) -> bool:
    rows = [r for r in rows if r.get("figure") == "frontier"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        return False
    _needs_memory_statistics(r["peak_bytes"] for r in rows)
    plt = _pyplot()
    cols = min(2, len(models))  # two panels a row: four in one row are too narrow to read
    nrows = -(-len(models) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.6 * nrows), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        mine = [r for r in rows if r["model"] == model]
        for family, (label, marker, color) in FAMILIES.items():
            points = sorted((r["k"], r["offload"], r["peak_bytes"] / 2**30) for r in mine if r.get("family") == family)
            if not points:
                continue
            ax.plot([p[1] for p in points], [p[2] for p in points], marker=marker, color=color, label=label,
                    linewidth=1, markersize=5, zorder=2)
            for k, x, y in points:
                ax.annotate(str(k), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6, color=color)
        plans = [(r["offload"], r["peak_bytes"] / 2**30) for r in mine if "budget_bytes" in r]
        if plans:
            ax.scatter([p[0] for p in plans], [p[1] for p in plans], marker="v", s=70, color=OFFLOAD_COLOR,
                       edgecolors="black", linewidths=0.5, label="offload: auto with a memory budget", zorder=3)
        _memory_time_axes(ax, model)
    return _finish(plt, fig, "Activation memory budget frontier: the planner against checkpointing or offloading "
                   "the first k layers (lower left is better; k beside each point)", meta, path)


# Every figure: its file, the rows' `figure` field that feeds it, and the function drawing it.
FIGURES = ((ACTIVATION, "activation", activation), (TRANSFER, "transfer", transfer),
           (STAGING, "staging_weight_sync", staging), (FRONTIER, "frontier", frontier))


@dataclass
class Drawn:
    """The figures in a folder after `draw_all`: those drawn, and why others that had rows were not."""
    paths: List[Path] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    _seen: Dict[str, str] = field(default_factory=dict)  # file name -> signature of the rows last drawn from
    _outcome: Dict[str, Optional[str]] = field(default_factory=dict)  # file name -> None (drawn) or a note


def _signature(rows, meta) -> str:
    return hashlib.sha256(json.dumps([rows, meta.get("date"), meta.get("device")], sort_keys=True,
                                     default=str).encode()).hexdigest()


def draw_all(rows, meta: dict, out: Path, drawn: Optional[Drawn] = None) -> Drawn:
    """Draw into `out` every figure that has rows and remove those that have none (left by an
    earlier run). With `drawn` from an earlier call on the same folder, a figure whose rows did not
    change since is left as it is (the runner calls this after every section)."""
    drawn = drawn if drawn is not None else Drawn()
    if matplotlib_missing():
        drawn.paths, drawn.notes = [], []
        return drawn
    for name, key, draw in FIGURES:
        path = out / name
        mine = [r for r in rows if r.get("figure") == key]
        signature = _signature(mine, meta)
        if drawn._seen.get(name) != signature:
            drawn._seen[name] = signature
            try:
                drawn._outcome[name] = None if draw(mine, meta, path) else ""
            except NotDrawn as reason:
                drawn._outcome[name] = str(reason)
            if drawn._outcome[name] is not None and path.exists():
                path.unlink()  # a figure of an earlier run whose rows are gone or say nothing
    drawn.paths = [out / name for name, _, _ in FIGURES if name in drawn._outcome and drawn._outcome[name] is None]
    drawn.notes = [f"{name} not drawn: {note}" for name, _, _ in FIGURES if (note := drawn._outcome.get(name))]
    return drawn
