"""The benchmark runner (`python -m benchmarks`) as a user meets it: what results.json
records, sections skipped with a reason when an optional package is missing, a failing
section that does not hide the others, results written after every section (an interrupted
run keeps what finished), --only merging into an earlier run's folder, --full, targets that
show as MISSED, figures that cover no data or are skipped with a reason, and a report that
fits a 100-column terminal."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import report, runner

ROOT = Path(__file__).resolve().parent.parent


def _write_sections(folder: Path) -> None:
    (folder / "common.py").write_text((ROOT / "benchmarks" / "common.py").read_text())
    sections = {
        "bench_good.py": '''
            from common import row
            SECTION = "good"
            def applies(device_type):
                return True
            def run(ctx):
                ctx.skip("the large case", "needs 2 GPUs")
                return [row(SECTION, "many tensors", offload=30.0, baseline=10.0, unit="GB/s",
                            baseline_name="copy_ per tensor", headline="Copy: many tensors")]
        ''',
        "bench_needs.py": '''
            SECTION = "needs"
            REQUIRES = ("offload_test_module_that_is_absent",)
            def applies(device_type):
                return True
            def run(ctx):
                raise AssertionError("a section whose requirement is missing must not run")
        ''',
        "bench_optional.py": '''
            SECTION = "optional"
            def applies(device_type):
                return True
            def run(ctx):
                import transformers  # made absent by the test
        ''',
        "bench_broken.py": '''
            SECTION = "broken"
            def applies(device_type):
                return True
            def run(ctx):
                raise ValueError("a bug in this section")
        ''',
        "bench_elsewhere.py": '''
            SECTION = "elsewhere"
            def applies(device_type):
                return device_type == "no such device"
            def run(ctx):
                raise AssertionError("does not apply here")
        ''',
    }
    for name, text in sections.items():
        (folder / name).write_text(textwrap.dedent(text))


def _said(status: dict) -> dict:
    """A section's status without the run it came from (date, command, --full)."""
    return {k: v for k, v in status.items() if k not in ("date", "command", "full")}


