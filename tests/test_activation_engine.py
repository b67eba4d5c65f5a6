"""The activation engine on the CPU path: groups, views restored exactly, in-place checks, what stays on the device."""

import copy
import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload.core import _device
from offload.activation import engine as act
from offload.activation.saved_tensors import module_tensors, storage_ptrs
from _activation_helpers import (  # noqa: F401 (fixtures: one_thread, pool)
    PairModel, assert_bitwise_equal, async_logging_fetches, grads_of, log_events, one_thread, pool, small_model,
    spy_offloaded, spy_packs, spy_unpacked, train_step,
)

# These tests run models on the CPU, whose activations are host memory already:
# where an accelerator exists the engine rightly leaves them alone, and
# test_activation_cuda.py covers the GPU.
pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)


def test_activation_views_restored_exactly(pool, monkeypatch):
    """Each view comes back with its size, stride and storage offset on one shared storage."""
    seen = {}
    unpacked = []
    spy_unpacked(monkeypatch, unpacked.append)

    class Saver(torch.autograd.Function):
        @staticmethod
        def forward(ctx, base):
            views = [base.t(), base[1:, 2:], base[:1].expand(4, -1), base.as_strided((3, 3), (1, 2), 2), base]
            ctx.save_for_backward(*views, views[0])  # views[0] saved twice
            return base.clone()

        @staticmethod
        def backward(ctx, grad):
            saved = ctx.saved_tensors
            seen["saved"] = saved
            return grad

    base = torch.randn(4, 6, requires_grad=True)
    inner = base * 1  # not a leaf: offloadable
    with offload.activation_offload(min_tensor_bytes=0, pool=pool) as ao:
        out = Saver.apply(inner)
        ao.boundary()
    originals = [inner.t(), inner[1:, 2:], inner[:1].expand(4, -1), inner.as_strided((3, 3), (1, 2), 2), inner]
    stats = ao.stats()
    assert stats["tensors_offloaded"] == 6
    assert stats["d2h_bytes"] == inner.numel() * 4  # one storage, copied once
    out.sum().backward()
    saved = seen["saved"]
    assert unpacked[0] is unpacked[5]  # autograd rewraps tensors that require grad; the engine does not
    storage = saved[4].untyped_storage().data_ptr()
    for got, want in zip(saved, originals):
        assert got.shape == want.shape and got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset()
        assert got.untyped_storage().data_ptr() == storage
        assert torch.equal(got, want)
    assert storage != inner.untyped_storage().data_ptr()  # restored from the host copy


def test_activation_views_in_other_dtypes_restored_exactly(pool):
    """Views of one storage in several dtypes (a float tensor read as int32, int16 and bytes,
    at offsets that are not whole float elements) share one copied span and come back with
    their values, sizes, strides and offsets, next to another group's span in the block."""
    seen = {}

    class Saver(torch.autograd.Function):
        @staticmethod
        def forward(ctx, other, base):
            views = [base, base.view(torch.int32)[1:, 3:], base.view(torch.int16)[:, 5:].t(),
                     base.view(torch.uint8)[2:, 3:17], other]
            ctx.save_for_backward(*views)
            return base.clone() + other.sum()

        @staticmethod
        def backward(ctx, grad):
            seen["saved"] = ctx.saved_tensors
            return grad.sum().expand(5), grad

    base = torch.randn(4, 6, requires_grad=True) * 1  # not leaves: offloadable
    other = torch.randn(5, requires_grad=True) * 1
    with offload.activation_offload(min_tensor_bytes=0, pool=pool) as ao:
        out = Saver.apply(other, base)
        ao.boundary()
    originals = [base, base.view(torch.int32)[1:, 3:], base.view(torch.int16)[:, 5:].t(),
                 base.view(torch.uint8)[2:, 3:17], other]
    assert ao.stats()["d2h_bytes"] == base.numel() * 4 + other.numel() * 4  # one span per storage
    out.sum().backward()
    for got, want in zip(seen["saved"], originals):
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got, want)
    assert seen["saved"][1].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


def test_activation_views_wrong_restore_would_differ(pool):
    """A transposed view of a deduplicated storage: `.view(shape)` would give other values."""
    ref = small_model(n=3)
    model = copy.deepcopy(ref)
    offload.enable_activation_offload(model, "sync", min_tensor_bytes=0, keep_last=0, pool=pool)
    x = torch.randn(5, 16)
    loss_ref, grads_ref = train_step(ref, x)
    loss, grads = train_step(model, x)
    assert_bitwise_equal(grads, grads_ref)


