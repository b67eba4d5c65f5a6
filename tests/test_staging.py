"""offload.AsyncStager: DCP async checkpoint staging into reused host buffer sets."""

import collections
import gc
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import offload
from offload.core import _device

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _snapshot(obj):
    """A deep copy of a nested state dict, tensors cloned (the expected staged values)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_snapshot(v) for v in obj]
        return type(obj)(*items) if hasattr(type(obj), "_fields") else type(obj)(items)
    return obj


def _assert_same(actual, expected, path="sd"):
    """Bitwise equality of nested state dicts; tensors compared as raw bytes on the host."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, path
        assert torch.equal(actual.cpu().contiguous().view(-1).view(torch.uint8),
                           expected.cpu().contiguous().view(-1).view(torch.uint8)), path
        return
    if isinstance(expected, dict):
        assert set(actual) == set(expected), path
        for k in expected:
            _assert_same(actual[k], expected[k], f"{path}[{k!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{path}[{i}]")
        return
    assert actual == expected, path


def _model(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
    ).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, optimizer, device):
    model(torch.randn(4, 16, device=device)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_staging_dcp_ten_saves_bit_exact(tmp_path, backend, device):
    model, optimizer = _model(device)
    _train_step(model, optimizer, device)
    stager = offload.AsyncStager()
    expected, responses = [], []
    for step in range(10):
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": {"step": step, "tag": "run"}}
        expected.append(_snapshot(state))
        responses.append(dcp.async_save(state, checkpoint_id=str(tmp_path / f"ckpt{step}"), async_stager=stager))
        _train_step(model, optimizer, device)  # change every tensor before the upload finishes
    for response in responses:
        upload = getattr(response, "upload_completion", response)
        upload.result()
    stager.close()
    for step in range(10):
        fresh_model, fresh_optimizer = _model(device)
        _train_step(fresh_model, fresh_optimizer, device)
        _train_step(fresh_model, fresh_optimizer, device)
        target = {
            "model": fresh_model.state_dict(),
            "optim": fresh_optimizer.state_dict(),
            "extra": {"step": -1, "tag": ""},
        }
        dcp.load(target, checkpoint_id=str(tmp_path / f"ckpt{step}"))
        _assert_same(target, expected[step])


def test_staging_dcp_async_save_response(tmp_path, backend, device):
    """With a torch whose async_save takes a future from stage(), the stager gets the
    AsyncSaveResponse form: staging_completion and upload_completion both complete,
    and DCP is not asked to block on staging after starting the upload."""
    from torch.distributed.checkpoint import state_dict_saver

    if not hasattr(state_dict_saver, "AsyncSaveResponse"):
        pytest.skip(f"torch {torch.__version__} has no AsyncSaveResponse (torch >= 2.9)")
    stager = offload.AsyncStager()
    assert stager.should_synchronize_after_execute is False
    state = {"model": {"w": torch.randn(64, 3, device=device), "b": torch.randn(3, device=device)}, "step": 7}
    expected = _snapshot(state)
    response = dcp.async_save(state, checkpoint_id=str(tmp_path / "ckpt"), async_stager=stager)
    assert isinstance(response, state_dict_saver.AsyncSaveResponse)
    state["model"]["w"].add_(1)  # after the call: not in the checkpoint
    response.upload_completion.result(timeout=120)  # raises what the upload raised
    assert response.staging_completion.result(timeout=120) is None
    assert response.staging_completion.done() and response.upload_completion.done()
    stager.close()
    target = {"model": {"w": torch.zeros(64, 3, device=device), "b": torch.zeros(3, device=device)}, "step": 7}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    _assert_same(target, expected)


def _dcp_round_trip(stager, state, checkpoint_id, target):
    """dcp.async_save `state` through `stager`, change every tensor of it before the
    upload finishes, dcp.load into `target` and compare bit for bit with the state as saved."""
    expected = _snapshot(state)
    response = dcp.async_save(state, checkpoint_id=str(checkpoint_id), async_stager=stager)
    for t in _tensors(state):
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point() and t.element_size() == 1:  # fp8: no arithmetic, its bytes change
            t.view(torch.uint8).add_(1)
        else:
            t.add_(1)
    getattr(response, "upload_completion", response).result(timeout=120)
    dcp.load(target, checkpoint_id=str(checkpoint_id))
    _assert_same(target, expected)
    return target


def test_staging_dcp_nested_and_tied_round_trip(tmp_path, backend, device):
    stager = offload.AsyncStager()
    for save in range(3):  # the first save plans, the later ones reuse the plan and buffers
        torch.manual_seed(save)
        state = _rich_state(device)
        target = _rich_state(device)
        target["tied_b"] = target["tied_a"].clone()  # untied: each key is read from its own checkpoint entry
        for t in _tensors(target):
            t.zero_()
        _dcp_round_trip(stager, state, tmp_path / f"rich{save}", target)
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False]
    stager.close()


def test_staging_dcp_structure_change_round_trip(tmp_path, backend, device):
    def state(layers, with_optim):
        model = {f"layer{i}.weight": torch.randn(4, i + 2, device=device) for i in range(layers)}
        out = {"model": model, "meta": {"layers": layers}}
        if with_optim:
            steps = {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(4, i + 2, device=device)}
                     for i in range(layers)}
            out["optim"] = {"state": steps, "param_groups": [{"lr": 0.1, "params": list(range(layers))}]}
        return out

    def zeros_like_state(s):
        if isinstance(s, torch.Tensor):
            return torch.zeros_like(s)
        if isinstance(s, dict):
            return {k: zeros_like_state(v) for k, v in s.items()}
        if isinstance(s, list):
            return [zeros_like_state(v) for v in s]
        return s

    stager = offload.AsyncStager()
    shapes = [(3, False), (3, True), (5, True), (3, False)]  # optimizer state appears, the model grows, back
    for number, (layers, with_optim) in enumerate(shapes):
        torch.manual_seed(number)
        s = state(layers, with_optim)
        _dcp_round_trip(stager, s, tmp_path / f"s{number}", zeros_like_state(s))
    assert [r["replanned"] for r in stager.metrics()] == [True, True, True, True]
    stager.close()


