"""Activation offload's user API on the CPU path: the handle, the context manager, argument checks, pass-through cases."""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import offload
from offload.core import _device
from offload.activation import engine as act
from _activation_helpers import (  # noqa: F401 (fixtures: one_thread, pool)
    MODES, PairModel, assert_bitwise_equal, grads_of, one_thread, pool, small_model, steps_to_run, train_step,
)

# These tests run models on the CPU, whose activations are host memory already:
# where an accelerator exists the engine rightly leaves them alone, and
# test_activation_cuda.py covers the GPU.
pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)


def test_activation_no_grad_eval_inference_pass_through(pool):
    model = small_model()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    with torch.no_grad():
        a = model(x)
    with torch.inference_mode():
        b = model(x)
    model.eval()
    c = model(x)
    model.train()
    assert torch.equal(a, b) and torch.equal(a, c.detach())
    stats = handle.stats()
    assert stats["groups_offloaded"] == 0 and stats["tensors_kept"] == 0


def test_activation_context_manager_custom_loop(pool):
    ref = small_model()
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(ref, x)
    with offload.activation_offload(min_tensor_bytes=0, pool=pool) as ao:
        h = model.embed(x)
        for i, block in enumerate(model.blocks):
            ao.boundary(offload=i < 3)
            h = block(h)
    loss = model.head(h).square().mean()
    loss.backward()
    assert torch.equal(loss, loss_ref)
    assert_bitwise_equal(grads_of(model), grads_ref)
    assert ao.stats()["groups_offloaded"] == 4  # the span before the first boundary is a group too
    with pytest.raises(RuntimeError, match="inside the `with` block"):
        ao.boundary()


@pytest.mark.parametrize("keep_handle", [True, False])
def test_activation_dropped_model_freed_without_gc(keep_handle, pool):
    """No reference cycle through the wrapped forwards: a model dropped without disable()
    frees its parameters at once (on a GPU its memory), not when the collector runs."""
    gc.collect()
    gc.disable()
    try:
        model = small_model()
        handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
        train_step(model, torch.randn(8, 16))
        model_ref, param_ref = weakref.ref(model), weakref.ref(model.blocks[0].up.weight)
        if not keep_handle:
            del handle
        del model
        assert model_ref() is None and param_ref() is None
        if keep_handle:
            assert handle.model is None
            handle.disable()  # nothing left to unwrap: no error
    finally:
        gc.enable()


def test_activation_wrapped_forward_keeps_signature(pool):
    import inspect

    model = small_model()
    before = [inspect.signature(m.forward) for m in (model, model.blocks[0])]
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool, verbose=False)
    assert [inspect.signature(m.forward) for m in (model, model.blocks[0])] == before
    handle.disable()


def _copies(model):
    """A deep copy and a pickled round trip (torch.save / torch.load) of `model`."""
    import io

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return copy.deepcopy(model), torch.load(buffer, weights_only=False)


def test_activation_copied_model_is_an_ordinary_module(pool):
    """deepcopy (RL reference models) or pickling a model with offload enabled gives a model
    that runs its own forward and layers, without offload, and can enable it itself."""
    import functools

    ref = small_model()
    model = copy.deepcopy(ref)
    block = model.blocks[1]
    block.forward = functools.partial(type(block).forward, block)  # someone else's instance forward
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    for clone in _copies(model):
        with torch.no_grad():
            for p in clone.parameters():
                p.mul_(0.5)
        for m in [clone, *clone.blocks]:  # a private type: only it tells the handle's wrapper from another forward
            assert not isinstance(m.__dict__.get("forward"), offload.activation.layers._WrappedForward)
        halved = copy.deepcopy(ref)
        with torch.no_grad():
            for p in halved.parameters():
                p.mul_(0.5)
        h = halved.embed(x)
        assert torch.equal(clone(x), halved(x))
        assert torch.equal(clone.blocks[1](h), halved.blocks[1](h))
        assert torch.equal(clone.blocks[0](h), halved.blocks[0](h))
        # Not a user of the original's handle: enabling works and offloads the copy's layers.
        before = handle.stats()["groups_offloaded"]
        mine = offload.enable_activation_offload(clone, min_tensor_bytes=0, pool=pool, verbose=False)
        assert_bitwise_equal(train_step(clone, x)[1], train_step(halved, x)[1])
        assert mine.stats()["groups_offloaded"] == 3 and handle.stats()["groups_offloaded"] == before
        mine.disable()
        assert "forward" not in clone.__dict__ and "forward" not in clone.blocks[0].__dict__
        assert torch.equal(clone(x), halved(x))
    # The copy outlives the original and is freed without the cyclic collector.
    clone = copy.deepcopy(model)
    del model, block
    gc.collect()
    assert_bitwise_equal(train_step(clone, x)[1], train_step(ref, x)[1])
    gc.disable()
    try:
        refs = [weakref.ref(clone), weakref.ref(clone.blocks[0])]
        del clone
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", MODES)
def test_activation_paused_step_runs_without_offload(mode, pool):
    ref = small_model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(ref, x)
    for _ in range(4):
        train_step(model, x)
    before = handle.stats()
    plan = handle.plan
    with handle.paused():
        with pytest.raises(RuntimeError, match="already paused"):
            with handle.paused():
                pass
        loss, grads = train_step(model, x)
    assert torch.equal(loss, loss_ref)
    assert_bitwise_equal(grads, grads_ref)
    assert handle.stats() == before  # the paused step saw no hook: nothing counted
    loss, grads = train_step(model, x)
    assert torch.equal(loss, loss_ref)
    assert_bitwise_equal(grads, grads_ref)
    # The same plan (a dict read anew each time): not one measured again after the pause.
    assert (handle.plan is None) == (plan is None)
    assert plan is None or handle.plan["forward_ms"] == plan["forward_ms"]
    if mode != "auto":
        assert handle.stats()["groups_offloaded"] == before["groups_offloaded"] > 0
    with handle.paused():  # the pause ended: the handle may be paused again
        pass
    handle.disable()


