"""Fixtures and markers shared by every test.

Markers skip with a reason that names what is missing: `cuda`, `npu`, `multi_gpu`
(two or more accelerators), `native` (the compiled core), `slow`, and
`not_standin("why")` for what the npu stand-in cannot show (no pinned memory, no
asynchronous streams, no second process).

OFFLOAD_TEST_DEVICE=npu runs the suite on the npu stand-in (tests/npu_standin): it is
built and registered as torch's "npu" device before offload is imported, so offload
takes its NPU path and the `device` fixture gives npu:0.

OFFLOAD_TEST_TIMES=FILE appends one line per test to FILE as it ends (total, setup, call
and teardown seconds, outcome, node id), and a `running` line as it starts, each flushed
at once: a run killed at a time limit still says where its time went and what it was in.
"""

import os

import pytest
import torch

STANDIN = os.environ.get("OFFLOAD_TEST_DEVICE", "") == "npu"
if STANDIN:
    import npu_standin  # tests/ is on sys.path for its conftest

    npu_standin.install()
elif os.environ.get("OFFLOAD_TEST_DEVICE", "") not in ("", "default"):
    raise pytest.UsageError(f"OFFLOAD_TEST_DEVICE must be 'npu' or unset, got {os.environ['OFFLOAD_TEST_DEVICE']!r}")

from offload.core import _backend, _device  # noqa: E402  (after the stand-in registers "npu")


def _accelerator_count() -> int:
    kind = _device.accelerator_type()
    return 0 if kind is None else _device._module(kind).device_count()


def pytest_collection_modifyitems(config, items):
    kind = _device.accelerator_type()
    reasons = {
        "cuda": None if kind == "cuda" else "needs a CUDA GPU (torch sees none)",
        "npu": None if kind == "npu" and not STANDIN else "needs an Ascend NPU with torch_npu",
        "multi_gpu": None if _accelerator_count() >= 2 else f"needs 2+ accelerators, found {_accelerator_count()}",
        "native": None if _backend.native_available() else f"needs the compiled core: {_backend.why_not()}",
    }
    for item in items:
        for marker, reason in reasons.items():
            if reason is not None and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
        standin = item.get_closest_marker("not_standin")
        if STANDIN and standin is not None:
            item.add_marker(pytest.mark.skip(reason=f"not on the npu stand-in: {standin.args[0]}"))


_TIMES = os.environ.get("OFFLOAD_TEST_TIMES", "")
_phases: dict = {}


def pytest_configure(config):
    global _TIMES
    # Under pytest-xdist each worker writes its own tests' lines; the controller, which sees
    # the same reports relayed, writes none (each test would be logged twice).
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        _TIMES = ""


def _log_time(line: str) -> None:
    # Opened per line: each line reaches the file before the next test starts.
    with open(_TIMES, "a") as f:
        f.write(line + "\n")


def pytest_runtest_logstart(nodeid, location):
    if _TIMES:
        _log_time(f"{'-':>8} {'-':>7} {'-':>7} {'-':>7} running {nodeid}")


def pytest_runtest_logreport(report):
    if not _TIMES:
        return
    phases = _phases.setdefault(report.nodeid, {})
    phases[report.when] = report
    if report.when != "teardown":
        return
    del _phases[report.nodeid]
    seconds = [phases[w].duration if w in phases else 0.0 for w in ("setup", "call", "teardown")]
    outcome = next((r.outcome for r in phases.values() if not r.passed), "passed")
    _log_time(f"{sum(seconds):8.2f} {seconds[0]:7.2f} {seconds[1]:7.2f} {seconds[2]:7.2f} {outcome} {report.nodeid}")


@pytest.fixture
def device() -> torch.device:
    """The compute device: the accelerator when there is one, else the CPU."""
    return _device.current_device()


@pytest.fixture(params=["native", "fallback"])
def backend(request):
    """Runs a test once on the compiled core and once on the pure-PyTorch path."""
    if request.param == "native":
        if not _backend.native_available():
            pytest.skip(f"needs the compiled core: {_backend.why_not()}")
        yield "native"
    else:
        with _backend.force_fallback():
            yield "fallback"


@pytest.fixture
def deterministic(monkeypatch):
    """Bitwise gradients on an accelerator need its deterministic kernels (and cuBLAS's fixed
    workspace); the CPU's kernels are deterministic already. The previous setting comes back."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)