def _rich_state(device):
    base = torch.arange(64, dtype=torch.float32, device=device).view(8, 8)
    tied = torch.randn(5, 3, device=device)
    return {
        "tied_a": tied,
        "tied_b": tied,
        "matrix": base,
        "rows": base[2:5],  # overlaps `matrix`
        "transposed": base.t(),  # same memory, other layout
        "gappy": torch.randn(6, 10, device=device)[:, ::3],  # not dense
        "empty": torch.empty(0, 4, device=device),
        "scalar": torch.tensor(3.5, device=device),
        "dtypes": [torch.randn(7, device=device).to(dt) for dt in (torch.bfloat16, torch.float16, torch.float64)]
        + [torch.randint(-5, 5, (9,), device=device), torch.rand(11, device=device) > 0.5],
        "fp8": torch.randn(13, device=device).to(torch.float8_e4m3fn) if hasattr(torch, "float8_e4m3fn") else None,
        "nested": collections.OrderedDict(
            lst=[1, 2.5, "s", None, (True, b"x")],
            tup=(torch.ones(2, device=device), {"deep": torch.zeros(3, 2, device=device)}),
        ),
    }


def test_staging_nested_tied_and_noncontiguous(backend, device):
    state = _rich_state(device)
    expected = _snapshot(state)
    with offload.AsyncStager() as stager:
        future = stager.stage(state)
        for t in (state["matrix"], state["tied_a"], state["gappy"], state["nested"]["tup"][0]):
            t.fill_(-9)  # after stage(): the host copy must not see it (the CPU copy is synchronous)
        staged = future.result()
        _assert_same(staged, expected)
        assert all(t.device.type == "cpu" for t in _tensors(staged))
        assert staged["tied_a"] is staged["tied_b"]
        assert staged["rows"].untyped_storage().data_ptr() == staged["matrix"].untyped_storage().data_ptr()
        assert staged["transposed"].untyped_storage().data_ptr() == staged["matrix"].untyped_storage().data_ptr()
        assert staged["transposed"].stride() == (1, 8)
        assert isinstance(staged["nested"]["lst"][4], tuple)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    return [t for v in values for t in _tensors(v)]


def test_staging_reuses_buffers_of_rebuilt_state_dict(backend, device):
    stager = offload.AsyncStager(ring_size=1)
    pointers = None
    for step in range(4):
        state = {"w": torch.full((64, 64), float(step), device=device), "b": torch.arange(8, device=device) + step,
                 "step": step}
        staged = stager.stage(state).result()
        _assert_same(staged, _snapshot(state))
        now = [staged["w"].data_ptr(), staged["b"].data_ptr()]
        assert pointers is None or now == pointers  # same host buffers, though the storages are new
        pointers = now
        del staged
    records = stager.metrics()
    assert [r["buffers_allocated"] for r in records] == [2, 0, 0, 0]
    assert [r["buffers_reused"] for r in records] == [0, 2, 2, 2]
    assert records[0]["bytes"] == 64 * 64 * 4 + 8 * 8
    assert all(r["copy_ms"] is not None and r["blocked_ms"] >= 0 and r["tensors"] == 2 for r in records)
    stager.close()


def test_staging_structure_change_replans_only_what_changed(backend, device):
    stager = offload.AsyncStager(ring_size=1)
    a, b, c = torch.randn(100, device=device), torch.randn(50, device=device), torch.randn(10, device=device)
    first = stager.stage({"a": a, "b": b, "c": c}).result()
    a_ptr = first["a"].data_ptr()
    del first
    d = torch.randn(3, 3, device=device)
    second = stager.stage({"a": a, "b": b.view(5, 10), "d": d}).result()  # b changed shape, c gone, d new
    _assert_same(second, {"a": a, "b": b.view(5, 10), "d": d})
    assert second["a"].data_ptr() == a_ptr
    record = stager.metrics()[-1]
    assert (record["replanned"], record["buffers_reused"], record["buffers_allocated"]) == (True, 1, 2)
    stager.close()


def _host_blocks(staged):
    return {t.untyped_storage().data_ptr() for t in _tensors(staged) if t.numel()}


def test_staging_small_tensors_packed_and_refilled(backend, device):
    # Saves 2+ refill the buffers of the first (its CopyHandle passed back as out=):
    # same host memory, new values; the native core packs them all into one block.
    stager = offload.AsyncStager(ring_size=1)
    tensors = {f"t{i}": torch.randn(37 + i % 5, device=device) for i in range(300)}
    staged = stager.stage(tensors).result()
    _assert_same(staged, _snapshot(tensors))
    pointers = [t.data_ptr() for t in _tensors(staged)]
    if backend == "native":
        assert len(_host_blocks(staged)) == 1
    del staged
    for step in range(3):
        for t in tensors.values():
            t.add_(1)
        staged = stager.stage(tensors).result()
        _assert_same(staged, _snapshot(tensors))
        assert [t.data_ptr() for t in _tensors(staged)] == pointers
        del staged
    assert [r["buffers_allocated"] for r in stager.metrics()] == [300, 0, 0, 0]
    # A structure change that breaks the packed part: many small survivors are packed afresh.
    changed = dict(tensors, extra=torch.ones(3, device=device))
    del changed["t0"]
    staged = stager.stage(changed).result()
    _assert_same(staged, _snapshot(changed))
    if backend == "native":
        assert len(_host_blocks(staged)) == 1
    assert stager.metrics()[-1]["buffers_allocated"] == 300
    stager.close()