def test_activation_bad_arguments(pool):
    with pytest.raises(ValueError, match="no submodules and no parameters"):
        offload.enable_activation_offload(nn.Module())
    with pytest.raises(ValueError, match="found no layers"):
        offload.enable_activation_offload(nn.Sequential(nn.Linear(2, 2)))
    model = small_model()
    with pytest.raises(ValueError, match="'blocks.9', which is not a submodule"):
        offload.enable_activation_offload(model, layers=["blocks.9"])
    with pytest.raises(ValueError, match="memory_budget_bytes must be >= 0 bytes, got -1"):
        offload.enable_activation_offload(model, "auto", memory_budget_bytes=-1)
    with pytest.raises(ValueError, match="used by mode='auto'"):
        offload.enable_activation_offload(model, "async", memory_budget_bytes=1 << 30)
    with pytest.raises(ValueError, match="mode must be one of"):
        offload.enable_activation_offload(model, "fast")
    with pytest.raises(ValueError, match="resident_groups must be an int >= 1"):
        offload.enable_activation_offload(model, resident_groups=0)
    with pytest.raises(ValueError, match="min_tensor_bytes must be an int >= 0"):
        offload.enable_activation_offload(model, min_tensor_bytes=-5)
    with pytest.raises(ValueError, match="keep_last must be an int >= 0"):
        offload.enable_activation_offload(model, keep_last=-1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        offload.enable_activation_offload("model")
    with pytest.raises(ValueError, match="names 'blocks.0' and 'blocks.0.up' inside it"):
        offload.enable_activation_offload(model, layers=["blocks.0", "blocks.0.up"])
    with pytest.raises(ValueError, match="layers is empty"):
        offload.enable_activation_offload(model, layers=[])
    with pytest.raises(ValueError, match="mode='auto' needs layers"):
        offload.activation_offload("auto")
    handle = offload.enable_activation_offload(model, layers=["blocks.0", model.blocks[2]], pool=pool)
    assert handle.layers == ["blocks.0", "blocks.2"]
    with pytest.raises(RuntimeError, match="already has activation offload enabled"):
        offload.enable_activation_offload(model)
    handle.disable()
    offload.enable_activation_offload(model).disable()


def test_activation_compiled_layers_offload_bitwise(pool):
    """What a torch.compile'd layer saves goes through the hooks (AOTAutograd's function)."""
    ref = small_model()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        for block in m.blocks:
            block.compile(backend="aot_eager")
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(ref, x)
    loss, grads = train_step(model, x)
    assert torch.equal(loss, loss_ref)
    assert_bitwise_equal(grads, grads_ref)
    assert handle.stats()["tensors_offloaded"] > 0


def test_activation_compiled_model_other_backend_raises(pool):
    """A model compiled whole with a backend offload's partitioner does not see says so at its
    first forward (tests/test_activation_compile.py covers inductor)."""
    model = small_model()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.raises(RuntimeError, match="not rewritten by offload's partitioner"):
        compiled(torch.randn(8, 16))
    handle.disable()


def test_activation_warns_when_nothing_can_be_offloaded(pool):
    """keep_first + keep_last covering every layer, or an auto budget that cannot be met."""
    with pytest.warns(UserWarning, match=r"nothing will be offloaded: keep_first=2 \+ keep_last=2 keep all 4"):
        handle = offload.enable_activation_offload(small_model(), keep_first=2, keep_last=2, pool=pool)
    assert handle.offloaded_layers() == []


@pytest.mark.parametrize("mode", MODES)
def test_activation_tuple_outputs_keep_first(mode, pool):
    """Layers that take and return tuples; keep_first keeps the first layer on the device."""
    torch.manual_seed(0)
    ref = PairModel("next")
    for block in ref.blocks:
        block.late = "save"
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, keep_first=1, keep_last=0,
                                               pool=pool, verbose=False)
    assert handle.offloaded_layers() == ["blocks.1", "blocks.2"]
    offloaded = []
    for _ in range(steps_to_run(mode)):
        x = torch.randn(4, 8)
        loss_ref, grads_ref = train_step(ref, x)
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
        offloaded.append(handle.stats()["layers_offloaded"])
    assert offloaded[0] == 2 and offloaded[-1] == len(handle.offloaded_layers())