def test_activation_repeated_forwards_then_one_backward(pool):
    ref = small_model()
    model = copy.deepcopy(ref)
    offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    xs = [torch.randn(8, 16) for _ in range(3)]
    loss_ref, grads_ref = train_step(ref, *xs)
    loss, grads = train_step(model, *xs)
    assert torch.equal(loss, loss_ref)
    assert_bitwise_equal(grads, grads_ref)


def test_activation_retain_graph_twice(pool):
    ref = small_model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    for m in (ref, model):
        loss = m(x)
        loss.backward(retain_graph=True)
        loss.backward()
    assert_bitwise_equal(grads_of(model), grads_of(ref))
    assert handle.stats()["groups_fetched"] == 6  # each backward brings every group back


def test_activation_hooks_only_where_a_group_is_open(pool, monkeypatch):
    """With enable_activation_offload, tensors saved by the kept last layer and the head never
    reach the hooks (a Python call per tensor where nothing is offloaded); only the embedding's,
    saved before the first layer starts, are seen outside a group. The hooks stack is empty
    after forward and after backward, and gradients are bitwise those without offload."""
    outside = []
    spy_packs(monkeypatch, lambda in_group: outside.append(not in_group))
    ref = small_model(n=4)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    _, grads_ref = train_step(ref, x)
    seen = {}
    for only_groups in (False, True):
        handle.engine.hooks_in_groups_only = only_groups
        outside.clear()
        loss = model(x)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        model.zero_grad(set_to_none=True)
        loss.backward()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert_bitwise_equal(grads_of(model), grads_ref)
        seen[only_groups] = (len(outside), sum(outside))
    embed_saves = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: embed_saves.append(t) or t, lambda t: t):
        model.embed(x)
    assert seen[True][1] == len(embed_saves)  # outside a group: the embedding's only
    assert seen[False][1] > seen[True][1] and seen[False][0] - seen[True][0] == seen[False][1] - seen[True][1]


# Raised as an offloaded layer starts (hooks on), or after the kept last layer ran (hooks off).
@pytest.mark.parametrize("where", ["before layer 2", "after layer 3"])
def test_activation_exception_in_forward_leaves_nothing(pool, where):
    model = small_model()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)

    def boom(module, *args):
        raise RuntimeError("boom")

    if where == "before layer 2":
        hook = model.blocks[2].register_forward_pre_hook(boom)
    else:
        hook = model.blocks[3].register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(8, 16))
    hook.remove()
    engine = handle.engine
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    # A private read: no seam reports the pack table's storage map (which holds groups) empty after a
    # failed forward.
    assert engine.capturing == 0 and engine.open_group is None and len(engine._table) == 0
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0
    x = torch.randn(8, 16)
    assert_bitwise_equal(train_step(small_model(), x)[1], train_step(model, x)[1])


def test_activation_exception_in_backward_leaves_nothing(pool):
    model = small_model()
    offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)

    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("backward boom")

    x = torch.randn(8, 16)
    out = model(x)
    loss = out + Fail.apply(out * 1)  # Fail's node runs first, before any group is consumed
    with pytest.raises(RuntimeError, match="backward boom"):
        loss.backward()
    assert pool.stats()["in_use_bytes"] > 0
    del loss, out
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0


def test_activation_inplace_after_save_same_layer_raises(pool):
    ref = PairModel("same")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref(torch.randn(4, 8)).backward()
    offload.enable_activation_offload(ref, min_tensor_bytes=0, pool=pool)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref(torch.randn(4, 8)).backward()


def test_activation_inplace_after_save_kept_tensor_raises(pool):
    """Tensors that stay on the device keep autograd's version check."""
    ref = PairModel("same")
    offload.enable_activation_offload(ref, min_tensor_bytes=1 << 30, pool=pool)  # nothing offloaded
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref(torch.randn(4, 8)).backward()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_activation_inplace_after_copy_raises(mode, pool):
    """Modified in place after its layer's copy completed (a later layer changes a tensor the
    previous one saved, then drops it): raises as autograd does, not the host snapshot used."""
    torch.manual_seed(0)
    ref = PairModel("next")
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref(x).backward()
    offload.enable_activation_offload(ref, mode, min_tensor_bytes=0, keep_last=1, pool=pool, verbose=False)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[float32 \[4, 8\]\] is at version 1"):
        ref(x).backward()