def test_staging_spent_handles_let_go_by_result_and_bounded(backend, device):
    """A read copy time's handles are let go by a later result(), not inside stage(), and a
    caller that never asks for results holds at most a few saves' worth of them."""
    from offload.staging import metrics

    if not _device.is_accelerator(device):
        pytest.skip("copies are timed on an accelerator only (the host copies are synchronous)")
    stager = offload.AsyncStager(ring_size=1)
    tensors = {f"t{i}": torch.randn(64, device=device) for i in range(100)}
    seen = 0
    for save in range(10):
        if save:
            del future  # its staged dict would keep the ring's one set busy: the next stage() would wait
        future = stager.stage(tensors)
        future.exception()  # waits for the copy without result()
        assert len(stager._log.spent) <= metrics.SPENT_KEPT
        seen = max(seen, len(stager._log.spent))
    if backend == "native":
        # Copy times were read and their handles kept. Asserted for the native core only: the
        # fallback's copies may complete before their record is read, and the bound may have
        # cleared them by the 10th save.
        assert seen > 0
    staged = future.result()
    assert stager._log.spent == []
    _assert_same(staged, _snapshot(tensors))
    del staged
    stager.close()


def test_staging_layout_change_same_shape(backend, device):
    # Same path, shape and dtype, other strides (same storage, then a new one): the
    # buffers made for the old layout are not refilled blindly.
    stager = offload.AsyncStager(ring_size=1)
    base = torch.arange(24, dtype=torch.float32, device=device)
    states = [
        {"w": base.view(4, 6), "small": torch.ones(3, device=device)},
        {"w": base.view(6, 4).t(), "small": torch.ones(3, device=device)},  # same storage, transposed
        {"w": (base + 1).view(6, 4).t().contiguous(), "small": torch.ones(3, device=device)},  # new storage
        {"w": torch.arange(48.0, device=device).view(4, 12)[:, ::2],  # not dense
         "small": torch.ones(3, device=device)},
        {"w": torch.ones(1, 6, device=device).expand(4, 6), "small": torch.ones(3, device=device)},  # broadcast
        {"w": torch.full((4, 1), 3.0, device=device).expand(4, 6), "small": torch.ones(3, device=device)},
    ]
    for state in states:
        for _ in range(2):
            staged = stager.stage(state).result()
            _assert_same(staged, _snapshot(state))
            del staged
    stager.close()


def test_staging_broadcast_tensor_restaged(backend, device):
    stager = offload.AsyncStager(ring_size=1)
    row = torch.arange(5, dtype=torch.float32, device=device).view(1, 5)
    state = {"b": row.expand(1000, 5), "w": torch.ones(4, device=device)}
    for step in range(3):
        row.fill_(step)
        staged = stager.stage(state).result()
        _assert_same(staged, _snapshot(state))
        assert staged["b"].shape == (1000, 5)
        del staged
    stager.close()


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


@pytest.mark.parametrize("impl", ["python", "native"])
def test_staging_object_scans_match_the_python_loops(impl):
    # The busy check's reference sums and the cached tree's type check, in C and in Python.
    from offload.core import _backend
    from offload.staging import object_scan as _object_scan
    if impl == "native":
        core = _backend.core()
        if core is None:
            pytest.skip("needs the compiled core (offload._C)")
        scan = core
    else:
        scan = _object_scan
    refcount_sum, types_equal, storage_bytes = scan._refcount_sum, scan._types_equal, scan._storage_bytes
    objects = [torch.ones(2), torch.zeros(3), object()]
    base = refcount_sum(objects)
    held = objects[1]
    assert refcount_sum(objects) == base + 1
    also = [objects[0], objects[2]]
    assert refcount_sum(objects) == base + 3
    del held, also
    assert refcount_sum(objects) == base
    assert types_equal(objects, [torch.Tensor, torch.Tensor, object])
    assert not types_equal(objects, [torch.Tensor, torch.Tensor, int])
    assert not types_equal(objects, [torch.Tensor, torch.Tensor])  # another length
    assert not types_equal([torch.nn.Parameter(torch.ones(1))], [torch.Tensor])  # a subclass is another type
    assert types_equal([], [])
    # A first save's size: each storage once, at most what its tensors cover.
    big = torch.zeros(1000)  # 4000 bytes
    tied = torch.ones(10, dtype=torch.float64)
    tensors = [big[:100], big[100:150].view(5, 10).t(), tied, tied, torch.empty(0), torch.zeros(3, dtype=torch.int8)]
    assert storage_bytes(tensors) == (400 + 200 + 80 + 3, 400)  # the tied 80 bytes count once: 160 > 80
    assert storage_bytes([big, big[:10]]) == (4000, 4000)  # never more than the storage
    assert storage_bytes([]) == (0, 0)
    # A first save's reader views: each engine tensor's layout over its block's alias storage.
    block = torch.arange(64, dtype=torch.uint8)
    engine = [block[8:16].view(torch.float32), block[16:48].view(torch.int16).view(4, 4).t(), block[:0],
              torch.zeros(2, 0)]
    addresses = scan._storage_addresses(engine)
    assert addresses == [block.data_ptr()] * 2 + [0, 0]  # no elements: no alias needed
    alias = block.clone()  # another storage with the same bytes, standing in for the DLPack alias
    views = scan._views_over(engine, {block.data_ptr(): alias})
    for view, t in zip(views, engine):
        assert (view.dtype, view.shape, view.stride()) == (t.dtype, t.shape, t.stride())
        assert view.numel() == 0 or view.untyped_storage().data_ptr() == alias.data_ptr()
        assert torch.equal(view, t)
    alias.zero_()
    assert not views[0].any() and not views[1].any()  # the alias's bytes, not the block's
    if impl == "native":
        with pytest.raises(ValueError, match="no alias for the storage of tensor 0"):
            scan._views_over(engine, {})
    # A wide dict's values in the plan's key order: its own order, another one, a missing key.
    dict_values = scan._dict_values
    values = [torch.ones(1), 2, "x", None]
    d = {f"layer{i}.weight": v for i, v in enumerate(values)}
    keys = tuple(d)
    got = dict_values(d, keys)
    assert len(got) == 4 and all(a is b for a, b in zip(got, values))
    assert dict_values(d, tuple("".join(k) for k in keys)) == got  # equal keys, other objects
    reordered = collections.OrderedDict(d)
    reordered.move_to_end("layer0.weight")  # its iteration order is not its dict order
    assert all(a is b for a, b in zip(dict_values(reordered, keys), values))
    assert all(a is b for a, b in zip(dict_values(dict(reversed(d.items())), keys), values))
    with pytest.raises(KeyError, match="layer9.weight"):
        dict_values(d, keys[:3] + ("layer9.weight",))
    assert dict_values({}, ()) == []


