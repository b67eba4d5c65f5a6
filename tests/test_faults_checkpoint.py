"""DCP saves staged by offload.AsyncStager under faults: a storage writer that raises mid-write,
and a process killed (SIGKILL) during an async save.

What offload promises (docs/reliability.md): a writer's error reaches the save's future, the
staged buffers go back to the stager (its next save works, the pool's bytes return to where they
were), and a checkpoint that completed before (each save in a directory of its own) still loads
bitwise. DCP writes a checkpoint's data files in place and its `.metadata` last, so a directory
whose save died is incomplete; offload makes no promise about that directory.
"""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import offload

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(256, 128, generator=gen), "b": torch.randn(128, generator=gen).to(torch.bfloat16)},
        "optim": {"m": torch.randn(256, 128, generator=gen), "n": torch.randint(0, 9, (77,), generator=gen)},
        "step": step,
    }


def _zeros(state: dict) -> dict:
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else -1


def _assert_same(got, want, path="state"):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), path
    else:
        assert got == want, path


class _FailingWriter(FileSystemWriter):
    """Writes the data files, then raises before DCP can write `.metadata`: a save that dies
    mid-write (a full disk, a lost mount)."""

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()  # the data files are on disk
        raise OSError("injected: the storage went away mid-write")


def _save(state, path, stager, writer=None):
    response = dcp.async_save(state, checkpoint_id=str(path), async_stager=stager, storage_writer=writer)
    return getattr(response, "upload_completion", response)


@pytest.mark.parametrize("backend_name", ["native", "fallback"])
def test_faults_dcp_writer_raises_mid_write(tmp_path, backend_name):
    from offload.core import _backend

    if backend_name == "native" and not _backend.native_available():
        pytest.skip(f"needs the compiled core: {_backend.why_not()}")
    import contextlib

    with _backend.force_fallback() if backend_name == "fallback" else contextlib.nullcontext():
        pool = offload.HostPool()
        baseline = pool.stats()["in_use_bytes"]
        # One buffer set, and no waiting: a set still held by the failed save makes the next raise.
        stager = offload.AsyncStager(ring_size=1, pool=pool, when_busy="raise")
        _save(_state(0), tmp_path / "ckpt0", stager).result(timeout=120)
        held = stager.host_bytes()

        failing = _save(_state(1), tmp_path / "ckpt1", stager, _FailingWriter(str(tmp_path / "ckpt1")))
        # DCP wraps what the writer raised, per rank.
        with pytest.raises(CheckpointException) as info:
            failing.result(timeout=120)
        (error, _), = info.value.failures.values()
        assert isinstance(error, OSError) and "injected: the storage went away" in str(error)
        del info, error
        assert not (tmp_path / "ckpt1" / ".metadata").exists()
        del failing
        gc.collect()

        # The buffers came back: the next save takes the same set, bit for bit.
        _save(_state(2), tmp_path / "ckpt2", stager).result(timeout=120)
        assert stager.host_bytes() == held
        for step in (0, 2):
            target = _zeros(_state(step))
            dcp.load(target, checkpoint_id=str(tmp_path / f"ckpt{step}"))
            _assert_same(target, _state(step))
        with pytest.raises(CheckpointException):  # the failed one is incomplete: DCP refuses it
            dcp.load(_zeros(_state(1)), checkpoint_id=str(tmp_path / "ckpt1"))
        stager.close()
        gc.collect()
        assert pool.stats()["in_use_bytes"] == baseline


_SAVER = textwrap.dedent("""
    import os, sys, time, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    sys.path.insert(0, {tests!r})
    from test_faults_checkpoint import _big_state
    import offload

    root = {root!r}
    torch.set_num_threads(1)
    stager = offload.AsyncStager()
    step = 0
    while True:  # until killed
        open(os.path.join(root, f"started-{{step}}"), "w").close()
        response = dcp.async_save(_big_state(step), checkpoint_id=os.path.join(root, f"ckpt{{step}}"),
                                  async_stager=stager)
        getattr(response, "upload_completion", response).result()
        open(os.path.join(root, f"complete-{{step}}"), "w").close()
        step += 1
""")


def _big_state(step: int) -> dict:
    """Large enough that a save takes a while to write, so the kill lands inside one."""
    state = _state(step)
    state["model"]["big"] = torch.full((2048, 1024), float(step)) + torch.arange(1024)
    return state


def test_faults_sigkill_during_async_save_previous_checkpoint_loads(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _SAVER.format(tests=tests, root=str(root))], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        # Two complete checkpoints, then kill while the next is being saved.
        while not ((root / "complete-1").exists() and (root / "started-2").exists()):
            assert child.poll() is None, child.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the saver made no progress"
            time.sleep(0.01)
        time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    complete = sorted(int(p.name.split("-")[1]) for p in root.glob("complete-*"))
    started = sorted(int(p.name.split("-")[1]) for p in root.glob("started-*"))
    last = complete[-1]
    # Every checkpoint whose future completed loads bitwise, the last one before the kill included.
    for step in complete:
        target = _zeros(_big_state(step))
        dcp.load(target, checkpoint_id=str(root / f"ckpt{step}"))
        _assert_same(target, _big_state(step))
    # The save the kill interrupted is either incomplete (DCP refuses it) or, if it finished
    # before its marker was written, exact: never a checkpoint that loads different values.
    for step in started:
        if step > last:
            target = _zeros(_big_state(step))
            try:
                dcp.load(target, checkpoint_id=str(root / f"ckpt{step}"))
            except CheckpointException:  # a BaseException
                continue
            _assert_same(target, _big_state(step))