class _SavesView(nn.Module):
    """Saves a slice of an intermediate it returns (sin saves its input), not the intermediate."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h[:, :4].sin().sum(1, keepdim=True) + h, h


def test_activation_inplace_after_copy_through_a_view_raises(pool):
    """The saved tensor is a view; the caller changes its base after the copy completed."""
    model = nn.Module()
    model.blocks = nn.ModuleList(_SavesView() for _ in range(3))
    hidden, change = [], []

    def forward(x):
        for block in model.blocks:
            x, h = block(x)
            hidden.append(h)
            if len(hidden) == 2 and change:
                hidden[0].add_(1)  # the base of the slice block 0 saved
        return x.sum()

    model.forward = forward
    handle = offload.enable_activation_offload(model, "sync", min_tensor_bytes=0, pool=pool, verbose=False)
    model(torch.randn(4, 8)).backward()  # unchanged: the check leaves the versions as they were
    assert [h._version for h in hidden] == [0, 0, 0]
    hidden.clear()
    change.append(True)
    loss = model(torch.randn(4, 8))
    assert handle.stats()["groups_offloaded"] == 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    hidden.clear()
    handle.disable()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # as without offload
        model(torch.randn(4, 8)).backward()


def test_activation_parameters_never_offloaded(pool, monkeypatch):
    model = small_model()
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)  # frozen weights are recognised by storage
    model.blocks[0].register_buffer("scale", torch.ones(16))
    sources = []
    spy_offloaded(monkeypatch, sources.append)
    offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    model(torch.randn(8, 16)).backward()
    params = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    assert sources and not params & {s.untyped_storage().data_ptr() for s in sources}


class _Scaled(nn.Module):
    """Scales by a buffer, which `x * scale` saves (a leaf that no op made), while `on`."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.on = False

    def forward(self, x):
        return x * self.scale if self.on else x


def _blocks_with_a_buffer():
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), _Scaled(16))
                           for _ in range(3)))


def test_activation_parameters_walked_only_for_tensors_no_op_made(pool, monkeypatch):
    """Saved outputs of recorded ops (and views of them) own their memory, and a parameter's
    view (a weight's transpose) is known by its base, trainable or frozen: a step whose only
    candidate tensors are these never reads the parameters' storages. A buffer saved (a leaf
    that no op made) makes the step read them, and stays."""
    walks = []
    real = act.ActivationEngine._walk_params

    def counted(self, *args, **kwargs):  # a private spy: no seam reports the walk, a cost and not a behaviour
        walks.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(act.ActivationEngine, "_walk_params", counted)
    torch.manual_seed(0)
    model = _blocks_with_a_buffer()
    reference = copy.deepcopy(model)
    handle = offload.enable_activation_offload(model, layers=["0", "1", "2"], min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16, requires_grad=True)  # a leaf that needs grad: kept before any walk

    def step_of(m):
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        return grads_of(m) + [x.grad]

    for change in ("trainable", "frozen weights", "a buffer saved"):
        if change == "frozen weights":
            for m in (model, reference):
                for p in m[0].parameters():
                    p.requires_grad_(False)
        if change == "a buffer saved":
            model[1][3].on = reference[1][3].on = True
        walks.clear()
        x.grad = None
        grads = step_of(model)
        assert handle.stats()["tensors_offloaded"] > 0
        assert bool(walks) == (change == "a buffer saved"), change
        x.grad = None
        assert_bitwise_equal(grads, step_of(reference))


class _MaskedLayer(nn.Module):
    def __init__(self, d, own_copy):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.own_copy = own_copy

    def forward(self, x, mask):
        return self.lin(x) * (mask.clone() if self.own_copy else mask)  # the product saves the mask


class _MaskedLayers(nn.Module):
    """Layers that each multiply by one mask the model builds without grad (as it builds a padded
    batch's attention mask), or each by a copy of it of their own."""

    def __init__(self, n, d, own_copies):
        super().__init__()
        self.layers = nn.ModuleList(_MaskedLayer(d, own_copies) for _ in range(n))

    def forward(self, x):
        mask = (x.detach() > 0).to(x.dtype)  # no recorded op made it
        for layer in self.layers:
            x = layer(x, mask)
        return x.square().mean()