def test_staging_kept_tensor_or_view_keeps_set_busy(backend, device):
    stager = offload.AsyncStager(ring_size=1, when_busy="raise")
    w = torch.ones(32, device=device)
    kept = stager.stage({"w": w, "n": 1}).result()["w"]  # the dict is gone, one tensor of it is not
    with pytest.raises(RuntimeError, match="busy"):
        stager.stage({"w": w, "n": 2})
    part = kept[4:8]  # a new view of the host buffer, not the object handed out
    del kept
    gc.collect()
    if offload.staging.ring._use_count is not None:
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
    if offload.staging.ring._use_count is not None:
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


def test_staging_limit_bytes(backend, device):
    state = {"w": torch.ones(1024, device=device)}
    small = offload.AsyncStager(limit_bytes=1000)  # too small for the tensor: staged to pageable memory
    with pytest.warns(UserWarning, match=r"4096 bytes \(1 tensors\) are staged to pageable host memory"):
        _assert_same(small.stage(state).result(), _snapshot(state))
    assert small.host_bytes() == 0 and small.pageable_bytes() == 4096
    small.close()
    stager = offload.AsyncStager(ring_size=2, limit_bytes="6KiB", when_busy="raise")
    held = stager.stage(state)
    with pytest.raises(RuntimeError, match="busy"):  # a second set would pass the limit: the ring stays at one
        stager.stage(state)
    del held
    stager.stage(state).result()
    assert stager.host_bytes() == 4096
    stager.close()


def test_staging_limit_bytes_counts_pool_blocks(backend, device):
    """limit_bytes bounds the pool blocks the stager holds, which the pool rounds up
    to its size classes (10 x 400 kB tensors take 10 x 512 KiB natively), not the
    bytes planning counted: host_bytes() is what the pool reports handed out."""
    pool = offload.HostPool()
    state = {f"t{i}": torch.randn(100_000, device=device) for i in range(10)}  # 400 kB each: a block each
    planned = 10 * 400_000
    probe = offload.AsyncStager(pool=pool)
    staged = probe.stage(state).result()
    held = pool.stats()["in_use_bytes"]
    assert probe.host_bytes() == held
    del staged
    probe.close()
    gc.collect()
    if pool.native:
        assert held > planned * 1.05  # the size classes round these blocks up by 31%
    limit = int(planned * 1.05)
    if held > limit:
        # Planning's estimate fits, the blocks the pool rounds up do not: the save plans again
        # with fewer pooled bytes and stages the rest to pageable memory, within the limit.
        stager = offload.AsyncStager(pool=pool, limit_bytes=limit)
        with pytest.warns(UserWarning, match="staged to pageable host memory"):
            staged = stager.stage(state).result()
        _assert_same(staged, _snapshot(state))
        assert 0 < stager.host_bytes() <= limit and stager.pageable_bytes() > 0
        assert pool.stats()["in_use_bytes"] == stager.host_bytes()  # nothing kept past the limit
        del staged
        stager.close()
        gc.collect()
        assert pool.stats()["in_use_bytes"] == 0
    stager = offload.AsyncStager(pool=pool, limit_bytes=held, ring_size=2, when_busy="raise")
    first = stager.stage(state)
    with pytest.raises(RuntimeError, match="busy"):  # a second set would pass the limit: the ring stays at one
        stager.stage(state)
    assert pool.stats()["in_use_bytes"] == stager.host_bytes() == held
    del first
    _assert_same(stager.stage(state).result(), _snapshot(state))
    assert [r["set"] for r in stager.metrics()] == [0, 0]
    stager.close()
    gc.collect()
    # A new structure while set 0 is read: planning's estimate lets a second set fit, the
    # blocks it gets do not. The set gives them back, and the save waits for set 0 (raises here).
    limit = held + planned + (planned * 3) // 100
    stager = offload.AsyncStager(pool=pool, limit_bytes=limit, ring_size=2, when_busy="raise")
    first = stager.stage(state)
    renamed = {f"renamed{i}": t for i, t in enumerate(state.values())}
    if pool.native:
        with pytest.raises(RuntimeError, match="busy"):
            stager.stage(renamed)
        gc.collect()
        assert pool.stats()["in_use_bytes"] == stager.host_bytes() == held
        with pytest.raises(RuntimeError, match="busy"):  # it does not try again
            stager.stage(renamed)
    del first
    _assert_same(stager.stage(renamed).result(), _snapshot(renamed))
    assert stager.host_bytes() <= limit
    stager.close()


def test_staging_close_returns_buffers(backend, device):
    pool = offload.HostPool()
    stager = offload.AsyncStager(pool=pool)
    staged = stager.stage({"w": torch.ones(4096, device=device)}).result()
    assert pool.stats()["in_use_bytes"] >= 4096 * 4
    stager.close()
    assert stager.host_bytes() == 0
    assert torch.equal(staged["w"], torch.ones(4096))  # still readable after close
    del staged
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        stager.stage({"w": torch.ones(1, device=device)})


