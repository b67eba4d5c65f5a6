"""The ring of host buffer sets: a save takes the next free set; a set stays busy while a
reader holds its staged dict, a tensor or view of it or a storage object (never for the
copy backend's own references); a busy ring waits or raises; each set keeps its own record
of the addresses it was filled from."""

import gc
import threading

import pytest
import torch

import offload
from _staging_helpers import assert_same, snapshot

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_staging_ring_uses_next_set_then_raises_when_all_busy(backend, device):
    stager = offload.AsyncStager(ring_size=2, when_busy="raise")
    w = torch.zeros(256, device=device)
    held_first = stager.stage({"w": w})  # holding the future keeps set 0 busy, like an upload in progress
    w.fill_(1)
    held_second = stager.stage({"w": w})
    assert [r["set"] for r in stager.metrics()] == [0, 1]
    w.fill_(2)
    with pytest.raises(RuntimeError, match="all 2 host buffer sets are busy"):
        stager.stage({"w": w})
    assert torch.equal(held_first.result()["w"], torch.zeros(256))  # neither set was overwritten
    assert torch.equal(held_second.result()["w"], torch.ones(256))
    del held_first
    third = stager.stage({"w": w}).result()
    assert stager.metrics()[-1]["set"] == 0 and torch.equal(third["w"], torch.full((256,), 2.0))
    assert torch.equal(held_second.result()["w"], torch.ones(256))
    stager.close()


def test_staging_kept_tensor_or_view_keeps_set_busy(backend, device):
    stager = offload.AsyncStager(ring_size=1, when_busy="raise")
    w = torch.ones(32, device=device)
    kept = stager.stage({"w": w, "n": 1}).result()["w"]  # the dict is gone, one tensor of it is not
    with pytest.raises(RuntimeError, match="busy"):
        stager.stage({"w": w, "n": 2})
    part = kept[4:8]  # a new view of the host buffer, not the object handed out
    del kept
    gc.collect()
    if offload.staging.ring._use_count is not None:  # a private read: whether this torch counts storage users
        with pytest.raises(RuntimeError, match="busy"):
            stager.stage({"w": w, "n": 3})
    assert torch.equal(part, torch.ones(4))
    del part
    assert torch.equal(stager.stage({"w": w * 3, "n": 4}).result()["w"], torch.full((32,), 3.0))
    stager.close()


def test_staging_kept_storage_object_keeps_set_busy(backend, device):
    # A reader holding only the storage object of a staged tensor (tensor.untyped_storage(),
    # or the TypedStorage of tensor.storage()) still reads the host buffer.
    stager = offload.AsyncStager(ring_size=1, when_busy="raise")
    w = torch.ones(32, device=device)
    for take in (torch.Tensor.untyped_storage, torch.Tensor.storage):
        staged = stager.stage({"w": w}).result()
        storage = take(staged["w"])
        del staged
        gc.collect()
        with pytest.raises(RuntimeError, match="storage object of its host buffers"):
            stager.stage({"w": w * 7})
        untyped = storage if take is torch.Tensor.untyped_storage else storage._untyped_storage
        reread = torch.empty(0, dtype=torch.float32).set_(untyped, 0, (32,), (1,))
        assert torch.equal(reread, torch.ones(32))  # never overwritten under the reader
        del storage, untyped, reread
        assert torch.equal(stager.stage({"w": w * 3}).result()["w"], torch.full((32,), 3.0))
    stager.close()


def test_staging_busy_ignores_copy_backend_references(backend, device, monkeypatch):
    # A copy backend may hold the host destinations (and views of them) for a while
    # and drop them later, e.g. when a copy is observed complete, as the native
    # Transfer does. Neither its holding nor its letting go may change what the
    # stager calls busy: only readers of the staged dict count.
    held = []
    real_copy = offload.staging.stager.copy_to_host

    def holding_copy(tensors, **kwargs):
        handle = real_copy(tensors, **kwargs)  # fresh, or refilling out=<list or earlier handle>
        written = handle.tensors  # the host tensors the engine writes
        held.extend(written + [t.view(-1)[:1] for t in written if t.numel()])
        return handle

    monkeypatch.setattr(offload.staging.stager, "copy_to_host", holding_copy)
    stager = offload.AsyncStager(ring_size=1, when_busy="raise")
    w = torch.ones(32, device=device)
    part = stager.stage({"w": w}).result()["w"][4:8]  # a reader keeps a view
    held.clear()  # ... while the backend lets go of its references
    if offload.staging.ring._use_count is not None:  # a private read: whether this torch counts storage users
        with pytest.raises(RuntimeError, match="busy"):
            stager.stage({"w": w * 2})
    assert torch.equal(part, torch.ones(4))
    del part
    for step in range(3):  # the backend holds more and more references; no reader is left
        assert torch.equal(stager.stage({"w": w * step}).result()["w"], torch.full((32,), float(step)))
        held.extend([t.view(-1)[:2] for t in list(held)])
    stager.close()


def test_staging_waits_for_reader_to_release(backend, device):
    stager = offload.AsyncStager(ring_size=1, when_busy="wait", busy_timeout_s=30)
    w = torch.zeros(64, device=device)
    holder = [stager.stage({"w": w})]
    seen = []

    def reader():
        seen.append(holder[0].result()["w"].clone())
        holder.clear()  # the upload finished: its staged dict is released

    timer = threading.Timer(0.2, reader)
    timer.start()
    w.fill_(5)
    second = stager.stage({"w": w}).result()  # waits for the reader, then reuses set 0
    timer.join()
    assert torch.equal(seen[0], torch.zeros(64))
    assert torch.equal(second["w"], torch.full((64,), 5.0))
    assert stager.metrics()[-1]["waited_ms"] >= 50
    stager.close()


def test_staging_wait_times_out_with_clear_error(backend, device):
    stager = offload.AsyncStager(ring_size=1, busy_timeout_s=0.1)
    held = stager.stage({"w": torch.ones(8, device=device)})
    with pytest.raises(RuntimeError, match=r"waited 0 s for a free host buffer set"):
        stager.stage({"w": torch.ones(8, device=device)})
    del held
    stager.close()


def test_staging_ring_sets_keep_their_own_record_of_addresses(backend, device):
    """With two sets, a set refilled after the plan's addresses moved (on a save into the
    other set) is not checked against its own older record alone: a tied pair untied back
    onto the first set's old address is seen, and staged untied."""
    stager = offload.AsyncStager(ring_size=2)
    t_a, t_b = torch.full((4,), 1.0, device=device), torch.full((4,), 2.0, device=device)
    w = torch.ones(8, device=device)
    first = stager.stage({"a": t_a, "b": t_a, "w": w}).result()  # set 0
    second_state = {"a": t_b, "b": t_b, "w": w}
    second = stager.stage(second_state).result()  # set 1 (set 0 is held): tied again, at new addresses
    assert_same(second, snapshot(second_state))
    del first  # set 0 free, set 1 held
    third_state = {"a": t_a, "b": t_b, "w": w}  # untied: a back where set 0 saw it
    third = stager.stage(third_state).result()
    assert_same(third, snapshot(third_state))
    assert third["a"] is not third["b"]
    assert [m["set"] for m in stager.metrics()] == [0, 1, 0]
    del second, third
    stager.close()