def test_activation_a_tensor_every_layer_saves_is_copied_once(backend, pool):
    """A tensor no op made, saved by every layer (one mask): the first group copies it, the
    later ones keep it on the device (Note [shared constants]); with a copy per layer, each
    group copies its own. Gradients bitwise either way."""
    n, x = 4, torch.randn(8, 64)
    mask_bytes = x.numel() * x.element_size()
    copied = {}
    for own_copies in (False, True):
        torch.manual_seed(0)
        model = _MaskedLayers(n, 64, own_copies)
        reference = copy.deepcopy(model)
        handle = offload.enable_activation_offload(model, layers=[f"layers.{i}" for i in range(n)], keep_last=0,
                                                   min_tensor_bytes=0, min_group_bytes=0, pool=pool)
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            m(x).backward()
        assert_bitwise_equal(grads_of(model), grads_of(reference))
        stats = handle.stats()
        assert stats["groups_offloaded"] == n
        copied[own_copies] = stats["d2h_bytes"]
        handle.disable()
    assert copied[False] == copied[True] - (n - 1) * mask_bytes


def test_activation_a_storage_every_layer_saves_is_walked_for_once(pool, monkeypatch):
    """The mask every layer saves (no op made it) needs the walk at its first save only: a later
    layer's save finds it among this forward's saved storages, with no walk of that layer's
    parameters, which its first save found it is not."""
    walks = []
    real = act.ActivationEngine._walk_params

    def counted(self, ptr=None, count=None):  # a private spy: no seam reports the walk, a cost and not a behaviour
        if ptr is not None:  # a walk a saved tensor asked for (not the one as the forward starts)
            walks.append(ptr)
        return real(self, ptr, count)

    monkeypatch.setattr(act.ActivationEngine, "_walk_params", counted)
    n = 4
    model = _MaskedLayers(n, 64, own_copies=False)
    handle = offload.enable_activation_offload(model, layers=[f"layers.{i}" for i in range(n)], keep_last=0,
                                               min_tensor_bytes=0, min_group_bytes=0, pool=pool)
    for _ in range(2):
        walks.clear()
        model(torch.randn(8, 64, requires_grad=True)).backward()  # an input that needs grad: kept without a walk
        assert len(walks) == 1, walks  # at layer 0's save of the mask
        assert handle.stats()["groups_offloaded"] == n
    handle.disable()


@pytest.mark.parametrize("buffer", [False, True])
def test_activation_parameters_walked_as_the_forward_starts_once_a_forward_needed_them(pool, monkeypatch, buffer):
    """The model's input (no recorded op made it) needs the walk in the first layer. The first
    forward walks there, at the saved input; later forwards walk before the first layer opens,
    and keep the input and the buffer on the device all the same. The walk reads the inputs
    first and stops where the tensor's storage is found: the parameters are read only where a
    buffer is saved too."""
    order = []
    real = act.ActivationEngine._walk_params

    def counted(self, *args, **kwargs):  # a private spy: no seam reports the walk, a cost and not a behaviour
        real(self, *args, **kwargs)
        held = self._table.holds_param
        order.append(("walk", held(x.untyped_storage().data_ptr()),
                      sum(held(p.untyped_storage().data_ptr()) for p in model.parameters())))

    monkeypatch.setattr(act.ActivationEngine, "_walk_params", counted)
    torch.manual_seed(0)
    model = _blocks_with_a_buffer()
    model[1][3].on = buffer
    model[0].register_forward_pre_hook(lambda *_: order.append(("layer 0",)))
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    handle = offload.enable_activation_offload(model, layers=["0", "1", "2"], min_tensor_bytes=0, pool=pool)
    params = len(list(model.parameters()))

    def step_of(m):
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        return grads_of(m)

    for step in range(3):
        order.clear()
        grads = step_of(model)
        walks = [i for i, what in enumerate(order) if what[0] == "walk"]
        first_layer = order.index(("layer 0",))
        assert order[walks[0]][1]  # the input, read first
        # The model's parameters: read (all of them) only for the buffer.
        assert order[walks[-1]][2] == (params if buffer else 0), order
        assert (walks[0] < first_layer) == (step > 0), (step, order)
        assert handle.stats()["tensors_offloaded"] > 0
        assert_bitwise_equal(grads, step_of(reference))
    handle.disable()