def test_staging_first_save_copies_into_the_pool_grown_beside_it(device):
    if not offload.HostPool().native:
        pytest.skip(f"the stager grows only offload's own pool ahead of a save: {offload.core._backend.why_not()}")
    MiB = 1 << 20
    pool = offload.HostPool()
    announced = []
    begin = pool.begin_reserve
    pool.begin_reserve = lambda nbytes, largest=0: announced.append(begin(nbytes, largest)) or announced[-1]
    torch.manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(64 << 10, device=device) for i in range(320)}  # 320 x 256 KiB
    state["tied"] = state["layers.0.w"]  # copied once: counted once
    state["slice"] = torch.randn(16 * MiB, device=device)[: MiB]  # 4 MiB of a 64 MiB buffer: counts 4 MiB
    expected = _snapshot(state)
    stager = offload.AsyncStager(pool=pool)
    _assert_same(stager.stage(state).result(), expected)
    stats = pool.stats()
    # One reservation, sized from what is copied (one counting the tied tensor twice or the whole
    # buffer would pass the bound), grown on a thread while the save planned and copied; the copies
    # (80 MiB packed, the 4 MiB slice), which start before it is complete, took its slabs as they
    # came and grew none of their own.
    assert len(announced) == 1 and 84 * MiB <= announced[0] <= 90 * MiB, announced
    assert stats["reserved_bytes"] == announced[0], stats
    stager.close()
    gc.collect()
    # A new stager on the same pool: the closed one's cached blocks serve it, nothing grows.
    again = offload.AsyncStager(pool=pool)
    state["layers.1.w"].add_(1)
    expected = _snapshot(state)
    _assert_same(again.stage(state).result(), expected)
    assert pool.stats()["slabs"] == stats["slabs"] and pool.stats()["reserved_bytes"] == stats["reserved_bytes"]
    assert len(announced) == 1
    again.close()


@pytest.mark.not_standin("the stand-in has no sparse tensors (torch.sparse has no PrivateUse1 kernels there)")
def test_staging_bad_input(device):
    stager = offload.AsyncStager()
    with pytest.raises(ValueError, match=r"state_dict\['m'\]\['w'\] is a meta tensor"):
        stager.stage({"m": {"w": torch.empty(3, device="meta")}})
    with pytest.raises(TypeError, match=r"state_dict\['cfg'\]\[1\] is a builtins.object"):
        stager.stage({"cfg": [1, object()]})
    with pytest.raises(TypeError, match=r"state_dict\['f'\] is a builtins.function"):
        stager.stage({"f": lambda: 0})
    with pytest.raises(ValueError, match="layout torch.sparse_coo"):
        stager.stage({"s": torch.eye(3, device=device).to_sparse()})
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        stager.stage([torch.ones(1)])
    with pytest.raises(TypeError, match="unexpected keyword"):
        stager.stage({}, bogus=1)
    with pytest.raises(ValueError, match="ring_size must be an int >= 1"):
        offload.AsyncStager(ring_size=0)
    with pytest.raises(TypeError, match="ring_size must be an int >= 1"):
        offload.AsyncStager(ring_size=1.5)
    with pytest.raises(ValueError, match="when_busy must be 'wait' or 'raise'"):
        offload.AsyncStager(when_busy="block")
    with pytest.raises(ValueError, match=r"forward_buffers names \['model.nope'\]"):
        offload.AsyncStager(forward_buffers=["model.nope"]).stage({"model": {"w": torch.ones(1, device=device)}})
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        stager.protect(object())


@pytest.mark.not_standin("the stand-in has no sparse tensors (torch.sparse has no PrivateUse1 kernels there)")
def test_staging_bad_tensor_in_a_later_save(device):
    """A tensor that turns meta or sparse after the structure is cached (generated code,
    cached plan) gets the first save's message, not a raw error from reading its pointer."""
    cases = [
        (lambda: torch.empty(4, device="meta"), ValueError, r"state_dict\['m'\]\['w[89]'\] is a meta tensor"),
        (lambda: torch.eye(2, device=device).to_sparse(), ValueError,
         r"state_dict\['m'\]\['w[89]'\] has layout torch.sparse_coo"),
        (lambda: torch.eye(2, device=device).to_sparse_csr(), ValueError,
         r"state_dict\['m'\]\['w[89]'\] has layout torch.sparse_csr"),
    ]
    for watched in (False, True):  # w9 alone, or tied to w8 (a slot whose layout _resolve compares itself)
        stager = offload.AsyncStager(ring_size=1)

        def state(last):
            layer = {f"w{j}": torch.full((4,), float(j), device=device) for j in range(9)}
            layer["w9"] = last
            if watched:
                layer["w8"] = last
            return {"m": layer}

        for _ in range(3):  # the third save runs generated code and the cached plan
            stager.stage(state(torch.ones(4, device=device))).result()
        for make, error, message in cases:
            with pytest.raises(error, match=message):
                stager.stage(state(make()))
        good = state(torch.arange(4.0, device=device))
        _assert_same(stager.stage(good).result(), _snapshot(good))  # the stager still works
        stager.close()


def test_staging_host_tensors_of_accelerator_state_copied_in_one_call(backend, device, monkeypatch):
    """CPU tensors in an accelerator's state dict (AdamW's `step` scalars) are copied
    by one torch._foreach_copy_ per save, and no per-tensor layout check runs for them;
    a host source that changes dtype, shape or layout is still staged bit for bit."""
    if device.type == "cpu":  # no accelerator: let the CPU tensors stand for the host side of one
        monkeypatch.setattr(offload.core._device, "compute_device_type", lambda: "cuda")
    calls = []
    real = offload.staging.host_copy._foreach_copy

    def counting(dsts, sources):
        calls.append(len(sources))
        return real(dsts, sources)

    monkeypatch.setattr(offload.staging.host_copy, "_foreach_copy", counting)
    n = 40
    steps = {i: {"step": torch.tensor(float(i))} for i in range(n)}
    state = {"model": {"w": torch.randn(8, device=device)}, "optim": {"state": steps}}
    host = 1 + n if device.type == "cpu" else n
    stager = offload.AsyncStager(ring_size=1)
    for save in range(5):
        for entry in steps.values():
            entry["step"].add_(1)
        calls.clear()
        _assert_same(stager.stage(state).result(), _snapshot(state))
        assert calls == [host], calls  # fresh on the first save, refilled after: one call each
    assert [r["replanned"] for r in stager.metrics()] == [True] + [False] * 4
    assert stager._plan.watched_slots == []  # the copy itself checks the host sources
    base = torch.arange(9.0).view(3, 3)
    changes = [
        lambda: steps[3].__setitem__("step", torch.tensor(7.0, dtype=torch.float64)),  # dtype
        lambda: steps[5].__setitem__("step", torch.arange(4.0)),  # shape
        lambda: steps[6].__setitem__("step", base),
        lambda: steps[6].__setitem__("step", base.t()),  # same pointer, shape and dtype; other strides
    ]
    for change in changes:
        change()
        _assert_same(stager.stage(state).result(), _snapshot(state))
    stager.close()
    with pytest.raises(ValueError, match=r"host source 1 changed to \(2,\) torch.float32"):
        offload.staging.host_copy.copy_on_host([torch.ones(()), torch.ones(2)], out=[torch.ones(()), torch.ones(3)])