def test_activation_min_group_bytes_default_and_errors(pool):
    model = small_model()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=1000, pool=pool, verbose=False)
    assert handle.engine.min_group_bytes == act.GROUP_BYTES_PER_TENSOR_BYTE * 1000
    handle.disable()
    for bad, error in ((-1, ValueError), (True, TypeError), (1.5, TypeError), ("32MiB", TypeError)):
        with pytest.raises(error, match=r"enable_activation_offload: min_group_bytes must be an int >= 0"):
            offload.enable_activation_offload(model, min_group_bytes=bad, pool=pool, verbose=False)


def test_activation_respects_outer_hooks(pool):
    """Inside someone else's saved-tensor hooks (save_on_cpu around the model) offload steps aside."""
    ref = small_model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    _, grads_ref = train_step(ref, x)
    with torch.autograd.graph.save_on_cpu():
        loss = model(x)
    loss.backward()
    assert_bitwise_equal(grads_of(model), grads_ref)
    assert handle.stats()["groups_offloaded"] == 0


def test_activation_backward_inside_the_block(pool):
    """Backward run inside the `with` (reentrant recomputation saves again): nothing is packed twice."""
    ref = small_model(ckpt="reentrant")
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    _, grads_ref = train_step(ref, x)
    with offload.activation_offload(min_tensor_bytes=0, pool=pool) as ao:
        loss = model(x)
        ao.boundary()
        loss.backward()
    assert_bitwise_equal(grads_of(model), grads_ref)
    assert ao.stats()["groups_fetched"] >= 1


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_activation_listener_sees_each_group_closed_released_fetched_restored(mode, pool):
    """A listener gets one typed record per group event: each offloaded group is closed (its
    copy issued), released, fetched and restored, in that order; the bytes add up to the
    step's statistics; and after remove_listener nothing more comes."""
    ref = small_model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    events = []
    handle.add_listener(events.append)
    x = torch.randn(8, 16)
    _, grads_ref = train_step(ref, x)
    for step in range(2):
        events.clear()
        _, grads = train_step(model, x)
        assert_bitwise_equal(grads, grads_ref)
        stats = handle.stats()
        assert all(isinstance(e, offload.activation.ActivationEvent) and e.step == stats["step"] for e in events)
        closed = [e for e in events if e.kind == "closed"]
        assert len(closed) == stats["groups_offloaded"] and {e.layer for e in closed} == {0, 1, 2}
        assert all(e.group == handle.layers[e.layer] for e in events)
        assert sum(e.nbytes for e in closed) == stats["d2h_bytes"] > 0
        for group in closed:
            own = [e for e in events if e.serial == group.serial]
            kinds = [e.kind for e in own]
            assert kinds[:2] == ["closed", "released"] and kinds[-1] == "restored", kinds
            fetched = [e for e in own if e.kind == "fetched"]
            # Copied back whole, once: the piece covers the block (its bytes and its padding).
            assert [(e.offset, e.nbytes) for e in fetched] == [(0, group.block_bytes)]
            assert group.nbytes <= group.block_bytes < group.nbytes + 512 * 64
        assert stats["h2d_bytes"] == stats["d2h_bytes"]
    handle.remove_listener(events.append)
    events.clear()
    train_step(model, x)
    assert events == []
    handle.disable()


def test_activation_listener_of_the_context_manager_and_bad_listeners(pool):
    """activation_offload's groups report under their names, without a layer; a listener that
    is not callable, or removing one never added, raises the documented error."""
    events = []
    blocks = [nn.Linear(16, 16) for _ in range(2)]
    x = torch.randn(4, 16, requires_grad=True)
    with offload.activation_offload(min_tensor_bytes=0, pool=pool) as ao:
        ao.add_listener(events.append)
        for block in blocks:
            ao.boundary("block")
            x = torch.relu(block(x))
    x.sum().backward()
    assert {(e.group, e.layer) for e in events} == {("block", None)}
    assert [e.kind for e in events if e.kind == "closed"] == ["closed"] * ao.stats()["groups_offloaded"]
    with pytest.raises(TypeError, match="offload.activation_offload.add_listener: callback must be callable, got int"):
        ao.add_listener(3)
    ao.remove_listener(events.append)
    with pytest.raises(ValueError, match="offload.activation_offload.remove_listener: callback is not a listener"):
        ao.remove_listener(events.append)
    model = small_model()
    handle = offload.enable_activation_offload(model, pool=pool, verbose=False)
    with pytest.raises(TypeError, match="offload.ActivationOffload.add_listener: callback must be callable"):
        handle.add_listener(None)
    with pytest.raises(ValueError, match="offload.ActivationOffload.remove_listener: callback is not a listener"):
        handle.remove_listener(print)
    handle.disable()