@pytest.fixture
def fake_sections(tmp_path, monkeypatch):
    folder = tmp_path / "sections"
    folder.mkdir()
    _write_sections(folder)
    monkeypatch.setitem(sys.modules, "transformers", None)  # an import of it raises ModuleNotFoundError
    for name in ("common", "bench_good", "bench_needs", "bench_optional", "bench_broken", "bench_elsewhere"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return folder


def test_bench_runner_records_ran_skipped_and_failed_sections(fake_sections, tmp_path):
    out = tmp_path / "out"
    code = runner.main(["--out", str(out)], folder=fake_sections)
    assert code == 1  # the broken section failed; the others still ran or were skipped
    data = json.loads((out / "results.json").read_text())
    sections = data["sections"]
    assert sections["good"]["status"] == "ran"
    assert sections["good"]["skipped_rows"] == [{"what": "the large case", "reason": "needs 2 GPUs"}]
    assert _said(sections["needs"]) == {"status": "skipped",
                                        "reason": "needs offload_test_module_that_is_absent (not installed)"}
    assert _said(sections["optional"]) == {"status": "skipped", "reason": "needs transformers (not installed)"}
    assert sections["broken"]["status"] == "failed"
    assert sections["broken"]["error"] == "ValueError: a bug in this section"
    assert sections["elsewhere"]["status"] == "skipped" and "does not apply" in sections["elsewhere"]["reason"]
    assert [r["case"] for r in data["rows"]] == ["many tensors"]
    meta = data["meta"]
    import offload
    from offload.core import _device

    assert meta["offload"] == offload.__version__
    # quick sizes always on a machine without an accelerator; full sizes on one unless asked
    assert meta["quick"] is (_device.accelerator_type() is None)
    for key in ("git", "device", "device_type", "driver", "torch", "date", "command", "performance_result"):
        assert key in meta, key
    report_md = (out / "report.md").read_text()
    assert "Copy: many tensors" in report_md and "3.0x faster" in report_md


def test_bench_runner_exits_zero_when_nothing_failed(fake_sections, tmp_path):
    (fake_sections / "bench_broken.py").unlink()
    assert runner.main(["--out", str(tmp_path / "out")], folder=fake_sections) == 0


def test_bench_runner_rejects_an_unknown_section(fake_sections, tmp_path, capsys):
    assert runner.main(["--only", "nonesuch", "--out", str(tmp_path)], folder=fake_sections) == 2
    assert "no section nonesuch" in capsys.readouterr().err


@pytest.mark.parametrize("section", ["buckets", "weight_sync"])
def test_bench_runner_skips_sections_without_transformers(section, tmp_path, monkeypatch):
    # The real sections, on a machine without transformers: skipped with the reason, exit 0.
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "out"
    assert runner.main(["--quick", "--only", section, "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert {n: _said(v) for n, v in data["sections"].items()} == {
        section: {"status": "skipped", "reason": "needs transformers (not installed)"}}


@pytest.mark.slow
def test_bench_compile_section_offloads_a_model_compiled_whole(tmp_path, monkeypatch):
    # The real section on the block stack (the Llama rows skipped without transformers): every variant
    # measured but torch's own pass (an accelerator's), bytes offloaded under compile, no graph break.
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "out"
    assert runner.main(["--quick", "--only", "compile", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert _said(data["sections"]["compile"])["status"] == "ran"
    rows = {r["variant"]: r for r in data["rows"] if r["section"] == "compile"}
    assert set(rows) == {"async", "auto", "eager", "eager_async", "auto_alternated"}
    assert rows["auto_alternated"]["layers_offloaded"] == 0  # on the host no copy hides
    assert rows["async"]["offloaded_bytes"] > 0 and rows["eager_async"]["offloaded_bytes"] > 0
    assert rows["eager"]["offloaded_bytes"] == 0
    assert all(r["graph_breaks"] == 0 for name, r in rows.items() if name != "auto_alternated")


def test_bench_runner_lists_the_sections_from_a_clone():
    result = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    names = [line.split(":")[0] for line in result.stdout.splitlines()]
    assert {"activation", "buckets", "copy", "param_offload", "staging", "weight_sync"} <= set(names)


def _long_rows():
    long_name = "DefaultStager(pin=1,shm=1,async=1,nb=1) fresh per save (reuse raised KeyError)"
    return [
        {"section": "staging", "case": "64 tensors x 64 MiB (4 GiB): caller blocked, saves 2-10 (median; "
         "baseline: saves 2-3)", "offload": 0.61, "baseline": 1234.5, "unit": "ms", "baseline_name": long_name,
         "ratio": 1234.5 / 0.61, "headline": "Checkpoint staging: caller blocked, 64 tensors x 64 MiB (4 GiB)"},
        {"section": "activation", "case": "blocks async peak", "offload": 1.5, "baseline": 3.6, "unit": "GiB",
         "baseline_name": "no offload", "ratio": 2.4, "headline": "Activation offload (async): peak, blocks"},
        {"section": "copy", "case": "D2H 1 x 64 KiB", "offload": 5.0, "baseline": 10.0, "unit": "GB/s",
         "baseline_name": "pinned copy_(non_blocking)", "ratio": 0.5},
    ]


def test_bench_report_fits_a_100_column_terminal():
    meta = {"device": "cpu", "device_type": "cpu", "date": "today", "offload": "0", "torch": "2", "core": "native",
            "quick": True, "performance_result": False, "driver": None, "command": "python -m benchmarks"}
    status = {"staging": {"status": "ran"}, "activation": {"status": "ran"}, "copy": {"status": "ran"},
              "buckets": {"status": "skipped", "reason": "needs transformers (not installed)"}}
    text = report.render(_long_rows(), status, meta)
    assert max(len(line) for line in text.splitlines()) <= 100
    lines = text.splitlines()
    assert lines[0].startswith("No accelerator: these numbers are a functional check")
    headline = text.index("Headline")
    assert headline < text.index("staging\n") and "buckets: skipped, needs transformers" in text
    assert "2,024x faster" in text  # caller blocked: 1234.5 ms against 0.61 ms
    assert "0.42x the memory" in text  # 1.5 GiB against 3.6 GiB
    assert "2.0x slower" in text


def test_bench_report_says_nothing_of_a_functional_check_on_an_accelerator():
    meta = {"device": "GPU", "device_type": "cuda", "date": "today", "offload": "0", "torch": "2",
            "core": "native", "quick": False, "performance_result": True}
    assert "functional check" not in report.render(_long_rows(), {}, meta)


def test_bench_figures_pareto_frontier():
    from benchmarks import figures

    points = [(10, 4.0), (12, 2.0), (11, 5.0), (20, 1.0), (25, 1.5)]
    assert figures.pareto(points) == [(10, 4.0), (12, 2.0), (20, 1.0)]


def _frontier_rows():
    rows = []
    for model in ("stack", "llama"):
        for family in ("checkpoint", "offload"):
            for k in range(3):
                rows.append({"figure": "frontier", "model": model, "family": family, "k": k,
                             "offload": 100.0 + 10 * k, "peak_bytes": (3 - k) << 30})
        rows.append({"figure": "frontier", "model": model, "budget_bytes": 2 << 30, "offload": 105.0,
                     "peak_bytes": 1 << 30})
    return rows


def test_bench_figures_frontier_draws_a_panel_per_model(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import figures

    meta = {"device": "cpu", "date": "today", "performance_result": False}
    path = tmp_path / figures.FRONTIER
    assert figures.frontier(_frontier_rows(), meta, path)
    assert path.stat().st_size > 0


def test_bench_figures_frontier_skipped_without_its_rows(tmp_path):
    from benchmarks import figures

    rows = [r for r in _frontier_rows() if r["model"] == "none"] + [{"figure": "activation"}]
    assert not figures.frontier(rows, {}, tmp_path / figures.FRONTIER)
    assert not (tmp_path / figures.FRONTIER).exists()


# ---------------------------------------------------------------- writes after every section, --only, --full


def _write(folder: Path, files: dict) -> None:
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))


@pytest.fixture
def staged_sections(tmp_path, monkeypatch):
    """Three sections in order: one that ran, one that stops the run (how: STOP), one after it."""
    folder = tmp_path / "staged"
    folder.mkdir()
    (folder / "common.py").write_text((ROOT / "benchmarks" / "common.py").read_text())
    _write(folder, {
        "bench_a_first.py": '''
            from common import row
            SECTION = "a_first"
            def applies(device_type):
                return True
            def run(ctx):
                return [row(SECTION, "first case", offload=2.0, baseline=1.0, unit="GB/s", baseline_name="copy_")]
        ''',
        "bench_b_stop.py": '''
            import os
            SECTION = "b_stop"
            def applies(device_type):
                return True
            def run(ctx):
                if os.environ.get("STOP") == "exit":
                    os._exit(3)  # the process dies: nothing after this line runs, no handler either
                raise KeyboardInterrupt
        ''',
        "bench_c_after.py": '''
            SECTION = "c_after"
            def applies(device_type):
                return True
            def run(ctx):
                raise AssertionError("runs after the stop")
        ''',
    })
    for name in ("common", "bench_a_first", "bench_b_stop", "bench_c_after"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return folder


def test_bench_runner_keeps_finished_sections_when_the_process_dies(staged_sections, tmp_path):
    out = tmp_path / "out"
    code = ("import sys; from pathlib import Path; from benchmarks import runner; "
            f"sys.exit(runner.main(['--out', {str(out)!r}], folder=Path({str(staged_sections)!r})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "STOP": "exit"})
    assert done.returncode == 3, done.stdout + done.stderr
    data = json.loads((out / "results.json").read_text())  # written when the first section ended
    assert data["sections"]["a_first"]["status"] == "ran"
    assert [r["case"] for r in data["rows"]] == ["first case"]
    assert "first case" in (out / "report.md").read_text()
    assert not list(out.glob("*.partial"))


def test_bench_runner_interrupted_keeps_what_finished(staged_sections, tmp_path, capsys):
    out = tmp_path / "out"
    assert runner.main(["--out", str(out)], folder=staged_sections) == 130
    data = json.loads((out / "results.json").read_text())
    assert data["sections"]["a_first"]["status"] == "ran"
    assert data["sections"]["b_stop"]["status"] == "interrupted"
    assert "c_after" not in data["sections"]
    assert "b_stop: interrupted" in (out / "report.md").read_text()
    assert "holds the sections that finished" in capsys.readouterr().err


def test_bench_runner_only_merges_into_the_earlier_results(fake_sections, tmp_path):
    out = tmp_path / "out"
    assert runner.main(["--out", str(out)], folder=fake_sections) == 1  # broken fails
    earlier = json.loads((out / "results.json").read_text())
    _write(fake_sections, {"bench_good.py": '''
        from common import row
        SECTION = "good"
        def applies(device_type):
            return True
        def run(ctx):
            return [row(SECTION, "many tensors, again", offload=50.0, baseline=10.0, unit="GB/s",
                        baseline_name="copy_ per tensor", headline="Copy: many tensors")]
    '''})
    assert runner.main(["--only", "good", "--out", str(out)], folder=fake_sections) == 0
    data = json.loads((out / "results.json").read_text())
    # The section named was replaced; every other one is as the earlier run left it.
    assert [r["case"] for r in data["rows"]] == ["many tensors, again"]
    assert data["sections"]["good"]["command"].endswith(f"--only good --out {out}")
    for name in ("needs", "optional", "broken", "elsewhere"):
        assert data["sections"][name] == earlier["sections"][name], name
    assert list(data["sections"]) == ["broken", "elsewhere", "good", "needs", "optional"]
    text = (out / "report.md").read_text()
    assert "5.0x faster" in text and "3.0x faster" not in text  # regenerated from the merged results
    assert "broken: FAILED, ValueError: a bug in this section" in text
    earlier_line = next(line for line in text.splitlines() if "from an earlier run" in line)
    assert earlier_line.endswith("`python -m benchmarks --out " + str(out) + "`): broken, elsewhere, needs, optional")


def test_bench_runner_only_refuses_to_merge_results_of_another_device(fake_sections, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    theirs = {"meta": {"device": "NVIDIA H200", "device_type": "cuda", "torch": "2.11.0", "quick": False,
                       "notes": {}}, "sections": {"good": {"status": "ran"}}, "rows": []}
    (out / "results.json").write_text(json.dumps(theirs))
    assert runner.main(["--only", "good", "--out", str(out)], folder=fake_sections) == 2
    assert json.loads((out / "results.json").read_text()) == theirs
    err = capsys.readouterr().err
    assert "another kind of run" in err and "Pass --out" in err


def test_bench_runner_without_only_replaces_the_folder(fake_sections, tmp_path):
    out = tmp_path / "out"
    assert runner.main(["--out", str(out)], folder=fake_sections) == 1
    (fake_sections / "bench_broken.py").unlink()
    assert runner.main(["--out", str(out)], folder=fake_sections) == 0
    assert "broken" not in json.loads((out / "results.json").read_text())["sections"]


def test_bench_runner_full_only_sections(fake_sections, tmp_path, capsys):
    _write(fake_sections, {"bench_long.py": '''
        from common import row
        SECTION = "long"
        FULL_ONLY = True
        def applies(device_type):
            return True
        def run(ctx):
            return [row(SECTION, "long case", offload=1.0, baseline=1.0, unit="ms", baseline_name="x",
                        full=ctx.full)]
    '''})
    out = tmp_path / "out"
    runner.main(["--out", str(out)], folder=fake_sections)
    printed = capsys.readouterr().out
    assert "Plan (estimated durations" in printed and "total" in printed
    long = json.loads((out / "results.json").read_text())["sections"]["long"]
    assert long["status"] == "skipped" and long["reason"].startswith("runs with --full")
    runner.main(["--only", "long", "--out", str(out)], folder=fake_sections)  # named: it runs
    data = json.loads((out / "results.json").read_text())
    assert data["sections"]["long"]["status"] == "ran"
    assert [r["full"] for r in data["rows"] if r["section"] == "long"] == [False]
    runner.main(["--full", "--out", str(out)], folder=fake_sections)
    data = json.loads((out / "results.json").read_text())
    assert data["sections"]["long"]["full"] is True and data["meta"]["full"] is True
    assert [r["full"] for r in data["rows"] if r["section"] == "long"] == [True]


def test_bench_report_shows_a_missed_target(fake_sections, tmp_path):
    _write(fake_sections, {"bench_targets.py": '''
        from common import row
        SECTION = "targets"
        def applies(device_type):
            return True
        def run(ctx):
            return [row(SECTION, "step time", offload=8.2, baseline=1.0, unit="ms", baseline_name="without",
                        higher_is_better=False, target_ratio=1.05, target_met=False),
                    row(SECTION, "paused step", offload=1.0, baseline=1.0, unit="ms", baseline_name="without",
                        higher_is_better=False, target="<= 1.01x", target_met=True),
                    row(SECTION, "async step", offload=1.2534, baseline=1.0, unit="ms", baseline_name="without",
                        higher_is_better=False, target="<= 1.25x", target_met=False)]
    '''})
    out = tmp_path / "out"
    runner.main(["--only", "targets", "--out", str(out)], folder=fake_sections)
    text = (out / "report.md").read_text()
    assert "- **MISSED** targets: step time: 8.200x slower, target <= 1.05x the baseline" in text
    assert "8.200x slower; MISSED (target <= 1.05x the baseline)" in text  # in the section's table too
    assert "1.000x faster; target met" in text and "paused step: 1.0" not in text.split("## targets")[0]
    assert "async step: 1.253x slower, target <= 1.25x" in text  # not rounded onto the target's figure


def test_bench_runner_and_figures_import_no_circle():
    for first in ("benchmarks.figures", "benchmarks.report", "benchmarks.runner"):
        code = (f"import sys, {first}; "
                "print(sorted(m for m in sys.modules if m.startswith('benchmarks')))")
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        if first != "benchmarks.runner":
            assert "benchmarks.runner" not in done.stdout, (first, done.stdout)


def _transfer_rows():
    return [{"section": "copy", "case": f"D2H 1 x {n}", "figure": "transfer", "direction": "D2H", "tensors": 1,
             "bytes_per_tensor": n, "offload": 2.0, "baseline": 1.0, "baseline_name": "copy_", "unit": "GB/s",
             "ratio": 2.0} for n in (1024, 4096)]


def test_bench_figures_removes_a_figure_whose_rows_are_gone(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import figures

    meta = {"device": "cpu", "date": "today", "performance_result": False, "notes": {}}
    (tmp_path / figures.STAGING).write_text("left by an earlier run")
    drawn = figures.draw_all(_transfer_rows(), meta, tmp_path)
    assert drawn.paths == [tmp_path / figures.TRANSFER] and list(tmp_path.glob("*.png")) == drawn.paths
    drawn = figures.draw_all([], meta, tmp_path, drawn)  # the section that drew it ran again, without them
    assert drawn.paths == [] and not list(tmp_path.glob("*.png"))


def test_bench_figures_skip_memory_plots_without_memory_statistics(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import figures

    meta = {"device": "cpu", "date": "today", "performance_result": False, "notes": {}, "pinned_memory": False}
    rows = [{"figure": "activation", "model": "blocks", "way": way, "offload": 5.0 + k, "peak_bytes": 0}
            for k, way in enumerate(("none", "save_on_cpu", "async"))]
    rows += [dict(r, peak_bytes=0) for r in _frontier_rows()]
    drawn = figures.draw_all(rows, meta, tmp_path)
    assert drawn.paths == [] and not list(tmp_path.glob("*.png"))
    assert len(drawn.notes) == 2 and all("no memory statistics" in note for note in drawn.notes)
    assert figures._way_label("save_on_cpu", meta) == "PyTorch: save_on_cpu"  # nothing is pinned on a CPU torch


def test_bench_report_on_a_cpu_points_to_the_gpu_results():
    meta = {"device": "cpu", "device_type": "cpu", "date": "today", "offload": "0", "torch": "2", "core": "native",
            "quick": True, "performance_result": False, "driver": None, "command": "python -m benchmarks"}
    text = report.markdown(_long_rows(), {}, meta, figure_notes=["activation_memory_time.png not drawn: why"])
    assert "functional check" in text and "benchmarks/RESULTS.md" in text
    assert "- activation_memory_time.png not drawn: why" in text


def test_bench_runner_gives_the_device_cache_back_after_every_section(fake_sections, tmp_path, monkeypatch):
    # A section that spawns processes on the same device (colocated) must not find the last
    # section's cached blocks in this process; a failed section gives its memory back too.
    from offload.core import _device

    emptied = []
    monkeypatch.setattr(_device, "empty_cache", lambda: emptied.append(True))
    runner.main(["--out", str(tmp_path / "out"), "--only", "good", "broken"], folder=fake_sections)
    assert len(emptied) == 2