def test_staging_scalars_change_without_replanning(backend, device):
    stager = offload.AsyncStager()
    w = torch.ones(4, device=device)
    for step in range(3):
        staged = stager.stage({"w": w, "meta": {"step": step, "lr": 0.1 * step}}).result()
        assert staged["meta"] == {"step": step, "lr": 0.1 * step}
        del staged
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False]
    stager.close()


def test_staging_forward_buffers_and_protect(backend, device):
    model, optimizer = _model(device)
    _train_step(model, optimizer, device)
    stager = offload.AsyncStager(forward_buffers=model)
    hook = stager.protect(optimizer)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    expected = _snapshot(state)
    future = stager.stage(state)
    _train_step(model, optimizer, device)  # forward changes BatchNorm statistics, step changes the rest
    _assert_same(future.result(), expected)
    plan = stager._plan
    early = [u for b in plan.batches if b.copied_first for u in b.units]
    assert len(early) == 3  # running_mean, running_var, num_batches_tracked
    hook.remove()
    stager.close()


@pytest.fixture
def gloo_world():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_staging_dtensor_keeps_placement(tmp_path, gloo_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.randn(8, 4)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "plain": torch.ones(3)}
    stager = offload.AsyncStager()
    staged = stager.stage(state).result()
    assert isinstance(staged["w"], DTensor)
    assert staged["w"].placements == state["w"].placements and staged["w"].device_mesh == mesh
    assert torch.equal(staged["w"].to_local(), full)
    del staged
    response = dcp.async_save(state, checkpoint_id=str(tmp_path), async_stager=stager)
    state["w"].to_local().fill_(0)
    getattr(response, "upload_completion", response).result()
    target = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]), "plain": torch.zeros(3)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    assert torch.equal(target["w"].to_local(), full) and torch.equal(target["plain"], torch.ones(3))
    stager.close()


# ---------------------------------------------------------------- GPU


def _busy_compute(device, ms_of_work=200):
    """Queue long work on the current stream so a copy that does not wait for it reads too early."""
    a = torch.randn(2048, 2048, device=device)
    for _ in range(ms_of_work // 2):
        a = a @ a
        a = a / a.norm()
    return a


@pytest.mark.cuda
def test_staging_sees_writes_queued_before_stage(backend, device):
    stager = offload.AsyncStager()
    x = torch.zeros(32 << 20, device=device)
    _busy_compute(device)
    x.fill_(7.0)  # queued behind the long work, before stage()
    staged = stager.stage({"x": x}).result()
    assert torch.equal(staged["x"], torch.full_like(staged["x"], 7.0))
    stager.close()


@pytest.mark.cuda
def test_staging_protect_keeps_pre_step_values(backend, device):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64 << 20, device=device)) for _ in range(2)]
    optimizer = torch.optim.SGD(params, lr=1.0)
    for p in params:
        p.grad = torch.ones_like(p)
    stager = offload.AsyncStager()
    stager.protect(optimizer)
    expected = [p.detach().clone() for p in params]
    future = stager.stage({f"p{i}": p for i, p in enumerate(params)})
    optimizer.step()  # at once: without protect it would race the copy
    staged = future.result()
    for i, e in enumerate(expected):
        assert torch.equal(staged[f"p{i}"], e.cpu())
    stager.close()


@pytest.mark.cuda
def test_staging_large_source_overwritten_after_stage(backend, device):
    stager = offload.AsyncStager()
    x = torch.randn(256 << 20, device=device, dtype=torch.bfloat16)
    expected = x.cpu()
    future = stager.stage({"x": x})
    stager.wait_stream()  # the compute stream waits for the copy on the device; the host is not blocked
    x.fill_(-1)
    assert torch.equal(future.result()["x"], expected)
    stager.close()


@pytest.mark.cuda
def test_staging_forward_buffers_wait_only_for_their_copy(backend, device):
    model, optimizer = _model(device)
    _train_step(model, optimizer, device)
    stager = offload.AsyncStager(forward_buffers=model)
    stager.protect(optimizer)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    expected = _snapshot(state)
    future = stager.stage(state)
    _train_step(model, optimizer, device)
    _assert_same(future.result(), expected)
    stager.close()


