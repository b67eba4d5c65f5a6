"""The benchmark runner (`python -m benchmarks`) as a user meets it: what results.json
records, sections skipped with a reason when an optional package is missing, a failing
section that does not hide the others, and a report that fits a 100-column terminal."""

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
    assert sections["needs"] == {"status": "skipped",
                                 "reason": "needs offload_test_module_that_is_absent (not installed)"}
    assert sections["optional"] == {"status": "skipped", "reason": "needs transformers (not installed)"}
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
    assert data["sections"] == {section: {"status": "skipped", "reason": "needs transformers (not installed)"}}


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