def test_activation_min_tensor_bytes_keeps_small(pool):
    model = small_model()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=16 * 64 * 4 + 1, pool=pool)
    model(torch.randn(8, 16)).backward()
    assert handle.stats()["tensors_offloaded"] == 0
    handle.disable()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=8 * 64 * 4, pool=pool)
    model(torch.randn(8, 16)).backward()
    assert handle.stats()["tensors_offloaded"] > 0


class _LinearStack(nn.Module):
    """Its first layer saves the model's input itself (a Linear saves its input)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, batch):
        x = batch["x"]
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_activation_model_inputs_stay(pool):
    """A forward's input (here inside a dict) is held by the caller through the forward: the
    first layer's save of it is kept, not copied; the second layer's input is offloaded."""
    torch.manual_seed(0)
    ref = _LinearStack()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    batch = {"x": torch.randn(8, 16)}
    loss_ref, grads_ref = train_step(ref, batch)
    loss, grads = train_step(model, batch)
    assert torch.equal(loss, loss_ref)
    assert_bitwise_equal(grads, grads_ref)
    stats = handle.stats()
    assert stats["offloaded_layers"] == ["blocks.0", "blocks.1"] and stats["tensors_offloaded"] == 1
    handle.disable()


@pytest.mark.parametrize("ckpt", [None, "non_reentrant"])
def test_activation_async_copies_the_first_layer_in_parts(pool, ckpt):
    """Async mode: from the second forward the first offloaded layer is copied in SPLIT_PARTS
    parts of the bytes it saved before, and in backward all its parts are fetched together at
    the next layer's first unpack, its last part first; a layer that saves fewer spans than
    parts (a checkpoint's input) is not split. Gradients stay bitwise equal."""
    from offload.activation.forward import SPLIT_PARTS

    model, handle, log, x, grads_ref = async_logging_fetches(pool, ckpt=ckpt)
    closed = []
    log_events(handle, closed, ("closed",))
    for step in range(3):
        log.clear()
        closed.clear()
        _, grads = train_step(model, x)
        assert_bitwise_equal(grads, grads_ref)
        stats = handle.stats()
        assert stats["layers_offloaded"] == 3
        split = ckpt is None and step > 0
        assert stats["groups_offloaded"] == 3 + (SPLIT_PARTS - 1) * split
        fetched = [event for what, event in log if what == "fetch"]
        assert len(fetched) == len({event.serial for event in fetched}) == stats["groups_offloaded"]
        first = [event for event in fetched if event.layer == 0]
        assert len(first) == (SPLIT_PARTS if split else 1)
        # The parts: each its own bytes, the last one saved fetched first, all before any is restored.
        assert [event.part for event in first] == list(reversed(range(len(first))))
        assert [event.n_layers == 0 for event in first] == [True] * (len(first) - 1) + [False]  # later parts
        at = log.index(("fetch", first[-1]))
        assert all(what == "fetch" or event.layer != 0 for what, event in log[:at])
        # Split where the parts' bytes say: copied in order as the layer runs, each part bytes of its own.
        parts = [event for event in closed if event.layer == 0]
        assert [event.part for event in parts] == list(range(len(first)))
        assert all(event.nbytes > 0 for event in parts)


def test_activation_autocast_weight_casts_stay(pool, monkeypatch):
    """Under autocast the cached bf16 copies of parameters are kept, activations offloaded."""
    model = small_model()
    offloaded = []
    spy_offloaded(monkeypatch, offloaded.append)  # what is offloaded, on either hooks' path
    x = torch.randn(8, 16)
    saved_ref = []
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved_ref.append(t) or t, lambda t: t):
        loss_ref = small_model()(x)
    offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x)
    loss.backward()
    assert torch.equal(loss, loss_ref)
    weights = {p.shape[::-1] for p in model.parameters() if p.dim() == 2}

    def is_cast(t):
        return t.dtype == torch.bfloat16 and tuple(t.shape) in weights and not t.is_contiguous()

    assert any(is_cast(t) for t in saved_ref)  # autograd saves the casts: the check below can fail
    assert offloaded
    assert not [t for t in offloaded if is_cast(t)]