@pytest.mark.cuda
def test_staging_later_saves_are_deferred_and_exact(backend, device, monkeypatch):
    """Refills of a buffer set are queued by the core's worker thread (defer):
    each save still holds the values queued before its stage(), not those written after its
    wait_stream(), and every save's copy time is read."""
    from offload.staging import stager as staging

    deferred = []  # (save, defer) per copy_to_host call
    real = staging.copy_to_host

    def spy(*args, **kwargs):
        deferred.append((save, kwargs.get("defer", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(staging, "copy_to_host", spy)
    stager = offload.AsyncStager()
    tensors = [torch.zeros(64 << 10, device=device) for _ in range(500)]  # 256 KiB each
    for save in range(4):
        _busy_compute(device, 50)
        torch._foreach_mul_(tensors, 0.0)
        torch._foreach_add_(tensors, [float(save * 1000 + i) for i in range(len(tensors))])  # queued before stage()
        expected = torch.stack(tensors).cpu()
        future = stager.stage({"t": tensors})
        stager.wait_stream()
        torch._foreach_add_(tensors, 0.5)  # after the copy, on the device
        assert torch.equal(torch.stack(future.result()["t"]), expected)
    stager.close()
    metrics = stager.metrics()
    # A save that fills a buffer set for the first time plans and copies afresh (the
    # first save, and the second, whose set 0 the first's future still holds); every
    # refill of a set is deferred.
    fresh = {m["save"] - 1 for m in metrics if m["buffers_allocated"]}
    assert fresh == {0, 1}
    assert {defer for save, defer in deferred if save in fresh} == {False}
    assert {defer for save, defer in deferred if save not in fresh} == {True}
    assert all(r["copy_ms"] is not None and r["copy_ms"] > 0 for r in metrics)


@pytest.mark.cuda
def test_staging_no_memory_growth_over_100_saves(backend, device):
    pool = offload.HostPool()
    stager = offload.AsyncStager(pool=pool)
    model, optimizer = _model(device)
    big = torch.randn(16 << 20, device=device)
    held = []
    for _ in range(2):  # each staged dict held: both sets of the ring are allocated here, whatever the timing
        _train_step(model, optimizer, device)
        held.append(stager.stage({"model": model.state_dict(), "optim": optimizer.state_dict(), "big": big}).result())
    assert [m["set"] for m in stager.metrics()] == [0, 1]
    del held
    stager.synchronize_staging()
    _device.synchronize(device)
    gc.collect()
    device_before, host_before = _device.memory_allocated(device), pool.stats()["reserved_bytes"]
    for _ in range(100):
        _train_step(model, optimizer, device)
        stager.stage({"model": model.state_dict(), "optim": optimizer.state_dict(), "big": big})
    stager.synchronize_staging()
    _device.synchronize(device)
    gc.collect()
    records = stager.metrics()
    allocated = [(r["save"], r["set"], r["buffers_allocated"], r["replanned"]) for r in records if r["buffers_allocated"]]
    assert [(save, index) for save, index, _, _ in allocated] == [(1, 0), (2, 1)], allocated
    assert _device.memory_allocated(device) <= device_before + (1 << 20)
    assert pool.stats()["reserved_bytes"] <= host_before, (pool.stats(), host_before)
    assert stager.host_bytes() <= 2 * (big.numel() * 4 + (1 << 20))
    assert records[-1]["gbps"] is not None
    stager.close()


def test_staging_benchmark_rows_say_which_saves_were_measured(device, monkeypatch):
    """benchmarks/bench_staging.py measures slow baselines over fewer saves: each row's
    label names the saves its medians cover, for offload and for the baseline."""
    import pathlib
    import sys

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import bench_staging
        from common import Context

        monkeypatch.setattr(bench_staging, "_size_cases", lambda quick: [("8 tensors x 2 KiB", 8, 1 << 10)])
        rows = bench_staging._staging_rows(Context(device, quick=True, progress=lambda message: None))
    finally:  # the benchmarks' modules stay out of other tests' imports
        sys.modules.pop("bench_staging", None)
        sys.modules.pop("common", None)
    later = [r for r in rows if "first save" not in r["case"]]
    assert later and any(r.get("baseline_saves") == bench_staging.SLOW_SAVES for r in later)
    for r in later:
        assert f"saves 2-{bench_staging.SAVES}" in r["case"], r
        theirs = r.get("baseline_saves")
        if theirs is not None and theirs != bench_staging.SAVES:
            assert f"baseline: saves 2-{theirs}" in r["case"], r
        else:
            assert "baseline: saves" not in r["case"], r


def test_staging_warnings_are_ours_only():
    # The stager implements synchronize_staging itself: no deprecation warning from the protocol.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload.AsyncStager().synchronize_staging()


Pair = collections.namedtuple("Pair", "first second")


def test_staging_shape_changes_after_generated_code(backend, device):
    """Saves 2+ of one shape run generated code; every kind of change must still be seen."""
    stager = offload.AsyncStager(ring_size=1)
    w = torch.randn(6, device=device)
    shapes = [
        {"a": w, "l": [1, 2], "p": Pair(w, 3)},
        {"a": w, "l": [1, 2], "p": Pair(w, 4)},
        {"a": w, "l": [1, 2], "p": Pair(w, 5)},  # generated code from here on
        {"b": w, "l": [1, 2], "p": Pair(w, 5)},  # key renamed, same length
        {"b": w, "l": [1, 2, 3], "p": Pair(w, 5)},  # list grew
        {"b": w, "l": [1, torch.ones(2, device=device)], "p": Pair(w, 5)},  # leaf became a tensor
        {"b": w, "l": [1, 2], "p": (w, 5)},  # namedtuple became a tuple
        {"b": w.view(2, 3), "l": [1, 2], "p": (w, 5)},  # same storage, other shape
    ]
    for state in shapes:
        staged = stager.stage(state).result()
        _assert_same(staged, _snapshot(state))
        assert type(staged["p"]) is type(state["p"])
        del staged
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False, True, True, True, True, True]
    stager.close()


Wide = collections.namedtuple("Wide", [f"f{i}" for i in range(9)])


def test_staging_wide_containers_after_generated_code(backend, device):
    """Containers of many leaves are taken apart by key slices; every change must still be seen."""
    stager = offload.AsyncStager(ring_size=1)

    def state(names, extra=()):
        layer = {n: (torch.full((3,), float(i), device=device) if i % 3 else i) for i, n in enumerate(names)}
        return {
            "model": layer,
            "list": [torch.full((2,), float(i), device=device) for i in range(10)] + list(extra),
            "tuple": tuple(range(12)),
            "wide": Wide(*[torch.ones(1, device=device) * i for i in range(9)]),
        }

    names = [f"layer{i}.weight" for i in range(20)]
    reordered = dict(reversed(list(state(names)["model"].items())))
    shapes = [
        state(names),
        state(names),
        state(names),  # generated code from here on
        {**state(names), "model": reordered},  # same keys, other order: values found by key
        state(names[:-1] + ["renamed"]),  # a key renamed, same length
        state(names, extra=[7]),  # a wide list grew
        {**state(names), "model": {**state(names)["model"], names[3]: 3}},  # a tensor became an int
        {**state(names), "wide": tuple(state(names)["wide"])},  # namedtuple became a tuple
    ]
    for s in shapes:
        staged = stager.stage(s).result()
        _assert_same(staged, _snapshot(s))
        assert type(staged["wide"]) is type(s["wide"]) and type(staged["tuple"]) is tuple
        del staged
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False, False, True, True, True, True]
    stager.close()


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
        expected = _snapshot(state)
        future = stager.stage(state)
        with pytest.raises(RuntimeError, match="busy"):  # nothing built yet, the set is still held
            stager.stage(state)
        state["meta"]["step"], state["meta"]["name"], state["wide"]["k0"] = -1, "changed", -1
        got = []
        future.add_done_callback(lambda f: got.append(f.result()))
        staged = future.result()
        assert future.result() is staged and got and got[0] is staged
        _assert_same(staged, expected)
        assert staged["tied"][0] is staged["tied"][1] is staged["w"]
        del staged, got, future
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False, False]
    stager.close()


