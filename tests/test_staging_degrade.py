"""offload.AsyncStager past limit_bytes: the part that does not fit the pooled (pinned)
buffers is staged to pageable host memory, slower but bit for bit, with one warning."""

import gc
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import offload
from _staging_helpers import assert_same, snapshot, tensors_in

KiB = 1 << 10

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(device, scale=1):
    """About 600 KiB * scale of tensors, of several dtypes and layouts: a 2-D weight,
    a non-contiguous view, tied tensors, a broadcast, a small int and an empty one."""
    torch.manual_seed(0)
    weight = torch.randn(256 * scale, 256, device=device)
    tied = torch.randn(64 * scale, 64, device=device)
    return {
        "model": {
            "weight": weight,
            "weight_t": torch.randn(128 * scale, 64, device=device).t(),  # non-contiguous
            "half": torch.randn(128 * scale, 128, device=device).to(torch.bfloat16),
            "tied_a": tied,
            "tied_b": tied,
            "broadcast": torch.randn(1, 32, device=device).expand(16, 32),
            "count": torch.arange(7, device=device, dtype=torch.int64),
            "empty": torch.empty(0, 3, device=device),
        },
        "step": 3,
    }


def _change(state):
    """Change every tensor of `state` once (tied ones once, broadcasts through their one row)."""
    seen = set()
    for t in tensors_in(state):
        if t.data_ptr() in seen or not t.numel():
            continue
        seen.add(t.data_ptr())
        if 0 in t.stride():
            t = t[:1]
        t.add_(1)


def _tensor_bytes(state) -> int:
    seen, total = set(), 0
    for t in tensors_in(state):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _stage_recording(stager, state):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        staged = stager.stage(state)
        staged = staged.result() if hasattr(staged, "result") else staged
    return staged, [w for w in caught if "pageable host memory" in str(w.message)]


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7])
def test_staging_degrade_stages_past_the_limit_bit_exact(backend, device, fraction):
    """A state dict larger than limit_bytes (or a limit of a single byte) stages, equal to
    the state as of the call, with the pooled bytes within the limit and the rest pageable."""
    pool = offload.HostPool()
    state = _state(device)
    total = _tensor_bytes(state)
    limit = max(1, int(total * fraction))
    stager = offload.AsyncStager(pool=pool, limit_bytes=limit)
    expected = snapshot(state)
    staged, warned = _stage_recording(stager, state)
    _change(state)  # after the call: not in the staged copy
    assert_same(staged, expected)
    assert len(warned) == 1
    assert stager.host_bytes() <= limit and pool.stats()["in_use_bytes"] <= limit
    assert stager.pageable_bytes() > 0
    record = stager.metrics()[-1]
    assert record["pageable_bytes"] > 0 and record["host_bytes"] == stager.host_bytes()
    # Tied tensors stay one tensor in the staged dict, whichever memory holds them.
    assert staged["model"]["tied_a"].data_ptr() == staged["model"]["tied_b"].data_ptr()
    del staged
    stager.close()
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0


def test_staging_degrade_warns_once_per_stager(backend, device):
    """Saves after the first reuse their pageable buffers without a new warning, also for
    a new structure; another stager warns again. Each save holds its own values."""
    pool = offload.HostPool()
    state = _state(device)
    limit = _tensor_bytes(state) // 3
    stager = offload.AsyncStager(pool=pool, limit_bytes=limit)
    counts = []
    for step in range(4):
        _change(state)
        expected = snapshot(state)
        staged, warned = _stage_recording(stager, state)
        assert_same(staged, expected)
        counts.append(len(warned))
        assert stager.host_bytes() <= limit
        del staged
    renamed = {"renamed": state["model"], "step": 4}
    staged, warned = _stage_recording(stager, renamed)
    assert_same(staged, snapshot(renamed))
    counts.append(len(warned))
    assert counts == [1, 0, 0, 0, 0]
    assert [r["buffers_allocated"] for r in stager.metrics()][1:4] == [0, 0, 0]  # refilled, pageable ones too
    del staged
    stager.close()
    other = offload.AsyncStager(pool=pool, limit_bytes=limit)
    staged, warned = _stage_recording(other, state)
    assert len(warned) == 1
    message = str(warned[0].message)
    assert message.startswith("offload.AsyncStager.stage: ")
    assert f"limit_bytes={limit}" in message and f"{other.pageable_bytes()} bytes" in message
    del staged
    other.close()


def test_staging_degrade_no_warning_when_it_fits(backend, device):
    state = _state(device)
    stager = offload.AsyncStager(limit_bytes=4 * _tensor_bytes(state))
    staged, warned = _stage_recording(stager, state)
    assert_same(staged, snapshot(state))
    assert warned == [] and stager.pageable_bytes() == 0 and stager.metrics()[-1]["pageable_bytes"] == 0
    del staged
    stager.close()


def test_staging_degrade_forward_buffers_stay_pooled(backend, device):
    """Forward buffers are placed first, so they keep pooled buffers when the rest does not fit."""
    state = _state(device)
    state["model"]["running_mean"] = torch.randn(64, device=device)
    stager = offload.AsyncStager(limit_bytes=4 * KiB, forward_buffers=["model.running_mean"])
    staged, warned = _stage_recording(stager, state)
    assert_same(staged, snapshot(state))
    assert len(warned) == 1 and 0 < stager.host_bytes() <= 4 * KiB
    del staged
    stager.close()


def test_staging_degrade_second_set_refit_while_the_first_is_read(backend, device):
    """ring_size=2: set 1 is read while set 0 is fitted to a new structure that, beside it,
    passes the limit. The new save stages with fewer pooled bytes instead of failing."""
    pool = offload.HostPool()
    state = _state(device)
    per_set = offload.AsyncStager(pool=pool)
    probe = per_set.stage(state).result()
    held = per_set.host_bytes()
    del probe
    per_set.close()
    limit = 2 * held + held // 2
    stager = offload.AsyncStager(pool=pool, limit_bytes=limit, ring_size=2, when_busy="raise")
    first = stager.stage(state).result()
    second = stager.stage(state).result()  # set 1: set 0 is still read
    assert [r["set"] for r in stager.metrics()] == [0, 1]
    del first  # set 0 free, set 1 read
    bigger = _state(device, scale=2)
    staged, warned = _stage_recording(stager, bigger)
    assert_same(staged, snapshot(bigger))
    assert_same(second, snapshot(state))
    assert len(warned) == 1 and stager.host_bytes() <= limit
    assert pool.stats()["in_use_bytes"] <= limit
    del staged, second
    stager.close()


def test_staging_degrade_dcp_round_trip(tmp_path, backend, device):
    """dcp.async_save through a stager whose limit the state dict passes, then dcp.load: bitwise."""
    state = _state(device)
    del state["model"]["broadcast"]  # DCP's own writer is not what this test is about
    limit = _tensor_bytes(state) // 2
    stager = offload.AsyncStager(limit_bytes=limit)
    for step in range(2):
        expected = snapshot(state)
        with pytest.warns(UserWarning, match="pageable host memory") if step == 0 else warnings.catch_warnings():
            response = dcp.async_save(state, checkpoint_id=str(tmp_path / f"ckpt{step}"), async_stager=stager)
        _change(state)
        getattr(response, "upload_completion", response).result(timeout=120)
        target = snapshot(state)
        for t in tensors_in(target):
            t.zero_()
        dcp.load(target, checkpoint_id=str(tmp_path / f"ckpt{step}"))
        assert_same(target, expected)
        assert stager.host_bytes() <= limit
    stager.close()
