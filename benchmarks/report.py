"""The main job's report: a headline table (one row per capability), then one table per section.

Every table fits a 100-column terminal: cells wrap inside their column. A ratio is
said with its direction, from offload's side: "3.1x faster", "0.42x the memory". A row
that carries a target (`target_met`, common.py) says "target met" or "MISSED" beside its
ratio, and the missed ones are listed under the headline.
"""

from __future__ import annotations

import textwrap

WIDTH = 100
MEMORY_UNITS = ("GiB", "MiB", "GB", "bytes")


def value(number, unit: str) -> str:
    if number is None:
        return "-"
    if isinstance(number, float):
        shown = f"{number:.3g}" if abs(number) < 1000 else f"{number:,.0f}"
    else:
        shown = str(number)
    return f"{shown} {unit}"


def _times(x: float, fine: bool = False) -> str:
    """`fine`: three decimals below 10x, for a ratio read against a target (1.253x against
    <= 1.25x would round to the target's own figure)."""
    if fine and x < 10:
        return f"{x:.3f}x"
    return f"{x:.2f}x" if x < 1 else f"{x:.1f}x" if x < 10 else f"{x:,.0f}x"


def _ratio_words(row: dict) -> str:
    if row.get("ratio") is None:
        return "-"
    fine = "target_met" in row
    if row["unit"] in MEMORY_UNITS:
        return f"{_times(row['offload'] / row['baseline'], fine)} the memory"
    ratio = row["ratio"]  # > 1: offload is better (common.row)
    return f"{_times(ratio, fine)} faster" if ratio >= 1 else f"{_times(1 / ratio, fine)} slower"


def ratio_text(row: dict) -> str:
    """offload against the baseline, in words: faster/slower for time and bandwidth, a share for
    memory; then the row's target, met or MISSED, where it has one."""
    said = _ratio_words(row)
    if "target_met" not in row:
        return said
    return f"{said}; " + ("target met" if row["target_met"] else f"MISSED (target {target_text(row)})")


def target_text(row: dict) -> str:
    """A row's target in words: its own `target`, else its `target_ratio` (the most offload/baseline may be)."""
    if row.get("target"):
        return str(row["target"])
    if row.get("target_ratio") is not None:
        return f"<= {row['target_ratio']:g}x the baseline"
    return "set by the section"


def missed_rows(rows):
    return [r for r in rows if r.get("target_met") is False]


def table(headers, lines, width: int = WIDTH) -> str:
    """A plain-text table no wider than `width`: the widest columns are narrowed and their cells wrap."""
    gap = 2
    natural = [max([len(h)] + [len(str(line[i])) for line in lines]) for i, h in enumerate(headers)]
    widths = list(natural)
    floor = [max(6, min(len(h), 12)) for h in headers]
    while sum(widths) + gap * (len(widths) - 1) > width:
        widest = max(range(len(widths)), key=lambda i: widths[i] - floor[i])
        if widths[widest] <= floor[widest]:
            break
        widths[widest] -= 1
    out = []

    def emit(cells):
        wrapped = [textwrap.wrap(str(c), w, break_long_words=True, break_on_hyphens=False) or [""]
                   for c, w in zip(cells, widths)]
        for k in range(max(len(w) for w in wrapped)):
            parts = [(w[k] if k < len(w) else "").ljust(widths[i]) for i, w in enumerate(wrapped)]
            out.append((" " * gap).join(parts).rstrip())

    emit(headers)
    out.append((" " * gap).join("-" * w for w in widths))
    for line in lines:
        emit(line)
    return "\n".join(out)


def headline_rows(rows):
    return [r for r in rows if r.get("headline")]


def _headline_lines(rows):
    return [[r["headline"], value(r["offload"], r["unit"]), r["baseline_name"], value(r["baseline"], r["unit"]),
             ratio_text(r)] for r in headline_rows(rows)]


HEADLINE_HEADERS = ["capability: case", "offload", "PyTorch's way", "PyTorch", "offload is"]
SECTION_HEADERS = ["case", "offload", "baseline", "baseline is", "offload is"]


def _section_lines(rows, section):
    return [[r["case"], value(r["offload"], r["unit"]), value(r["baseline"], r["unit"]), r["baseline_name"],
             ratio_text(r)] for r in rows if r["section"] == section]


def header(meta: dict) -> str:
    line = (f"offload {meta['offload']} benchmarks on {meta['device']} ({meta['device_type']}), "
            f"torch {meta['torch']}, core: {meta['core']}" + (", quick sizes" if meta["quick"] else ""))
    return "\n".join(textwrap.wrap(line, WIDTH, subsequent_indent="  "))


