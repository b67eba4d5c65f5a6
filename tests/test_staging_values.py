"""What a save holds, bit for bit, and which host buffers hold it: tied tensors and views
kept as they are, buffers reused by later saves of a rebuilt state dict, small tensors
packed into one block and refilled, host tensors of an accelerator's state copied in one
call, and the staged dict made by the future from the leaves as of stage()."""

import pytest
import torch

import offload
from _staging_helpers import assert_same, rich_state, snapshot, tensors_in

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_staging_nested_tied_and_noncontiguous(backend, device):
    state = rich_state(device)
    expected = snapshot(state)
    with offload.AsyncStager() as stager:
        future = stager.stage(state)
        for t in (state["matrix"], state["tied_a"], state["gappy"], state["nested"]["tup"][0]):
            t.fill_(-9)  # after stage(): the host copy must not see it (the CPU copy is synchronous)
        staged = future.result()
        assert_same(staged, expected)
        assert all(t.device.type == "cpu" for t in tensors_in(staged))
        assert staged["tied_a"] is staged["tied_b"]
        assert staged["rows"].untyped_storage().data_ptr() == staged["matrix"].untyped_storage().data_ptr()
        assert staged["transposed"].untyped_storage().data_ptr() == staged["matrix"].untyped_storage().data_ptr()
        assert staged["transposed"].stride() == (1, 8)
        assert isinstance(staged["nested"]["lst"][4], tuple)


def test_staging_reuses_buffers_of_rebuilt_state_dict(backend, device):
    stager = offload.AsyncStager(ring_size=1)
    pointers = None
    for step in range(4):
        state = {"w": torch.full((64, 64), float(step), device=device), "b": torch.arange(8, device=device) + step,
                 "step": step}
        staged = stager.stage(state).result()
        assert_same(staged, snapshot(state))
        now = [staged["w"].data_ptr(), staged["b"].data_ptr()]
        assert pointers is None or now == pointers  # same host buffers, though the storages are new
        pointers = now
        del staged
    records = stager.metrics()
    assert [r["buffers_allocated"] for r in records] == [2, 0, 0, 0]
    assert [r["buffers_reused"] for r in records] == [0, 2, 2, 2]
    assert records[0]["bytes"] == 64 * 64 * 4 + 8 * 8
    # blocked_ms: the time inside stage() (16 KiB here: well under a second)
    assert all(r["copy_ms"] is not None and 0 < r["blocked_ms"] < 1000 and r["tensors"] == 2 for r in records)
    stager.close()


def _host_blocks(staged):
    return {t.untyped_storage().data_ptr() for t in tensors_in(staged) if t.numel()}


def test_staging_small_tensors_packed_and_refilled(backend, device):
    # Saves 2+ refill the buffers of the first (its CopyHandle passed back as out=):
    # same host memory, new values; the native core packs them all into one block.
    stager = offload.AsyncStager(ring_size=1)
    tensors = {f"t{i}": torch.randn(37 + i % 5, device=device) for i in range(300)}
    staged = stager.stage(tensors).result()
    assert_same(staged, snapshot(tensors))
    pointers = [t.data_ptr() for t in tensors_in(staged)]
    if backend == "native":
        assert len(_host_blocks(staged)) == 1
    del staged
    for step in range(3):
        for t in tensors.values():
            t.add_(1)
        staged = stager.stage(tensors).result()
        assert_same(staged, snapshot(tensors))
        assert [t.data_ptr() for t in tensors_in(staged)] == pointers
        del staged
    assert [r["buffers_allocated"] for r in stager.metrics()] == [300, 0, 0, 0]
    # A structure change that breaks the packed part: many small survivors are packed afresh.
    changed = dict(tensors, extra=torch.ones(3, device=device))
    del changed["t0"]
    staged = stager.stage(changed).result()
    assert_same(staged, snapshot(changed))
    if backend == "native":
        assert len(_host_blocks(staged)) == 1
    assert stager.metrics()[-1]["buffers_allocated"] == 300
    stager.close()


def test_staging_host_tensors_of_accelerator_state_copied_in_one_call(backend, device, monkeypatch):
    """CPU tensors in an accelerator's state dict (AdamW's `step` scalars) are copied
    by one torch._foreach_copy_ per save, and no per-tensor layout check runs for them;
    a host source that changes dtype, shape or layout is still staged bit for bit."""
    if device.type == "cpu":  # no accelerator: let the CPU tensors stand for the host side of one
        monkeypatch.setattr(offload.core._device, "compute_device_type", lambda: "cuda")
    calls = []
    real = torch._foreach_copy_

    def counting(dsts, sources):
        calls.append(len(sources))
        return real(dsts, sources)

    # torch's own function, counted where the stager calls it: no seam reports a save's host copy calls.
    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    n = 40
    steps = {i: {"step": torch.tensor(float(i))} for i in range(n)}
    state = {"model": {"w": torch.randn(8, device=device)}, "optim": {"state": steps}}
    host = 1 + n if device.type == "cpu" else n
    stager = offload.AsyncStager(ring_size=1)
    for save in range(5):
        for entry in steps.values():
            entry["step"].add_(1)
        calls.clear()
        assert_same(stager.stage(state).result(), snapshot(state))
        assert calls == [host], calls  # fresh on the first save, refilled after: one call each
    assert [r["replanned"] for r in stager.metrics()] == [True] + [False] * 4
    # The copy itself checks the host sources (a private read: what a save compares itself is unreported).
    assert stager._plan.watched_slots == []
    base = torch.arange(9.0).view(3, 3)
    changes = [
        lambda: steps[3].__setitem__("step", torch.tensor(7.0, dtype=torch.float64)),  # dtype
        lambda: steps[5].__setitem__("step", torch.arange(4.0)),  # shape
        lambda: steps[6].__setitem__("step", base),
        lambda: steps[6].__setitem__("step", base.t()),  # same pointer, shape and dtype; other strides
    ]
    for change in changes:
        change()
        assert_same(stager.stage(state).result(), snapshot(state))
    stager.close()
    with pytest.raises(ValueError, match=r"host source 1 changed to \(2,\) torch.float32"):
        offload.staging.host_copy.copy_on_host([torch.ones(()), torch.ones(2)], out=[torch.ones(()), torch.ones(3)])


def test_staging_future_makes_dict_from_leaves_as_of_stage(backend, device):
    # The staged dict is made by the future's first result(), not inside stage():
    # it must still hold the non-tensor leaves as they were at stage(), keep tied
    # tensors tied, be made once, reach done-callbacks, and keep the set busy
    # while the future is unresolved.
    stager = offload.AsyncStager(ring_size=1, when_busy="raise")
    w = torch.arange(16, dtype=torch.float32, device=device)
    wide = {f"k{i}": (torch.full((2,), float(i), device=device) if i % 3 else i) for i in range(12)}
    for step in range(4):  # from the third save on, the generated code of the tree runs
        state = {"w": w, "tied": [w, w], "meta": {"step": step, "name": f"s{step}"}, "wide": dict(wide)}
        expected = snapshot(state)
        future = stager.stage(state)
        with pytest.raises(RuntimeError, match="busy"):  # nothing built yet, the set is still held
            stager.stage(state)
        state["meta"]["step"], state["meta"]["name"], state["wide"]["k0"] = -1, "changed", -1
        got = []
        future.add_done_callback(lambda f: got.append(f.result()))
        staged = future.result()
        assert future.result() is staged and got and got[0] is staged
        assert_same(staged, expected)
        assert staged["tied"][0] is staged["tied"][1] is staged["w"]
        del staged, got, future
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False, False]
    stager.close()