def test_staging_pointer_check_sees_moved_and_newly_tied_tensors(backend, device):
    # The steady-state check of data pointers (one call of torch's helper where it
    # has one, a map otherwise) must see a tensor moved to another storage, and a
    # save must then keep tensors that became tied tied in the staged dict.
    tensors = [torch.randn(8, device=device) for _ in range(20)]
    ptrs = [t.data_ptr() for t in tensors]
    indices = list(range(len(tensors)))
    same = offload.staging.plan.same_data_ptrs
    assert same(tensors, ptrs, indices)
    assert not same(tensors[:-1], ptrs, indices[:-1])
    moved = tensors[:7] + [tensors[7].clone()] + tensors[8:]
    assert not same(moved, ptrs, indices)
    stager = offload.AsyncStager(ring_size=1)
    a, b = torch.full((4,), 1.0, device=device), torch.full((4,), 2.0, device=device)
    wide = {f"w{i}": torch.full((2,), float(i), device=device) for i in range(10)}
    for state in [{"a": a, "b": b, "wide": wide}] * 3 + [{"a": a, "b": a, "wide": wide}]:
        staged = stager.stage(state).result()
        _assert_same(staged, _snapshot(state))
        assert (staged["a"] is staged["b"]) == (state["a"] is state["b"])
        del staged
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False, True]
    stager.close()


def test_staging_steady_saves_leave_the_address_check_to_the_copies(backend, device, monkeypatch):
    """Saves into a set bound to the plan compare no address in Python: the refills do
    (copy_to_host's same_sources). A moved tensor is caught by them and the save is redone
    with every tensor checked; the save after it is steady again."""
    from offload.staging import stager as staging

    checked_here, same_sources = [], []
    real_same, real_copy = staging.same_data_ptrs, staging.copy_to_host

    def spy_same(tensors, ptrs, indices):
        checked_here.append((save, len(indices)))
        return real_same(tensors, ptrs, indices)

    def spy_copy(*args, **kwargs):
        same_sources.append((save, kwargs.get("same_sources", False)))
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(staging, "same_data_ptrs", spy_same)
    monkeypatch.setattr(staging, "copy_to_host", spy_copy)
    stager = offload.AsyncStager(ring_size=1)
    state = {f"w{i}": torch.randn(64, device=device) for i in range(50)}
    for save in range(6):
        if save == 3:
            state["w7"] = state["w7"].clone()  # same shape and dtype, another storage
        state["w3"].add_(1)
        staged = stager.stage(state).result()
        _assert_same(staged, _snapshot(state))
        del staged
    stager.close()
    assert [s for s, _ in checked_here] == [3]  # only the redone save compares every address here
    assert {s for s, flag in same_sources if flag} == {1, 2, 3, 4, 5}  # save 3: its first try
    assert [flag for s, flag in same_sources if s == 3] == [True, False]
    assert [r["buffers_allocated"] for r in stager.metrics()] == [50, 0, 0, 0, 0, 0]


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
    _assert_same(second, _snapshot(second_state))
    del first  # set 0 free, set 1 held
    third_state = {"a": t_a, "b": t_b, "w": w}  # untied: a back where set 0 saw it
    third = stager.stage(third_state).result()
    _assert_same(third, _snapshot(third_state))
    assert third["a"] is not third["b"]
    assert [m["set"] for m in stager.metrics()] == [0, 1, 0]
    del second, third
    stager.close()


def test_staging_timing_of_a_failed_copy_is_dropped():
    """A copy that failed on the core's worker raises from its handle's copy_seconds(); the
    save's future reports that error, and its metrics record drops the timing instead of
    raising it again from every later stage(), metrics() and close()."""
    from offload.staging import metrics

    class Failed:
        def copy_seconds(self):
            raise RuntimeError("offload: the copy worker failed")

    record = {"_timing": {"cuda:0": [Failed()]}, "copy_ms": None, "gbps": None, "bytes": 1 << 20}
    metrics.resolve_timing(record)
    assert record["_timing"] is None and record["copy_ms"] is None and record["gbps"] is None


def test_staging_busy_timeout_must_be_a_number():
    with pytest.raises(TypeError, match="offload.AsyncStager: busy_timeout_s must be a number of seconds > 0, got str"):
        offload.AsyncStager(busy_timeout_s="")
    with pytest.raises(ValueError, match="offload.AsyncStager: busy_timeout_s must be > 0, got nan"):
        offload.AsyncStager(busy_timeout_s=float("nan"))
