"""The training benchmarks' harnesses on the CPU: benchmarks/bench_train_fsdp2.py (torchrun, gloo, a tiny
model) reads what examples/train_fsdp2.py prints, and the runner's `trainer` section trains a tiny Llama
with and without the callback. The figures that matter come from accelerators; these check the plumbing."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_train_fsdp2", ROOT / "benchmarks" / "bench_train_fsdp2.py")
bench_train_fsdp2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_train_fsdp2)

_OUTPUT = """\
resumed from step 0
step 0 loss 5.55 tokens/s 100 peak_memory_gib 1.00
step 1 loss 5.54 tokens/s 200 peak_memory_gib 1.00 checkpoint_ms 3.0
step 2 loss 5.53 tokens/s 300 peak_memory_gib 1.00 checkpoint_ms 4.0 offloaded_mib 1.000 exposed_wait_ms 0.10
step 3 loss 5.52 tokens/s 400 peak_memory_gib 1.00
summary {"steps": 4, "tokens_per_s": 350.0, "peak_memory_bytes": 1073741824, "checkpoint_ms": 3.5}
"""


def test_bench_train_fsdp2_parses_steps_after_warmup_and_the_summary():
    run = bench_train_fsdp2.parse_run(_OUTPUT, warmup=2)
    assert run["tokens_per_s"] == [300.0, 400.0]
    assert run["summary"] == {"steps": 4, "tokens_per_s": 350.0, "peak_memory_bytes": 1073741824,
                              "checkpoint_ms": 3.5}
    with pytest.raises(ValueError, match="no summary line"):
        bench_train_fsdp2.parse_run(_OUTPUT.rsplit("summary", 1)[0], warmup=2)


def test_bench_train_fsdp2_alternates_and_judges_against_off():
    assert bench_train_fsdp2.order(0) == ("off", "auto", "checkpoint")
    assert bench_train_fsdp2.order(1) == ("checkpoint", "auto", "off")
    results = {"off": {"tokens_per_s": 1000.0, "peak_memory_bytes": 100},
               "auto": {"tokens_per_s": 975.0, "peak_memory_bytes": 60},
               "checkpoint": {"tokens_per_s": 940.0, "peak_memory_bytes": 120}}
    v = bench_train_fsdp2.verdicts(results)
    assert v["auto"]["met"] and v["auto"]["memory_ratio"] == 0.6
    assert not v["checkpoint"]["met"] and v["checkpoint"]["tokens_ratio"] == 0.94
    results["auto"]["peak_memory_bytes"] = 100  # as fast, but no memory saved: missed
    assert not bench_train_fsdp2.verdicts(results)["auto"]["met"]
    # --configs auto: off and auto only, judged and tabled alike.
    assert bench_train_fsdp2.order(1, ("off", "auto")) == ("auto", "off")
    del results["checkpoint"]
    assert set(bench_train_fsdp2.verdicts(results)) == {"auto"}
    assert "checkpoint" not in bench_train_fsdp2.table(
        {c: {**r, "tokens_per_s_min": 1.0, "tokens_per_s_max": 2.0, "checkpoint_ms": 0.0} for c, r in results.items()},
        bench_train_fsdp2.verdicts(results))


@pytest.mark.slow
def test_bench_train_fsdp2_runs_on_the_cpu_with_gloo(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "fsdp2.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train_fsdp2.py"), "--device", "cpu",
                           "--quick", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"off", "auto", "checkpoint"}
    for config, r in data["results"].items():
        assert r["tokens_per_s"] > 0 and r["steps_timed"] == 3, (config, r)
    # Reported as a count (auto mode on the CPU may offload nothing: no lower bound to hold it to).
    assert isinstance(data["results"]["auto"]["offloaded_bytes"], int)
    assert set(data["verdicts"]) == {"auto", "checkpoint"}
    assert "checkpoint" in done.stdout and "vs off" in done.stdout


@pytest.mark.slow
def test_bench_runner_trainer_section_trains_with_and_without_the_callback(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from benchmarks import runner

    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "out"
    assert runner.main(["--quick", "--only", "trainer", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["sections"]["trainer"]["status"] == "ran"
    step, peak = data["rows"]
    assert step["unit"] == "ms" and step["offload"] > 0 and step["baseline"] > 0 and step["steps_timed"] == 3
    assert peak["unit"] == "GiB"