def functional_note(meta: dict):
    if meta["performance_result"]:
        return None
    return ("No accelerator: these numbers are a functional check that every path runs, at tiny sizes, not "
            "a performance result; peak memory reads 0 (the CPU keeps no memory statistics) and the targets "
            "are set for an accelerator. The GPU figures are in benchmarks/RESULTS.md.")


def _status_lines(status: dict, meta: dict):
    lines = []
    for name, s in status.items():
        if s["status"] == "skipped":
            lines.append(f"{name}: skipped, {s['reason']}")
        elif s["status"] == "failed":
            lines.append(f"{name}: FAILED, {s['error']}")
        elif s["status"] == "interrupted":
            lines.append(f"{name}: interrupted after {s.get('seconds', 0)} s; no rows")
        for skipped in s.get("skipped_rows", ()):
            lines.append(f"{name}: left out {skipped['what']}: {skipped['reason']}")
    return lines + _earlier_lines(status, meta)


def _earlier_lines(status: dict, meta: dict):
    """The sections an --only run kept from earlier runs, grouped by the run they came from."""
    runs = {}
    for name, s in status.items():
        run = (s.get("date"), s.get("command"))
        if run[0] and run != (meta.get("date"), meta.get("command")):
            runs.setdefault(run, []).append(name)
    return [f"from an earlier run ({date}, `{(command or '?').strip()}`): {', '.join(names)}"
            for (date, command), names in runs.items()]


def _missed_lines(rows):
    return [f"{r['section']}: {r['case']}: {_ratio_words(r)}, target {target_text(r)}" for r in missed_rows(rows)]


def _section_title(name: str, s: dict) -> str:
    return name + (" (--full sizes)" if s.get("full") else "")


def render(rows, status: dict, meta: dict) -> str:
    parts = []
    note = functional_note(meta)
    if note:
        parts.append("\n".join(textwrap.wrap(note, WIDTH)))
    parts.append(f"Headline ({meta['device']}, {meta['date']})\n" + table(HEADLINE_HEADERS, _headline_lines(rows)))
    missed = _missed_lines(rows)
    if missed:
        parts.append("\n".join(textwrap.fill(f"MISSED {line}", WIDTH, subsequent_indent="  ") for line in missed))
    said = _status_lines(status, meta)
    if said:
        parts.append("\n".join(textwrap.fill(line, WIDTH, subsequent_indent="  ") for line in said))
    for name, s in status.items():
        if s["status"] == "ran" and any(r["section"] == name for r in rows):
            parts.append(f"{_section_title(name, s)}\n" + table(SECTION_HEADERS, _section_lines(rows, name)))
    return "\n\n".join(parts)


def _md_table(headers, lines) -> str:
    def cells(items):
        return "| " + " | ".join(str(c).replace("|", "/") for c in items) + " |"

    return "\n".join([cells(headers), cells(["---"] * len(headers))] + [cells(line) for line in lines])


def markdown(rows, status: dict, meta: dict, figures=(), figure_notes=()) -> str:
    """report.md: the same tables in Markdown, under one line of device, date, torch and command;
    `figure_notes` say why a figure is absent."""
    parts = [f"Device: {meta['device']} ({meta['device_type']}, driver {meta['driver'] or '-'}), {meta['date']}, "
             f"torch {meta['torch']}, offload {meta['offload']}"
             + (f" at {meta['git']['commit'][:12]}" if meta.get("git") else "")
             + f". Command: `{meta['command'].strip()}`."]
    note = functional_note(meta)
    if note:
        parts.append(f"**{note}**")
    parts.append("## Headline\n\n" + _md_table(HEADLINE_HEADERS, _headline_lines(rows)))
    missed = _missed_lines(rows)
    if missed:
        parts.append("**Targets missed:**\n\n" + "\n".join(f"- **MISSED** {line}" for line in missed))
    for path in figures:
        parts.append(f"![{path.stem}]({path.name})")
    said = _status_lines(status, meta) + list(figure_notes)
    if said:
        parts.append("\n".join(f"- {line}" for line in said))
    for name, s in status.items():
        if s["status"] == "ran" and any(r["section"] == name for r in rows):
            parts.append(f"## {_section_title(name, s)}\n\n" + _md_table(SECTION_HEADERS, _section_lines(rows, name)))
    return "\n\n".join(parts) + "\n"
