"""The `host` benchmark section (benchmarks/bench_host.py) on the CPU in quick mode: its rows
say what they measure against the no-handle baseline, with positive times. Its speed is not
judged here: the figures come from `python -m benchmarks --only host`."""

import time

import pytest
import torch
from _bench_helpers import load_section


@pytest.fixture
def bench_host(monkeypatch):
    return load_section(monkeypatch, "bench_host")


def test_bench_host_alternates_the_variants_round_by_round(bench_host):
    ran = []

    class Clock:
        now = 0.0

        def mark(self):
            return self.now

        def spans_ms(self, marks):
            return [b - a for a, b in zip(marks, marks[1:])]

    clock = Clock()

    def step_of(name, ms, host_seconds=0.0):
        def step():
            ran.append(name)
            clock.now += ms
            time.sleep(host_seconds)

        return step

    variants = [bench_host.Variant("a", step_of("a", 1.0)), bench_host.Variant("b", step_of("b", 3.0, 0.005))]
    timed = bench_host.alternate(variants, rounds=3, block=2, clock=clock)
    # one untimed step first, then blocks of 2 steps: a b, b a, a b
    assert ran == ["b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]
    assert timed["a"].median_ms == 1.0 and timed["b"].median_ms == 3.0
    assert timed["a"].steps == 6 and timed["a"].round_medians_ms == [1.0, 1.0, 1.0]
    # the host's own time per step, apart from the clock's: b's call sleeps 5 ms, a's does not
    assert timed["b"].host_median_ms >= 5.0 > timed["a"].host_median_ms


def test_bench_host_times_each_variant_on_the_host_alone_from_an_idle_device(bench_host):
    # host_alone: per variant, steps back to back after a device sync, each timed on the host; the
    # device is synchronized before each variant's steps and once after the last.
    events = []

    def step_of(name, host_seconds):
        def step():
            events.append(name)
            time.sleep(host_seconds)

        return step

    variants = [bench_host.Variant("a", step_of("a", 0.0)), bench_host.Variant("b", step_of("b", 0.004))]
    alone = bench_host.host_alone(variants, steps=3, synchronize=lambda: events.append("sync"))
    assert events == ["sync", "a", "a", "a", "sync", "b", "b", "b", "sync"]
    assert set(alone) == {"a", "b"}
    assert alone["b"] >= 4.0 > alone["a"]


def test_bench_host_section_runs_on_the_cpu_in_quick_mode(bench_host, capsys):
    import common

    threads = torch.get_num_threads()
    ctx = common.Context(device=torch.device("cpu"), quick=True, progress=lambda message: None)
    rows = bench_host.run(ctx)
    assert torch.get_num_threads() == threads  # one thread while it measures, restored after
    assert ctx.skipped == []
    steps = {r["variant"]: r for r in rows if r["unit"] == "us" and r["baseline"] is not None}
    assert set(steps) == {"hooks", "async", "paused", "auto", "verify"}
    for variant, r in steps.items():
        for key in ("section", "case", "offload", "baseline", "baseline_name", "unit", "ratio", "layers_offloaded",
                    "steps_timed", "spread_pct"):
            assert key in r, (variant, key)
        assert r["section"] == "host" and r["baseline_name"].startswith("no handle")
        assert r["offload"] > 0 and r["baseline"] > 0 and r["ratio"] > 0
        assert r["steps_timed"] > 0
    assert steps["async"]["layers_offloaded"] == steps["verify"]["layers_offloaded"] == 8  # every layer, the last too
    assert steps["async"]["target_ratio"] == 1.25 and steps["paused"]["target_ratio"] == 1.01
    assert isinstance(steps["async"]["target_met"], bool)
    per_layer = [r for r in rows if "per offloaded layer" in r["case"]]
    assert len(per_layer) == 1 and per_layer[0]["baseline"] is None
    assert per_layer[0]["offload"] == pytest.approx(
        (steps["async"]["offload"] - steps["async"]["baseline"]) / 8)
    assert "host time per offloaded layer" in rows[-1]["case"]
    assert steps["hooks"]["layers_offloaded"] is None  # no handle: autograd's hooks alone
    floor = [r for r in rows if "hooks alone add" in r["case"]]
    assert len(floor) == 1
    assert floor[0]["offload"] == pytest.approx(steps["hooks"]["offload"] - steps["hooks"]["baseline"])
    assert "target" in capsys.readouterr().out  # the printed table states the targets


def test_bench_host_engine_rows_read_the_engine_host_time_on_the_host_alone(bench_host, monkeypatch, capsys):
    # The engine's host time per step: async on every layer against the same model with no
    # handle, each timed on the host alone in rounds of alternating order; the row is their
    # medians' difference, judged against the target in ms. Here on the CPU (whose engine
    # offloads CPU tensors), the tiny stack standing in for the Llama and the Qwen2.
    import common

    torch.manual_seed(0)
    model = bench_host.TinyStack(bench_host.CPU_LAYERS, bench_host.CPU_WIDTH)
    x = torch.randn(*bench_host.CPU_INPUT)
    monkeypatch.setattr(bench_host, "_engine_models", lambda ctx: [("tiny, one thread", lambda: (
        model, lambda m: m(x).square().mean()))])
    monkeypatch.setattr(bench_host, "ENGINE_ROUNDS", 2)
    ctx = common.Context(device=torch.device("cpu"), quick=True, progress=lambda message: None)
    from offload.activation import engine

    monkeypatch.setattr(engine, "DEFAULT_MIN_TENSOR_BYTES", bench_host.ENGINE_SHRINK)  # every tensor of the stack
    rows = bench_host._engine_host_rows(ctx)
    assert ctx.skipped == [] and len(rows) == 1
    r = rows[0]
    assert r["section"] == "host" and r["unit"] == "ms" and r["baseline"] is None
    assert r["layers_offloaded"] == bench_host.CPU_LAYERS and r["tensors_offloaded"] > 0 and r["groups_offloaded"] > 0
    assert len(r["round_host_alone_ms"]) == len(r["baseline_round_host_alone_ms"]) == 2
    assert len(r["hooks_round_host_alone_ms"]) == 2 and r["hooks_host_alone_ms"] > 0
    assert r["offload"] == pytest.approx(r["host_alone_ms"] - r["baseline_host_alone_ms"])
    assert r["target_met"] == (r["offload"] <= bench_host.ENGINE_TARGET_MS) and "0.3 ms" in r["target"]
    assert "the engine's" in capsys.readouterr().out
