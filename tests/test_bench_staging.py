"""The `staging` benchmark section's baseline runs (benchmarks/bench_staging.py) on the CPU: a
stager that fails when reused is measured fresh per save, its first save kept. Its speed is
not judged here: the figures come from `python -m benchmarks --only staging`."""

import pytest
import torch
from _bench_helpers import load_section


@pytest.fixture
def bench_staging(monkeypatch):
    return load_section(monkeypatch, "bench_staging")


class _OneShotStager:
    """Stages a copy once; its second stage() raises, as torch 2.11's DefaultStager does."""

    made = 0

    def __init__(self):
        type(self).made += 1
        self.used = False

    def stage(self, state):
        if self.used:
            raise KeyError("reused")
        self.used = True
        return {k: v.clone() for k, v in state["model"].items()}

    def close(self):
        pass


def _state():
    return {"model": {"w": torch.zeros(4)}}


def test_a_stager_failing_on_reuse_keeps_its_first_save_and_runs_the_rest_fresh(bench_staging):
    _OneShotStager.made = 0
    name, saves = bench_staging._baseline_saves("DefaultStager(x)", _OneShotStager, _state(), torch.device("cpu"))
    assert name == "DefaultStager(x) fresh per save (reuse raised KeyError)"
    assert saves.error is None
    assert len(saves.staged) == len(saves.blocked) == bench_staging.SLOW_SAVES
    # One stager for the reuse attempt's first save, then one per remaining save.
    assert _OneShotStager.made == 1 + (bench_staging.SLOW_SAVES - 1)
    assert all(ms > 0 for ms in saves.staged)


def test_a_run_that_fails_keeps_the_saves_before_the_failure(bench_staging):
    saves = bench_staging._run_saves(_OneShotStager, _state(), torch.device("cpu"), saves=5)
    assert saves.error == "KeyError: 'reused'"
    assert len(saves.staged) == 1


def test_a_stager_that_works_when_reused_runs_every_save(bench_staging):
    saves = bench_staging._run_saves(bench_staging._Naive, _state(), torch.device("cpu"), saves=4)
    assert saves.error is None and len(saves.staged) == 4
