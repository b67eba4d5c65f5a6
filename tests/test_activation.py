"""Activation offload on the CPU path: gradients and losses bitwise equal to no offload.

On a CPU-only torch the engine runs whole: groups, spans, copies (host to host,
synchronous), restores, prefetch bookkeeping, the auto planner. GPU-only properties
(peak memory, overlap) are in test_activation_cuda.py.
"""

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload.core import _device
from offload.activation import engine as act
from offload.activation.planner import max_tuning_steps

# These tests run models on the CPU, whose activations are host memory already:
# where an accelerator exists the engine rightly leaves them alone, and
# test_activation_cuda.py covers the GPU.
pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)

MODES = ["sync", "async", "auto"]


class Block(nn.Module):
    """Saves transposes, slices, expands, as_strided and overlapping views, a tensor twice,
    int and bool tensors, and views of one storage in several shapes."""

    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.table = nn.Embedding(11, d)

    def forward(self, x):
        h = self.norm(x)
        a = F.gelu(self.up(h))
        y = self.down(a)
        t = (x * 3).t()  # a transposed view is saved by the matmul below
        z = (t @ h).sum() * 1e-3
        s = a[1:, ::2]  # a strided slice
        e = x[:1].expand(x.shape[0], -1)  # a broadcast view
        w = torch.sin(s).sum() * 1e-2 + torch.cos(e)
        flat = y.reshape(-1)
        o = flat.as_strided((flat.numel() - 3, 2), (1, 1))  # overlapping windows of one storage
        o = (o * o).sum() * 1e-2  # the same tensor saved twice
        idx = (x.abs() * 7).long() % 11  # int saved by embedding backward
        emb = self.table(idx[:, 0])
        mask = x > 0  # bool saved by where
        m = torch.where(mask, y, y * 0.5)
        return m + w + emb + z + o


class Model(nn.Module):
    def __init__(self, d=16, n=4, ckpt=None):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)
        self.ckpt = ckpt

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            if self.ckpt is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(x).square().mean()


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return Model(**kw)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _step(model, *inputs):
    model.zero_grad(set_to_none=True)
    loss = sum(model(x) for x in inputs)
    loss.backward()
    return loss.detach(), _grads(model)


@pytest.fixture
def pool():
    return offload.HostPool()


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: one intra-op thread is faster and steadier on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", MODES)
def test_activation_blocks_bitwise(mode, backend, pool):
    ref = _model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = _step(ref, x)
    for _ in range(3):  # auto measures two steps, then runs its plan
        loss, grads = _step(model, x)
        assert torch.equal(loss, loss_ref)
        _assert_equal(grads, grads_ref)
    stats = handle.stats()
    # The last of 4 layers stays by default; auto mode's schedule copies the first in parts,
    # and so does async mode once a forward has shown the first layer's size.
    assert stats["offloaded_layers"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert stats["layers_offloaded"] == 3
    assert stats["groups_offloaded"] == 3 if mode == "sync" else stats["groups_offloaded"] > 3
    assert stats["d2h_bytes"] > 0 and stats["h2d_bytes"] == stats["d2h_bytes"]
    assert stats["tensors_offloaded"] > 20
    handle.disable()
    assert "forward" not in model.__dict__ and all("forward" not in b.__dict__ for b in model.blocks)
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0


def test_activation_views_restored_exactly(pool, monkeypatch):
    """Each view comes back with its size, stride and storage offset on one shared storage."""
    seen = {}
    unpacked = []
    real_unpack = act.ActivationEngine.unpack

    def spy(self, packed):
        unpacked.append(real_unpack(self, packed))
        return unpacked[-1]

    monkeypatch.setattr(act.ActivationEngine, "unpack", spy)

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
    ref = _model(n=3)
    model = copy.deepcopy(ref)
    offload.enable_activation_offload(model, "sync", min_tensor_bytes=0, keep_last=0, pool=pool)
    x = torch.randn(5, 16)
    loss_ref, grads_ref = _step(ref, x)
    loss, grads = _step(model, x)
    _assert_equal(grads, grads_ref)


def _llama(layers):
    """A Llama-architecture model from a tiny config, random weights (no download)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def _steps(mode):
    """Steps to run: auto measures two steps, then times its plan and then steps without offload
    (its layers unwrapped): on the CPU, 10 steps cover all three."""
    return 10 if mode == "auto" else 1


@pytest.mark.parametrize("mode", MODES)
def test_activation_llama_bitwise(mode, pool):
    ref = _llama(3)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    assert handle.layers == ["model.layers.0", "model.layers.1", "model.layers.2"]
    offloaded = []
    for _ in range(_steps(mode)):
        ids = torch.randint(0, 64, (2, 12))
        losses = []
        for m in (ref, model):
            m.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[1], losses[0])
        _assert_equal(_grads(model), _grads(ref))
        offloaded.append(handle.stats()["layers_offloaded"])
    assert offloaded[0] == 2 and offloaded[-1] == len(handle.offloaded_layers())


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_llama_gradient_checkpointing(reentrant, pool):
    base = _llama(4)
    ref, model, plain = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    h_plain = offload.enable_activation_offload(plain, "async", min_tensor_bytes=0, pool=pool)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool)
    ids = torch.randint(0, 64, (2, 12))
    for m in (ref, model, plain):
        m.zero_grad()
        m(input_ids=ids, labels=ids).loss.backward()
    _assert_equal(_grads(model), _grads(ref))
    # Only the checkpoint inputs are offloaded: far fewer tensors and bytes than without checkpointing.
    with_ckpt, without = handle.stats(), h_plain.stats()
    assert 0 < with_ckpt["tensors_offloaded"] <= 6 * 3
    assert with_ckpt["d2h_bytes"] < without["d2h_bytes"] / 3


@pytest.mark.parametrize("ckpt", ["reentrant", "non_reentrant", "wrapper"])
def test_activation_checkpoint_variants(ckpt, pool):
    if ckpt == "wrapper":
        wrapper_mod = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
        ref = _model()
        for i, block in enumerate(ref.blocks):
            ref.blocks[i] = wrapper_mod.checkpoint_wrapper(block)
    else:
        ref = _model(ckpt=ckpt)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = _step(ref, x)
    for _ in range(2):
        loss, grads = _step(model, x)
        assert torch.equal(loss, loss_ref)
        _assert_equal(grads, grads_ref)
    stats = handle.stats()
    assert stats["groups_offloaded"] >= 2
    assert stats["tensors_offloaded"] <= 3 * 2  # the checkpoint inputs (and its dummy), not the activations


def test_activation_no_grad_eval_inference_pass_through(pool):
    model = _model()
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


def test_activation_repeated_forwards_then_one_backward(pool):
    ref = _model()
    model = copy.deepcopy(ref)
    offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    xs = [torch.randn(8, 16) for _ in range(3)]
    loss_ref, grads_ref = _step(ref, *xs)
    loss, grads = _step(model, *xs)
    assert torch.equal(loss, loss_ref)
    _assert_equal(grads, grads_ref)


def test_activation_retain_graph_twice(pool):
    ref = _model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    for m in (ref, model):
        loss = m(x)
        loss.backward(retain_graph=True)
        loss.backward()
    _assert_equal(_grads(model), _grads(ref))
    assert handle.stats()["groups_fetched"] == 6  # each backward brings every group back


def test_activation_hooks_only_where_a_group_is_open(pool, monkeypatch):
    """With enable_activation_offload, tensors saved by the kept last layer and the head never
    reach the hooks (a Python call per tensor where nothing is offloaded); only the embedding's,
    saved before the first layer starts, are seen outside a group. The hooks stack is empty
    after forward and after backward, and gradients are bitwise those without offload."""
    outside = []
    real = act.ActivationEngine.pack

    def spy(self, t):
        outside.append(self.open_group is None)
        return real(self, t)

    monkeypatch.setattr(act.ActivationEngine, "pack", spy)
    ref = _model(n=4)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    _, grads_ref = _step(ref, x)
    seen = {}
    for only_groups in (False, True):
        handle.engine.hooks_in_groups_only = only_groups
        outside.clear()
        loss = model(x)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        model.zero_grad(set_to_none=True)
        loss.backward()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        _assert_equal(_grads(model), grads_ref)
        seen[only_groups] = (len(outside), sum(outside))
    embed_saves = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: embed_saves.append(t) or t, lambda t: t):
        model.embed(x)
    assert seen[True][1] == len(embed_saves)  # outside a group: the embedding's only
    assert seen[False][1] > seen[True][1] and seen[False][0] - seen[True][0] == seen[False][1] - seen[True][1]


# Raised as an offloaded layer starts (hooks on), or after the kept last layer ran (hooks off).
@pytest.mark.parametrize("where", ["before layer 2", "after layer 3"])
def test_activation_exception_in_forward_leaves_nothing(pool, where):
    model = _model()
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
    assert engine.capturing == 0 and engine.open_group is None and not engine._storages
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0
    x = torch.randn(8, 16)
    _assert_equal(_step(_model(), x)[1], _step(model, x)[1])


def test_activation_exception_in_backward_leaves_nothing(pool):
    model = _model()
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


class InplaceAfterSave(nn.Module):
    def __init__(self, d, late):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.late = late

    def forward(self, pair):
        x, aux = pair
        y = self.lin(x)
        s = y.exp()  # saves its result
        if self.late is None:
            s.mul_(2)  # in the same layer, after the save
        elif self.late == "next":
            aux.mul_(2)  # the previous layer saved aux
        return s + x, s


class PairModel(nn.Module):
    def __init__(self, late):
        super().__init__()
        self.blocks = nn.ModuleList([InplaceAfterSave(8, None if late == "same" else "save"),
                                     InplaceAfterSave(8, "next"), InplaceAfterSave(8, "save")])
        if late == "same":
            self.blocks[0].late = None
            self.blocks[1].late = "save"

    def forward(self, x):
        pair = (x, x)
        for block in self.blocks:
            pair = block(pair)
        return pair[0].sum()


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
    model = _model()
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)  # frozen weights are recognised by storage
    model.blocks[0].register_buffer("scale", torch.ones(16))
    sources = []
    real = act.copy_spans_to_host

    def spy(tensors, *args, **kw):
        sources.extend(tensors)
        return real(tensors, *args, **kw)

    monkeypatch.setattr(act, "copy_spans_to_host", spy)
    offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    model(torch.randn(8, 16)).backward()
    params = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    assert sources and not params & {s.untyped_storage().data_ptr() for s in sources}


def test_activation_parameters_walked_only_for_tensors_no_op_made(pool, monkeypatch):
    """Saved outputs of recorded ops (and views of them) own their memory: a step whose only
    candidate tensors are such outputs never reads the parameters' storages. A frozen weight
    (a leaf that needs no grad, saved as a view) makes the step read them, and stays."""
    walks = []
    real = act.storage_ptrs

    def counted(params):
        walks.append(1)
        return real(params)

    monkeypatch.setattr(act, "storage_ptrs", counted)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)))
    handle = offload.enable_activation_offload(model, layers=["0", "1", "2"], min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16, requires_grad=True)  # a leaf that needs grad: kept before any walk
    model(x).square().mean().backward()
    assert handle.stats()["tensors_offloaded"] > 0 and not walks
    for p in model[0].parameters():
        p.requires_grad_(False)
    model(x).square().mean().backward()
    assert walks


def test_activation_min_tensor_bytes_keeps_small(pool):
    model = _model()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=16 * 64 * 4 + 1, pool=pool)
    model(torch.randn(8, 16)).backward()
    assert handle.stats()["tensors_offloaded"] == 0
    handle.disable()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=8 * 64 * 4, pool=pool)
    model(torch.randn(8, 16)).backward()
    assert handle.stats()["tensors_offloaded"] > 0


def test_activation_context_manager_custom_loop(pool):
    ref = _model()
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = _step(ref, x)
    with offload.activation_offload(min_tensor_bytes=0, pool=pool) as ao:
        h = model.embed(x)
        for i, block in enumerate(model.blocks):
            ao.boundary(offload=i < 3)
            h = block(h)
    loss = model.head(h).square().mean()
    loss.backward()
    assert torch.equal(loss, loss_ref)
    _assert_equal(_grads(model), grads_ref)
    assert ao.stats()["groups_offloaded"] == 4  # the span before the first boundary is a group too
    with pytest.raises(RuntimeError, match="inside the `with` block"):
        ao.boundary()


def test_activation_auto_plans_and_replans(pool, capsys):
    ref = _model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool)
    for shape in ((8, 16), (8, 16), (8, 16), (6, 16), (6, 16), (6, 16)):
        x = torch.randn(*shape)
        loss_ref, grads_ref = _step(ref, x)
        loss, grads = _step(model, x)
        assert torch.equal(loss, loss_ref)
        _assert_equal(grads, grads_ref)
    printed = capsys.readouterr().out
    assert printed.count("auto plan") == 2 and "[[8, 16]]" in printed and "[[6, 16]]" in printed
    plan = handle.stats()["plan"]
    assert plan["input_shapes"] == [[6, 16]] and len(plan["mask"]) == 4 and plan["mask"][3] is False
    assert plan["eligible_bytes"] > 0


@pytest.mark.parametrize("case", ["fits", "grows", "budget", "no_room"])
def test_activation_auto_measures_layers_without_offload_when_it_fits(case, pool, monkeypatch):
    """The first measuring step offloads every eligible layer; if a step without offload fits
    (and no budget is set) the measured ones offload nothing, one more while the allocator
    grows; else one more offloads everything. Layer bytes are measured either way."""
    reserved = [0]
    if case == "grows":  # the allocator takes new device memory in every step
        monkeypatch.setattr(_device, "memory_reserved", lambda device=None: reserved[0])
    if case == "no_room":  # 1 KiB of device memory: a step without offload might not fit
        monkeypatch.setattr(_device, "mem_get_info", lambda device=None: (1 << 10, 1 << 10))
    ref = _model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False,
                                               memory_budget_bytes="1GiB" if case == "budget" else None)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = _step(ref, x)
    offloaded = []
    while handle.plan is None:
        reserved[0] += 1 << 20
        loss, grads = _step(model, x)
        assert torch.equal(loss, loss_ref)
        _assert_equal(grads, grads_ref)
        offloaded.append(handle.stats()["layers_offloaded"])
        assert len(offloaded) < 5
    dry = case in ("fits", "grows")
    # The plan is made at the next forward: the last entry is the first step with it.
    expected = {"fits": [3, 0], "grows": [3, 0, 0], "budget": [3, 3], "no_room": [3, 3]}[case]
    assert offloaded[:-1] == expected and handle.planner.measure_without_offload is dry
    plan = handle.plan
    assert all(b > 0 for b in plan["layer_bytes"][:3]) and all(f > 0 for f in plan["forward_ms"][:3])


class _PeakInLossModel(Model):
    """Tells a stand-in for the device's peak memory that the step peaks between the head and
    the loss (a Llama's loss upcasts its logits there)."""

    def __init__(self, peak):
        super().__init__()
        self.peak = peak

    def forward(self, x):
        self.peak[0] = 0  # the peak memory statistic is reset as each step starts
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        h = self.head(x)  # saves its input and weight: the 1st and 2nd tensors after the layers
        self.peak[0] = 100
        return h.square().mean()  # the 3rd


def test_activation_auto_finds_the_last_save_before_the_peak(pool, monkeypatch):
    peak = [0]
    monkeypatch.setattr(_device, "max_memory_allocated", lambda device=None: peak[0])
    torch.manual_seed(0)
    model = _PeakInLossModel(peak)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    for _ in range(3):
        _step(model, torch.randn(8, 16))
    m, ms = handle.plan["before_peak"]
    assert m == 2 and ms >= 0
    # The peak reached before any tensor is saved after the layers (inside them): no such point.
    monkeypatch.setattr(_device, "max_memory_allocated", lambda device=None: 100)
    handle.disable()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    for _ in range(3):
        _step(model, torch.randn(8, 16))
    assert handle.plan["before_peak"] is None


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
    loss_ref, grads_ref = _step(ref, batch)
    loss, grads = _step(model, batch)
    assert torch.equal(loss, loss_ref)
    _assert_equal(grads, grads_ref)
    stats = handle.stats()
    assert stats["offloaded_layers"] == ["blocks.0", "blocks.1"] and stats["tensors_offloaded"] == 1
    handle.disable()


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor


class _NestedInputModel(Model):
    """Takes its input inside a container."""

    def forward(self, batch):
        if isinstance(batch, (list, tuple)):
            return super().forward(batch[0])
        return super().forward(batch.x if isinstance(batch, _Batch) else batch["x"])


@pytest.mark.parametrize("container", ["dict", "list", "userdict", "dataclass"])
def test_activation_auto_replans_on_nested_input_shape(container, pool, capsys):
    """A new input shape inside a dict, a list, a UserDict (Hugging Face's BatchEncoding) or
    a dataclass is a new shape: auto mode measures it and plans again."""
    import collections

    wrap = {"dict": lambda x: {"x": x}, "list": lambda x: [x], "dataclass": _Batch,
            "userdict": lambda x: collections.UserDict(x=x)}[container]
    torch.manual_seed(0)
    ref = _NestedInputModel()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool)
    for n in (8, 8, 8, 6, 6, 6):
        x = torch.randn(n, 16)
        loss_ref, grads_ref = _step(ref, wrap(x))
        loss, grads = _step(model, wrap(x))
        assert torch.equal(loss, loss_ref)
        _assert_equal(grads, grads_ref)
    printed = capsys.readouterr().out
    assert printed.count("auto plan") == 2 and "[[8, 16]]" in printed and "[[6, 16]]" in printed
    assert handle.plan["input_shapes"] == [[6, 16]]


def test_activation_auto_budget_zero_offloads_everything(pool):
    model = _model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, memory_budget_bytes=0,
                                               pool=pool, verbose=False)
    for _ in range(3):
        _step(model, torch.randn(8, 16))
    assert handle.plan["mask"] == [True, True, True, False]


def test_activation_planner_hides_copies():
    """The timeline model: with a slow bus only every other layer fits under compute."""
    from offload.activation.schedule import choose, simulate

    n = 8
    nbytes, fwd, bwd = [100.0] * n, [1.0] * n, [2.0] * n
    eligible = [True] * (n - 1) + [False]
    exposed_all, _ = simulate(eligible, nbytes, fwd, bwd, 50.0, 50.0, 2)
    assert exposed_all > 0
    mask, exposed, step = choose(eligible, nbytes, fwd, bwd, 50.0, 50.0, 2)
    assert exposed <= 0.01 * step and 0 < sum(mask) < n - 1
    mask_fast, exposed_fast, _ = choose(eligible, nbytes, fwd, bwd, 1e6, 1e6, 2)
    assert mask_fast == eligible and exposed_fast == 0
    # A budget that lets two layers stay: the rest is offloaded even though copies show.
    mask_budget, exposed_budget, _ = choose(eligible, nbytes, fwd, bwd, 50.0, 50.0, 2, allowance=200.0)
    assert sum(mask_budget) == n - 1 - 2 and exposed_budget > 0


def test_activation_schedule_fills_the_bus_before_the_last_layer_ends():
    """Auto mode's schedule: earliest layers first, the last one that fits in part, the first
    copied in parts while it runs; each copy planned complete (with its margin) before its
    release point and before the last layer ends; each group fetched back at the latest layer
    start that leaves time for its copy."""
    from offload.activation.schedule import COPY_MARGIN, FETCH_MARGIN, SPLIT_PARTS, TAIL_POINT, schedule

    n = 8
    nbytes, fwd, bwd = [100] * n, [1.0] * n, [2.0] * n
    eligible = [True] * (n - 1) + [False]
    plan, order, exposed = schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0)
    per = (1 + COPY_MARGIN) / 50.0  # 0.021 s a byte: 2.1 s a layer
    # Layer 0 opens on an idle stream: copied in 4 parts of 25 bytes as it saves them (each
    # at a quarter of its second), from 0.25 s to 2.35; then layers 1 and 2 (2.35-4.45,
    # 4.45-6.55), and from 6.55 what fits by 8, the last layer's end (the deadline, not
    # backward's start at 10): 69 bytes, split where the copy passes the last layer's open
    # (7 s: 21 bytes).
    assert SPLIT_PARTS == 4 and plan.split_at == {0: [25, 50, 75], 3: [21]}
    assert order == [0, 1, 2, 3] and exposed == 0
    assert plan.caps == [None] * 3 + [int((8 - 6.55) / per)] + [None] * 4
    # Layer opens are 0..7: each part goes at the first open after its copy (layer 0's parts
    # end at 0.775, 1.3, 1.825 and 2.35 s); layer 3's first part as the last layer opens,
    # the rest when it ends (point 8).
    assert plan.release_at == {0: [1, 2, 2, 3], 1: 5, 2: 7, 3: [7, 8]}
    # Backward: layer 7 starts at 1, then every 2 s; layer i is needed at 15 - 2 i. A layer's
    # copy back takes 1 s (with FETCH_MARGIN 1.3 s): each is fetched one layer ahead.
    assert FETCH_MARGIN == 0.3
    assert plan.fetch_at == {4: [3], 3: [2], 2: [1], 1: [0]} and plan.fetch_at_start == []
    # A slower way back (2.6 s a layer, 2 s of backward each): the copies queue on one stream,
    # so the latest starts count back from layer 0's need (15 s): 12.4, 9.8, 7.2, and 5.41 for
    # layer 3 (69 bytes); each is fetched at the latest layer start before that, and nothing
    # is exposed (fetched each at its own latest start, layers 2, 1 and 0 came 2.98 s late).
    slow_back, _, exposed = schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 50.0, 50.0)
    assert slow_back.fetch_at == {5: [3], 4: [2], 3: [1], 2: [0]} and exposed == 0
    # Slower still (13 s a layer): what cannot be hidden is fetched as backward starts, in
    # the order backward needs it, and its lateness is predicted.
    slowest, _, exposed = schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 50.0, 10.0)
    assert slowest.fetch_at_start == [3, 2, 1] and exposed > 0
    # A slow bus: not even one layer fits before the last one ends, and a part of one does
    # (from 0.25 s: 7.75 s / 1.05 at 5 bytes/s = 36 bytes), copied in parts that end at 5.5,
    # 6.97 (the 32 bytes copied by the last layer's open) and 7.81 s.
    slow, slow_order, _ = schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 5.0, 50.0)
    assert slow_order == [0] and slow.caps[0] == 36
    assert slow.split_at == {0: [25, 32]} and slow.release_at == {0: [6, 7, 8]}
    # The last tensor saved before the step's peak comes 1 s after the last layer ends (the
    # 3rd saved after it, in the head): copies may run until 9 s. Layer 3 is copied whole,
    # its bytes copied after the last layer's end (69-100) let go at that save (point 8.5),
    # and 16 bytes of layer 4 from 8.65 s (0.35 s / 0.021).
    tail, tail_order, exposed = schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0, (3, 1.0))
    assert tail_order == [0, 1, 2, 3, 4] and tail.caps[3] is None and tail.caps[4] == 16 and exposed == 0
    assert tail.split_at[3] == [21, 69] and tail.release_at[3] == [7, 8, 8 + TAIL_POINT]
    assert tail.release_at[4] == 8 + TAIL_POINT and tail.tail_save == 3
    # At the last layer's end: no copy is let go there, no point is kept.
    assert schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0, (3, 0.0))[0] == plan
    # A copy stream still busy when a layer ends: that layer is not split.
    assert 1 not in plan.split_at and 2 not in plan.split_at
    # Nothing eligible, or a bus too slow for an eighth of a layer: nothing offloaded.
    assert schedule([False] * n, nbytes, fwd, bwd, 2.0, 1.0, 50.0, 50.0)[1] == []
    assert schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 0.5, 50.0)[1] == []


def test_activation_schedule_closes_parts_when_the_layer_saved_their_bytes():
    """A layer's parts close when it has saved their bytes, by the measured marks: a layer that
    saves half its bytes 0.6 s into its second and the rest at 0.9 s starts its copy later
    than an even spread says, and its parts are let go later."""
    from offload.activation.schedule import COPY_MARGIN, schedule, saved_by

    assert saved_by(None, 2.0, 0.25) == 0.5  # no marks: evenly over the layer's time
    marks = [(0.5, 0.6), (1.0, 0.9)]
    # The first mark with the share saved (the bytes between marks may all come at the later).
    assert saved_by(marks, 1.0, 0.25) == 0.6 and saved_by(marks, 1.0, 0.75) == 0.9
    assert saved_by([(0.5, 0.6)], 1.0, 0.75) == 1.0  # past the last mark: at the layer's end
    assert saved_by([(1.0, 1.5)], 1.0, 1.0) == 1.0  # never after the layer's end
    n = 8
    nbytes, fwd, bwd = [100] * n, [1.0] * n, [2.0] * n
    eligible = [True] * (n - 1) + [False]
    even, _, _ = schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0)
    late, _, _ = schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0, None, [marks] + [None] * (n - 1))
    assert COPY_MARGIN == 0.05 and even.release_at[0] == [1, 2, 2, 3]
    # 0.525 s a part: from 0.6 s (the first two quarters), 1.125 and 1.65; the third quarter
    # from 1.65 (saved at 0.9), 2.175; the last from 2.175, 2.7.
    assert late.split_at[0] == [25, 50, 75] and late.release_at[0] == [2, 2, 3, 3]
    # The stream is free 0.35 s later for the layers after it: what fits by the end shrinks.
    assert late.caps[3] == int((8 - 2.7 - 2 * 2.1) / ((1 + COPY_MARGIN) / 50.0)) < even.caps[3]


def test_activation_schedule_counts_bytes_at_span_ends():
    """A group closes a part, or stops at its cap, only between two of its spans: with layers
    whose spans end at 30, 60 and 100 bytes, the first layer's parts close at span ends (its
    quarters' ends rounded up: 30, 60, and the rest), the layer that fits in part is capped at
    the last span end that fits (60 of the 69 bytes the bus could take), so the plan's bytes
    are what the engine will copy, and a part to be let go as the last layer opens ends at the
    last span end its copy passes by then."""
    from offload.activation.schedule import schedule, span_end_at_or_above, span_end_at_or_below

    assert span_end_at_or_below([30, 60, 100], 69) == 60 and span_end_at_or_below([30, 60, 100], 29) == 0
    assert span_end_at_or_above([30, 60, 100], 31) == 60 and span_end_at_or_above([30, 60, 100], 101) == 100
    assert span_end_at_or_below(None, 69) == 69 and span_end_at_or_above(None, 31) == 31
    n = 8
    nbytes, fwd, bwd = [100] * n, [1.0] * n, [2.0] * n
    eligible = [True] * (n - 1) + [False]
    plan, order, _ = schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0, None, None, [[30, 60, 100]] * n)
    # 0.63 s a span of 30: layer 0's first part from 0.3 s (its 30 bytes saved), 0.93; then
    # 1.56 and 2.4 s; layers 1 and 2 to 6.6 s; layer 3 from 6.6 s: 66 bytes fit by 8 s, 60 go.
    assert order == [0, 1, 2, 3] and plan.caps == [None] * 3 + [60] + [None] * 4
    assert plan.split_at == {0: [30, 60]} and plan.release_at[0] == [1, 2, 3]
    # By the last layer's open (7 s) its copy has taken 19 bytes, less than its first span: no
    # part goes there (rounded up, a part's copy would end after the point it is let go at).
    assert plan.release_at[3] == 8
    # At 55 bytes/s layer 3 fits whole, its copy from 6.03 s: by 7 s it has taken 51 bytes,
    # so its first span (30) goes as the last layer opens, the rest at the end (7.94 s).
    faster, order, _ = schedule(eligible, nbytes, fwd, bwd, 2.0, 1.0, 55.0, 100.0, None, None, [[30, 60, 100]] * n)
    assert order == [0, 1, 2, 3] and faster.caps[3] is None
    assert faster.split_at[3] == [30] and faster.release_at[3] == [7, 8]


def test_activation_auto_marks_when_layers_save_their_bytes(pool):
    """The measured steps mark when each layer has saved every eighth of its bytes: the plan
    holds, per eligible layer, marks of a rising share saved at rising times within its
    forward, past the last eighth; and the layer's bytes after each of its new spans."""
    from offload.activation.schedule import PROFILE_POINTS

    model = _model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    while handle.plan is None:
        _step(model, torch.randn(64, 16))
    plan = handle.plan
    eligible = [not k for k in handle.keep]
    assert any(eligible)
    for i, marks in enumerate(plan["saved_ms"]):
        if not eligible[i]:
            continue
        shares = [share for share, _ in marks]
        times = [t for _, t in marks]
        assert 0 < len(marks) <= PROFILE_POINTS and shares == sorted(shares)
        assert (PROFILE_POINTS - 1) / PROFILE_POINTS <= shares[-1] <= 1
        assert shares[0] >= 1 / PROFILE_POINTS and times == sorted(times)
        assert 0 <= times[0] and times[-1] <= plan["forward_ms"][i]
        record = handle.planner.records[i]  # and its bytes after each new span
        ends = record["span_ends"]
        assert ends == sorted(set(ends)) and ends[-1] == record["capped"] > 0


def _log_fetch_and_restore(monkeypatch, engine, log, key=lambda group: group):
    """Append ("fetch", key(group)) and ("restore", key(group)) to `log` as the engine does them."""
    fetch, restore = engine._fetch, engine._restore
    monkeypatch.setattr(engine, "_fetch", lambda group: (log.append(("fetch", key(group))), fetch(group))[1])
    monkeypatch.setattr(engine, "_restore",
                        lambda group, p: (log.append(("restore", key(group))), restore(group, p))[1])


def _scheduled(engine, n, **kw):
    from offload.activation.schedule import Schedule

    engine.use_plan(Schedule(n, kw.get("caps", [None] * n), kw.get("release_at", {}), kw.get("fetch_at", {}),
                             kw.get("fetch_at_start", []), kw.get("split_at", {})))


def test_activation_schedule_caps_and_fetch_points_bitwise(pool):
    """A schedule that offloads one layer in part: what it keeps stays on the device, every
    gradient is bitwise the same, and each group comes back at its backward point."""
    ref = _model(n=4)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = _step(ref, x)
    _step(model, x)
    full = handle.stats()
    _scheduled(handle.engine, 4, caps=[None, 2048, None, None], release_at={0: 2, 1: 4, 2: 5},
               fetch_at={3: [2], 2: [1], 1: [0]})
    for _ in range(2):
        loss, grads = _step(model, x)
        assert torch.equal(loss, loss_ref)
        _assert_equal(grads, grads_ref)
    stats = handle.stats()
    assert stats["groups_offloaded"] == 3 and stats["tensors_kept"] > full["tensors_kept"]
    assert 0 < stats["d2h_bytes"] < full["d2h_bytes"] and stats["h2d_bytes"] == stats["d2h_bytes"]
    assert stats["groups_prefetched"] == 3 and stats["groups_fetched"] == 3


@pytest.mark.parametrize("split_bytes", [256, 4096])
def test_activation_schedule_copies_a_layer_in_parts_while_it_runs(monkeypatch, split_bytes, pool):
    """A layer the schedule splits: its first part's copy is queued before the layer ends,
    views of one storage saved in several parts come back bitwise, and every part is fetched
    at its layer's backward point, a layer's last part first (backward needs it first)."""
    from offload.activation import engine as _activation

    ref = _model(n=4)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    engine = handle.engine
    ends = [k * split_bytes for k in range(1, 64)]
    _scheduled(engine, 4, release_at={0: [2, 3] * 32, 1: 4, 2: 4}, fetch_at={3: [2], 2: [1], 1: [0]},
               split_at={0: ends, 1: ends, 2: ends})
    log = []
    copy_spans = _activation.copy_spans_to_host
    monkeypatch.setattr(_activation, "copy_spans_to_host", lambda *a, **k: (log.append("copy"), copy_spans(*a, **k))[1])
    model.blocks[0].register_forward_hook(lambda *_: log.append("layer 0 ended"))
    _log_fetch_and_restore(monkeypatch, engine, log)
    closed = []  # groups in the order their copies were queued
    close = engine._close
    monkeypatch.setattr(engine, "_close", lambda group: (closed.append(group), close(group))[1])
    x = torch.randn(8, 16)
    loss_ref, grads_ref = _step(ref, x)
    for _ in range(2):
        log.clear()
        closed.clear()
        loss, grads = _step(model, x)
        assert torch.equal(loss, loss_ref)
        _assert_equal(grads, grads_ref)
        assert log.index("copy") < log.index("layer 0 ended")
        stats = handle.stats()
        assert stats["groups_offloaded"] > stats["layers_offloaded"] + 3 * (split_bytes == 256)
        assert stats["layers_offloaded"] == 3
        fetched = [e[1] for e in log if e[0] == "fetch"]
        # Each at its point, none on demand (a part whose tensors autograd dropped in forward
        # is freed with them, never fetched).
        assert len(fetched) == stats["groups_prefetched"] == stats["groups_fetched"] > 3 + 3 * (split_bytes == 256)
        assert [g.layer for g in fetched] == sorted((g.layer for g in fetched), reverse=True)
        for later, earlier in zip(fetched, fetched[1:]):
            if later.layer == earlier.layer:
                assert closed.index(later) > closed.index(earlier)
        restored = [e[1] for e in log if e[0] == "restore"]
        for group in restored:
            assert log.index(("fetch", group)) < log.index(("restore", group))
    handle.disable()


class _FusedQKV(nn.Module):
    """q, k and v: views of one projection's output, each reading all of it but a sliver."""

    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:-1], 3, -1).unbind(-2)
        return (q * k) * v  # saves q and k, then q * k and v


class _QKVModel(nn.Module):
    def __init__(self, d=16, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(_FusedQKV(d) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("mode", ["async", "auto"])
def test_activation_views_of_one_storage_copied_once_across_parts(mode, monkeypatch, pool):
    """A layer copied in parts, split right after q's save: k and v lie in the copy of the
    whole projection output made for q and share it, so the storage is copied once (its
    views reading nearly all of it copy all of it); gradients stay bitwise."""
    from offload.activation import engine as _activation

    torch.manual_seed(0)
    ref = _QKVModel()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, keep_last=0, pool=pool,
                                               verbose=False)
    engine = handle.engine
    if mode == "auto":  # the schedule's parts
        _scheduled(engine, 3, release_at={0: [2, 3]}, split_at={0: [1]})
    else:  # async mode's first layer in parts, as many as its saves allow
        monkeypatch.setattr(engine, "_first_layer_parts", lambda layer: [1])
    outputs = {}
    model.blocks[0].qkv.register_forward_hook(lambda m, i, out: outputs.update(qkv=out))
    copied, forward_done = [], [False]
    copy_spans = _activation.copy_spans_to_host

    def in_flight_through_forward(tensors, los, sizes, *args, **kwargs):
        """The copy, seen in flight until forward ends (a copy on the host is done at once;
        on a device the first part's was still running when k and v were saved)."""
        copied.append([(t.untyped_storage().data_ptr(), size) for t, size in zip(tensors, sizes)])
        handle = copy_spans(tensors, los, sizes, *args, **kwargs)
        ready = handle.ready
        handle.ready = lambda: forward_done[0] and ready()
        return handle

    monkeypatch.setattr(_activation, "copy_spans_to_host", in_flight_through_forward)
    model.register_forward_hook(lambda *_: forward_done.__setitem__(0, True))
    x = torch.randn(64, 16)
    loss_ref, grads_ref = _step(ref, x)
    loss, grads = _step(model, x)
    assert torch.equal(loss, loss_ref)
    _assert_equal(grads, grads_ref)
    qkv = outputs["qkv"].untyped_storage()
    of_qkv = [size for group in copied for ptr, size in group if ptr == qkv.data_ptr()]
    assert of_qkv == [qkv.nbytes()]
    assert len([group for group in copied if group]) >= 2  # the first layer went in parts
    handle.disable()


@pytest.mark.parametrize("case", ["whole", "parts", "tail"])
def test_activation_schedule_releases_on_the_device_at_its_points(monkeypatch, case):
    """The host never sees a copy done (it runs ahead of the device): each group's memory is
    still let go, at its planned point, by a wait on the device; no host wait; each group is
    fetched when backward reaches the layer the schedule names, before it is needed.
    `parts`: layer 0 is copied in two parts, each let go at its own point. `tail`: layer 1 is
    let go at the second tensor saved after the last layer (the head's), not at its end."""
    from offload.activation.schedule import TAIL_POINT

    parts = case == "parts"
    from offload.core import _backend

    clock = [0]
    compute, d2h, h2d = _FakeStream("compute"), _FakeStream("d2h"), _FakeStream("h2d")
    monkeypatch.setattr(_device, "new_event", lambda device=None, timing=False: _FakeEvent(clock))
    monkeypatch.setattr(_device, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(_device, "copy_streams", lambda device=None: (d2h, h2d))
    monkeypatch.setattr(offload.CopyHandle, "ready", lambda self: False)
    waits = []
    monkeypatch.setattr(offload.CopyHandle, "wait", lambda self: waits.append(self))
    ref = _model(n=4)
    model = copy.deepcopy(ref)
    with _backend.force_fallback():
        handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=offload.HostPool(),
                                                   verbose=False)
        engine = handle.engine
        engine.on_accel = engine.timing = True
        if parts:
            _scheduled(engine, 4, release_at={0: [1, 2], 1: 4, 2: 5}, fetch_at={3: [2], 2: [1], 1: [0]},
                       split_at={0: [512]})
        else:
            _scheduled(engine, 4, release_at={0: 2, 1: 4 + TAIL_POINT if case == "tail" else 4, 2: 5},
                       fetch_at={3: [2], 2: [1], 1: [0]})
            if case == "tail":
                engine.schedule.tail_save = 2
        log = []
        settle, saved_after = engine._mark_copied, engine._saved_after_layers

        def settled(group):
            log.append(("settle", group.layer, engine.backward_seen, max(engine._layer_groups)))
            settle(group)

        monkeypatch.setattr(engine, "_mark_copied", settled)
        monkeypatch.setattr(engine, "_saved_after_layers",
                            lambda: (log.append(("tail", engine._tail + 1)), saved_after()))
        _log_fetch_and_restore(monkeypatch, engine, log, lambda group: group.layer)
        x = torch.randn(8, 16)
        _, grads_ref = _step(ref, x)
        for _ in range(2):
            log.clear()
            _, grads = _step(model, x)
            _assert_equal(grads, grads_ref)
            # Layer 0 when layer 2 opens (layers 0 and 1 exist; in parts: its first part when
            # layer 1 opens), layer 1 after the last layer, layer 2 when backward starts.
            first = [("settle", 0, False, 0)] if parts else []
            assert [e for e in log if e[0] == "settle"] == first + [("settle", 0, False, 1), ("settle", 1, False, 2),
                                                                     ("settle", 2, True, 2)]
            tail = [e for e in log if e[0] == "tail"]
            if case == "tail":  # the head's Linear saves its input and weight, square() its input
                assert tail == [("tail", 1), ("tail", 2), ("tail", 3)]
                assert log.index(("tail", 2)) < log.index(("settle", 1, False, 2)) < log.index(("tail", 3))
            else:  # counted only where the schedule has a point there
                assert tail == []
            order = [e for e in log if e[0] not in ("settle", "tail")]
            assert [e[1] for e in order if e[0] == "fetch"] == [2, 1, 0] + [0] * parts
            for layer in (0, 1, 2):
                assert order.index(("fetch", layer)) < order.index(("restore", layer))
    assert waits == []
    stats = handle.stats()
    assert stats["forward_wait_seconds"] > 0 and stats["backward_wait_seconds"] > 0  # the device-side waits
    handle.disable()


@pytest.mark.parametrize("keep_handle", [True, False])
def test_activation_dropped_model_freed_without_gc(keep_handle, pool):
    """No reference cycle through the wrapped forwards: a model dropped without disable()
    frees its parameters at once (on a GPU its memory), not when the collector runs."""
    gc.collect()
    gc.disable()
    try:
        model = _model()
        handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
        _step(model, torch.randn(8, 16))
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

    model = _model()
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

    ref = _model()
    model = copy.deepcopy(ref)
    block = model.blocks[1]
    block.forward = functools.partial(type(block).forward, block)  # someone else's instance forward
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    for clone in _copies(model):
        with torch.no_grad():
            for p in clone.parameters():
                p.mul_(0.5)
        for m in [clone, *clone.blocks]:
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
        _assert_equal(_step(clone, x)[1], _step(halved, x)[1])
        assert mine.stats()["groups_offloaded"] == 3 and handle.stats()["groups_offloaded"] == before
        mine.disable()
        assert "forward" not in clone.__dict__ and "forward" not in clone.blocks[0].__dict__
        assert torch.equal(clone(x), halved(x))
    # The copy outlives the original and is freed without the cyclic collector.
    clone = copy.deepcopy(model)
    del model, block
    gc.collect()
    _assert_equal(_step(clone, x)[1], _step(ref, x)[1])
    gc.disable()
    try:
        refs = [weakref.ref(clone), weakref.ref(clone.blocks[0])]
        del clone
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_activation_step_search_bisects_to_the_largest_within_tolerance():
    from offload.activation.schedule import StepSearch

    def run(model_k, overhead_per_layer):
        search, probes = StepSearch(model_k, tolerance=0.03), []
        while search.probe is not None:
            probes.append(search.probe)
            search.record(search.probe, 100.0 * (1 + overhead_per_layer * search.probe), 100.0)
        return search.final, probes

    assert run(6, 0.001) == (6, [6, 6])  # the model's choice holds: checked, confirmed, kept
    assert run(6, 0.01) == (3, [6, 3, 4, 3])  # 3% allows 3 layers
    assert run(6, 0.5) == (0, [6, 3, 1])  # nothing hides: offload nothing
    assert run(0, 0.5) == (0, [])  # nothing to check
    with pytest.raises(RuntimeError, match="while probing"):
        StepSearch(4).record(2, 1.0, 1.0)

    # A count that looked fine once but runs 10% slower when timed again is not kept.
    search, probes, seen = StepSearch(2, tolerance=0.03), [], set()
    while search.probe is not None:
        k = search.probe
        probes.append(k)
        search.record(k, 100.0 if k not in seen else 110.0, 100.0)
        seen.add(k)
    assert (search.final, probes) == (1, [2, 2, 1])

    # Each count is judged against the baseline of its own probe, not an earlier one.
    search = StepSearch(2, tolerance=0.03)
    search.record(2, 108.0, 100.0)  # 8% over
    search.record(1, 110.0, 108.0)  # the machine slowed down: 1.9% over its own baseline
    search.record(1, 101.0, 100.0)  # confirmed
    assert search.final == 1 and search.baseline_ms == {2: 100.0, 1: 100.0}


class _StepClock:
    """Stands in for the planner's clock once the plan exists: a step takes 1 s plus
    `overhead` s per offloaded layer (what the probes read), whatever the host does; times
    `slow` during the planner's odd-numbered probes (a machine another tenant slows down
    now and then)."""

    def __init__(self, handle, overhead, slow=1.0):
        self.handle, self.overhead, self.slow = handle, overhead, slow

    def mark(self):
        return None

    def done(self, mark):
        return True

    def seconds(self, a, b):
        probe = next(iter(self.handle.planner.tuning.values()), None)  # the probe reading this step
        factor = self.slow if probe is not None and probe.serial % 2 else 1.0
        return factor * (1.0 + self.overhead * len(self.handle.offloaded_layers()))


@pytest.mark.parametrize("overhead, slow", [(0.02, 1.0), (1.0, 1.0), (0.02, 1.25)])
def test_activation_auto_backs_off_on_measured_steps(overhead, slow, pool, capsys):
    ref = _model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = _step(ref, x)
    for step in range(40):
        if step == 3:  # the plan was made at the start of step 2 (two measured steps)
            plan = handle.plan
            assert plan["tuning"]["checked"] and not plan["tuning"]["settled"]
            model_k = plan["tuning"]["model_layers"]
            handle.planner.clock = _StepClock(handle, overhead, slow)
        loss, grads = _step(model, x)
        assert torch.equal(loss, loss_ref)
        _assert_equal(grads, grads_ref)
    plan = handle.plan
    # 3% tolerance: 2% per layer allows one layer, 100% none.
    expected = min(model_k, 1) if overhead < 0.03 else 0
    assert plan["tuning"]["settled"] and sum(plan["mask"]) == expected, plan
    # Each probe's baseline ran without offload, in that probe's own minutes (`slow` or not).
    assert plan["tuning"]["baseline_ms"] and set(plan["tuning"]["baseline_ms"].values()) <= {1000.0, 1000.0 * slow}
    assert plan["offload"] == [n for n, m in zip(handle.layers, plan["mask"]) if m]
    assert "settled on" in capsys.readouterr().out
    stats = handle.stats()
    assert stats["layers_offloaded"] == expected
    if expected == 0:
        assert stats["tensors_kept"] == 0  # no hooks at all: a step exactly as without offload
    handle.disable()


class _LateClock(_StepClock):
    """Over the tolerance until the plan is made again (its copies ended late), within it after."""

    def seconds(self, a, b):
        plan = self.handle.plan
        self.overhead = 0.0 if plan is not None and "d2h_gbps_replanned" in plan else 1.0
        return super().seconds(a, b)


@pytest.mark.parametrize("why", ["slower", "late"])
def test_activation_auto_plans_again_when_copies_run_slower(why, pool, monkeypatch, capsys):
    """After the first probe, the copies' rate under the plan's compute (here 1/10,000 of the
    rate measured while measuring: these small layers copy faster than they run), or a probe
    over the tolerance whose copies, at the planned rate, the compute stream waited for at the
    release points (here 10,000 times their own time), make the schedule again at a lower
    rate, and the search starts over."""
    from offload.activation import planner as _activation_plan
    from offload.activation.planner import AutoPlanner
    from offload.activation.schedule import planned_bytes

    seen = []

    def rate(planner, copies):
        seen.append(len(copies))
        d2h = planner.tuning[planner.key].d2h
        return d2h / 1e4 if why == "slower" else d2h

    monkeypatch.setattr(AutoPlanner, "_copy_rate", rate)
    monkeypatch.setattr(_activation_plan, "_copies_late", lambda copies: 0.0 if why == "slower" else 1e4)
    model = _model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = _step(_model(), x)
    planned = None
    for step in range(60):
        plan = handle.plan
        if plan is not None and planned is None:
            planned = planned_bytes(plan["layer_bytes"], plan["model_mask"], plan["caps"])
            d2h = plan["d2h_gbps"]
            handle.planner.clock = _StepClock(handle, 0.0) if why == "slower" else _LateClock(handle, 1.0)
        loss, grads = _step(model, x)
        assert torch.equal(loss, loss_ref)
        _assert_equal(grads, grads_ref)
        if plan is not None and plan["tuning"]["settled"]:
            break
    # Once: the offloading steps of the first probe (a warm-up and three timed).
    assert seen == [4]
    if why == "slower":
        assert plan["d2h_gbps_under_compute"] == pytest.approx(d2h / 1e4)
        assert plan["d2h_gbps_replanned"] == pytest.approx(d2h / 1e4)
    else:
        assert plan["d2h_gbps_under_compute"] == pytest.approx(d2h)
        assert plan["d2h_gbps_replanned"] == pytest.approx(d2h / (1 + 1e4))
    assert planned_bytes(plan["layer_bytes"], plan["model_mask"], plan["caps"]) < planned
    assert plan["tuning"]["settled"] and sum(plan["mask"]) == plan["tuning"]["model_layers"]
    assert "under the plan's compute" in capsys.readouterr().out
    handle.disable()


def test_activation_auto_reads_the_usual_step_of_a_probe(pool):
    """The copies' rate and lateness of a probe are those of its usual step (the median over
    its offloading steps): one step whose copies ran slow and waited does not make the plan
    again; steps without timed copies are left out."""
    from offload.activation.planner import AutoPlanner, _copies_late

    def step(moved, seconds, waited):
        return {"d2h_bytes": moved, "d2h_seconds": seconds, "forward_wait_seconds": waited}

    usual = [step(100, 1.0, 0.01), step(100, 1.0, 0.0), step(100, 1.25, 0.02)]
    slow = step(100, 2.0, 1.0)  # half the rate, waiting half its copies' time
    untimed = step(0, 0.0, 0.0)
    assert _copies_late(usual + [slow, untimed]) == pytest.approx((0.01 + 0.016) / 2)
    assert _copies_late([untimed]) == 0.0
    handle = offload.enable_activation_offload(_model(), "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    rate = AutoPlanner._copy_rate(handle.planner, usual + [slow, untimed])
    assert rate == pytest.approx((100.0 + 80.0) / 2)  # between the 1.0 s and 1.25 s steps
    assert AutoPlanner._copy_rate(handle.planner, [untimed]) is None
    handle.disable()


@pytest.mark.parametrize("late, overhead", [(1e4, 0.0), (None, 1.0)])
def test_activation_auto_late_copies_keep_the_plan(late, overhead, pool, monkeypatch):
    """No new schedule for copies at the planned rate where the first probe is within the
    tolerance however late they ended (the waits fit in what the 3% is for), nor where it
    missed with waits within RELEASE_WAIT_TOLERANCE of their time (then the search backs off)."""
    from offload.activation import planner as _activation_plan
    from offload.activation.planner import AutoPlanner

    late = _activation_plan.RELEASE_WAIT_TOLERANCE if late is None else late
    monkeypatch.setattr(AutoPlanner, "_copy_rate", lambda planner, copies: planner.tuning[planner.key].d2h)
    monkeypatch.setattr(_activation_plan, "_copies_late", lambda copies: late)
    model = _model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    for step in range(60):
        plan = handle.plan
        if plan is not None and plan["tuning"]["settled"]:
            break
        if plan is not None:
            handle.planner.clock = _StepClock(handle, overhead)
        _step(model, x)
    assert plan["tuning"]["settled"]
    assert "d2h_gbps_replanned" not in plan
    # Within the tolerance: the model's count; over it at every count: none.
    assert sum(plan["mask"]) == (plan["tuning"]["model_layers"] if overhead == 0.0 else 0)
    assert plan["tuning"]["model_layers"] > 0
    handle.disable()


@pytest.mark.parametrize("mode", MODES)
def test_activation_paused_step_runs_without_offload(mode, pool):
    ref = _model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = _step(ref, x)
    for _ in range(4):
        _step(model, x)
    before = handle.stats()
    plan = handle.plan
    with handle.paused():
        with pytest.raises(RuntimeError, match="already paused"):
            with handle.paused():
                pass
        loss, grads = _step(model, x)
    assert torch.equal(loss, loss_ref)
    _assert_equal(grads, grads_ref)
    assert handle.stats() == before  # the paused step saw no hook: nothing counted
    loss, grads = _step(model, x)
    assert torch.equal(loss, loss_ref)
    _assert_equal(grads, grads_ref)
    assert handle.plan is plan and not handle._paused
    if mode != "auto":
        assert handle.stats()["groups_offloaded"] == before["groups_offloaded"] > 0
    handle.disable()


@pytest.mark.parametrize("idle_gbps, expected", [(1e6, (1e6, 1e6)), (1.0, (5.0, 6.0))])
def test_activation_auto_schedule_starts_from_the_faster_bus_reading(idle_gbps, expected, pool, monkeypatch):
    """Without a budget the schedule takes the faster of the first measuring step's copies
    (here 5 and 6 GB/s) and an idle copy each way."""
    from offload.activation import planner as _activation_plan

    monkeypatch.setattr(_activation_plan, "probe_bandwidth", lambda device: (idle_gbps * 1e9, idle_gbps * 1e9))
    model = _model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    stats = handle.engine.stats
    monkeypatch.setattr(handle.engine, "stats", lambda: {**stats(), "d2h_gbps": 5.0, "h2d_gbps": 6.0})
    for _ in range(3):
        _step(model, torch.randn(8, 16))
    assert (handle.plan["d2h_gbps"], handle.plan["h2d_gbps"]) == pytest.approx(expected)
    handle.disable()


def test_activation_bad_arguments(pool):
    with pytest.raises(ValueError, match="no submodules and no parameters"):
        offload.enable_activation_offload(nn.Module())
    with pytest.raises(ValueError, match="found no layers"):
        offload.enable_activation_offload(nn.Sequential(nn.Linear(2, 2)))
    model = _model()
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
    ref = _model()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        for block in m.blocks:
            block.compile(backend="aot_eager")
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = _step(ref, x)
    loss, grads = _step(model, x)
    assert torch.equal(loss, loss_ref)
    _assert_equal(grads, grads_ref)
    assert handle.stats()["tensors_offloaded"] > 0


def test_activation_compiled_model_warns_and_passes_through(pool):
    ref = _model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    compiled = torch.compile(model, backend="aot_eager")
    offload.activation.api._warned_compiled.clear()
    x = torch.randn(8, 16)
    with pytest.warns(UserWarning, match="traced by torch.compile"):
        loss = compiled(x)
    loss.backward()
    assert torch.equal(loss, ref(x))
    assert handle.stats()["groups_offloaded"] == 0


def _shard(kind, model):
    from torch.distributed import fsdp

    if kind == "fsdp1":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return fsdp.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                             device_id=torch.device("cpu"), use_orig_params=True)
    for block in model.blocks:
        # Unsharded parameters stay allocated through the step, so the check below
        # compares live storages only.
        fsdp.fully_shard(block, reshard_after_forward=False)
    fsdp.fully_shard(model, reshard_after_forward=False)
    return model


def _full_grads(kind, model):
    if kind == "fsdp2":
        return [p.grad.full_tensor() for p in model.parameters()]
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_activation_fsdp_single_process(kind, pool, monkeypatch, tmp_path):
    """FSDP units are the layers; unsharded parameters are never offloaded (gloo, CPU)."""
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or (kind == "fsdp2" and not hasattr(fsdp, "fully_shard")) or (
            kind == "fsdp1" and not hasattr(fsdp, "FullyShardedDataParallel")):
        pytest.skip(f"needs torch.distributed with {kind}")
    # A file rendezvous: a port found by binding and releasing it can be taken by another process first.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        ref = _shard(kind, _model())
        model = _shard(kind, _model())
        clashes, offloaded = [], []
        real_pack = act.ActivationEngine.pack_extent  # what may be offloaded, on either hooks' path

        def spy(self, t, *extent):
            packed = real_pack(self, t, *extent)
            if type(packed) is not tuple:  # offloaded: compare with the parameters as they are now
                live = act.storage_ptrs(model.parameters())
                offloaded.append(t)
                if t.untyped_storage().data_ptr() in live:
                    clashes.append(tuple(t.shape))
            return packed

        monkeypatch.setattr(act.ActivationEngine, "pack_extent", spy)
        handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
        prefix = "_fsdp_wrapped_module." if kind == "fsdp1" else ""
        assert handle.layers == [f"{prefix}blocks.{i}" for i in range(4)]
        x = torch.randn(8, 16)
        for _ in range(2):
            for m in (ref, model):
                m.zero_grad()
                m(x).backward()
            _assert_equal(_full_grads(kind, ref), _full_grads(kind, model))
        assert offloaded and not clashes
        assert handle.stats()["layers_offloaded"] == 3
    finally:
        dist.destroy_process_group()


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _model()

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("shard_root", [False, True])
def test_activation_fsdp2_nested_units_are_the_innermost(shard_root, pool, tmp_path):
    """fully_shard on each block and on a module holding them: the blocks are the layers
    (was: the holding unit, the only layer, kept as the last one: nothing offloaded)."""
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or not hasattr(fsdp, "fully_shard"):
        pytest.skip("needs torch.distributed with fully_shard (FSDP2)")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        ref, model = _Outer(), _Outer()
        for m in (ref, model):
            for block in m.inner.blocks:
                fsdp.fully_shard(block, reshard_after_forward=False)
            fsdp.fully_shard(m.inner, reshard_after_forward=False)
            if shard_root:
                fsdp.fully_shard(m, reshard_after_forward=False)
        handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool, verbose=False)
        assert handle.layers == [f"inner.blocks.{i}" for i in range(4)]
        x = torch.randn(8, 16)
        for m in (ref, model):
            m(x).backward()
        _assert_equal(_full_grads("fsdp2", ref), _full_grads("fsdp2", model))
        assert handle.stats()["groups_offloaded"] == 3
    finally:
        dist.destroy_process_group()


def test_activation_warns_when_nothing_can_be_offloaded(pool):
    """keep_first + keep_last covering every layer, or an auto budget that cannot be met."""
    with pytest.warns(UserWarning, match=r"nothing will be offloaded: keep_first=2 \+ keep_last=2 keep all 4"):
        handle = offload.enable_activation_offload(_model(), keep_first=2, keep_last=2, pool=pool)
    assert handle.offloaded_layers() == []


def test_activation_auto_warns_when_the_budget_cannot_be_met(pool, monkeypatch, capsys):
    monkeypatch.setattr(_device, "max_memory_allocated", lambda device=None: 1 << 30)  # peak 1 GiB
    model = _model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, memory_budget_bytes="1MiB",
                                               pool=pool)
    with pytest.warns(UserWarning, match="cannot meet memory_budget_bytes=1048576"):
        for _ in range(3):
            _step(model, torch.randn(8, 16))
    assert handle.plan["budget_met"] is False and handle.plan["mask"] == [True, True, True, False]
    assert "does NOT meet memory_budget_bytes=1048576" in capsys.readouterr().out
    import warnings

    with warnings.catch_warnings():  # once per handle
        warnings.simplefilter("error")
        _step(model, torch.randn(6, 16))
        _step(model, torch.randn(6, 16))
        _step(model, torch.randn(6, 16))


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
    for _ in range(_steps(mode)):
        x = torch.randn(4, 8)
        loss_ref, grads_ref = _step(ref, x)
        loss, grads = _step(model, x)
        assert torch.equal(loss, loss_ref)
        _assert_equal(grads, grads_ref)
        offloaded.append(handle.stats()["layers_offloaded"])
    assert offloaded[0] == 2 and offloaded[-1] == len(handle.offloaded_layers())


class _FakeEvent:
    def __init__(self, clock):
        self.clock, self.at = clock, None

    def record(self, stream):
        self.clock[0] += 1
        self.at = self.clock[0]
        stream.log.append("record")

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return float(other.at - self.at)


class _FakeStream:
    def __init__(self, name):
        self.name, self.log = name, []

    def wait_stream(self, other):
        self.log.append(f"wait_stream {other.name}")

    def wait_event(self, event):
        self.log.append("wait_event")


def test_activation_stream_paths_with_fake_streams(monkeypatch):
    """The accelerator-only branches (timed waits, copy timings) run against fakes on a CPU.

    On the pure-PyTorch copy path: the compiled core takes only real streams.
    """
    from offload.core import _backend, _device

    with _backend.force_fallback():
        _fake_stream_step(offload.HostPool(), monkeypatch, _device)


def _fake_stream_step(pool, monkeypatch, _device):
    clock = [0]
    compute, d2h, h2d = _FakeStream("compute"), _FakeStream("d2h"), _FakeStream("h2d")
    monkeypatch.setattr(_device, "new_event", lambda device=None, timing=False: _FakeEvent(clock))
    monkeypatch.setattr(_device, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(_device, "copy_streams", lambda device=None: (d2h, h2d))
    ref = _model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, nvtx=True)
    handle.engine.on_accel = handle.engine.timing = True
    x = torch.randn(8, 16)
    _, grads_ref = _step(ref, x)
    for _ in range(2):
        _, grads = _step(model, x)
        _assert_equal(grads, grads_ref)
    stats = handle.stats()
    assert stats["d2h_seconds"] > 0 and stats["h2d_seconds"] > 0 and stats["backward_wait_seconds"] > 0
    assert stats["d2h_gbps"] > 0 and stats["groups_prefetched"] >= 1
    # The copies order themselves after compute and time themselves (the copy layer's
    # handles); the engine's own events time the compute stream's waits for them.
    assert not d2h.log and not h2d.log
    assert compute.log.count("record") >= 2


def _async_logging_fetches(monkeypatch, pool, **model_kw):
    """(model with an async handle whose fetches and restores go to `log`, handle, log, x,
    the reference gradients of a copy without offload)."""
    ref = _model(**model_kw)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    log = []
    _log_fetch_and_restore(monkeypatch, handle.engine, log)
    x = torch.randn(8, 16)
    _, grads_ref = _step(ref, x)
    return model, handle, log, x, grads_ref


def test_activation_backward_prefetches_before_the_first_offloaded_group(pool, monkeypatch):
    """Backward first runs the kept last layer and the head: the last offloaded group's copy
    back is issued at the step's first unpack, not when backward reaches that group."""
    model, handle, log, x, grads_ref = _async_logging_fetches(monkeypatch, pool)
    for _ in range(2):
        log.clear()
        _, grads = _step(model, x)
        _assert_equal(grads, grads_ref)
        assert log[0][0] == "fetch" and log[1] == ("restore", log[0][1])  # fetched before backward reached it
        fetched = [group for what, group in log if what == "fetch"]
        # blocks 0-2, each group once (block 0 in parts from the second step); block 3 is kept
        assert len(fetched) == len(set(map(id, fetched))) == handle.stats()["groups_offloaded"]
        assert [group.layer for group in fetched if not group.continued] == [2, 1, 0]
    assert handle.stats()["groups_prefetched"] == handle.stats()["groups_fetched"] > 3


@pytest.mark.parametrize("ckpt", [None, "non_reentrant"])
def test_activation_async_copies_the_first_layer_in_parts(pool, monkeypatch, ckpt):
    """Async mode: from the second forward the first offloaded layer is copied in SPLIT_PARTS
    parts of the bytes it saved before, and in backward all its parts are fetched together at
    the next layer's first unpack, its last part first; a layer that saves fewer spans than
    parts (a checkpoint's input) is not split. Gradients stay bitwise equal."""
    from offload.activation.schedule import SPLIT_PARTS

    model, handle, log, x, grads_ref = _async_logging_fetches(monkeypatch, pool, ckpt=ckpt)
    engine = handle.engine
    for step in range(3):
        log.clear()
        _, grads = _step(model, x)
        _assert_equal(grads, grads_ref)
        stats = handle.stats()
        assert stats["layers_offloaded"] == 3
        split = ckpt is None and step > 0
        assert stats["groups_offloaded"] == 3 + (SPLIT_PARTS - 1) * split
        fetched = [group for what, group in log if what == "fetch"]
        assert len(fetched) == len(set(map(id, fetched))) == stats["groups_offloaded"]
        first = [group for group in fetched if group.layer == 0]
        assert len(first) == (SPLIT_PARTS if split else 1)
        # The parts: each its own bytes, the last one saved fetched first, all before any is restored.
        assert [group.part for group in first] == list(reversed(range(len(first))))
        assert [group.continued for group in first] == [True] * (len(first) - 1) + [False]
        at = log.index(("fetch", first[-1]))
        assert all(what == "fetch" or group.layer != 0 for what, group in log[:at])
    if ckpt is None:  # split where the parts' bytes say (a quarter each of the layer's spans, in order)
        assert engine._layer_sizes[0][1] >= SPLIT_PARTS


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("ckpt", [None, "non_reentrant"])
def test_activation_small_layers_share_a_group(pool, monkeypatch, mode, ckpt):
    """A layer that offloads less than min_group_bytes goes on in one group with the next
    ones, until the group holds that much: blocks 0 and 1 share one, block 2 has its own.
    Every layer is still offloaded, each group copied out and back once, gradients bitwise."""
    ref = _model(ckpt=ckpt)
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    _, grads_ref = _step(ref, x)
    probe = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    _step(model, x)
    layer_bytes = probe.engine._layer_sizes[0][0]
    assert probe.engine.min_group_bytes == 0 and probe.stats()["groups_offloaded"] == 3
    probe.disable()
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, min_group_bytes=layer_bytes + 1,
                                               pool=pool, verbose=False)
    log = []
    _log_fetch_and_restore(monkeypatch, handle.engine, log)
    for _ in range(2):
        log.clear()
        _, grads = _step(model, x)
        _assert_equal(grads, grads_ref)
        stats = handle.stats()
        assert stats["layers_offloaded"] == 3 and stats["groups_offloaded"] == 2
        fetched = [group for what, group in log if what == "fetch"]
        assert [(group.layer, group.n_layers) for group in fetched] == [(2, 1), (0, 2)]
        assert stats["h2d_bytes"] == stats["d2h_bytes"] >= 3 * layer_bytes - 3 * 512
    del fetched
    log.clear()  # the groups it holds hold their host blocks
    handle.disable()
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0


@pytest.mark.parametrize("resident", [1, 2])
def test_activation_backward_start_prefetch_counts_layers(pool, resident):
    """The fetch as backward starts stays within the window counted in layers: a group of two
    small layers is brought back then only if two layers fit, else at the first unpack."""
    ref = _model(n=5)
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    _, grads_ref = _step(ref, x)
    probe = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool, verbose=False)
    _step(model, x)
    layer_bytes = max(size for size, _ in probe.engine._layer_sizes.values())
    probe.disable()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, min_group_bytes=layer_bytes + 1,
                                               resident_groups=resident, pool=pool, verbose=False)
    _, grads = _step(model, x)
    _assert_equal(grads, grads_ref)
    stats = handle.stats()
    assert stats["layers_offloaded"] == 4 and stats["groups_offloaded"] == 2 and stats["groups_fetched"] == 2
    # (2, 3) as backward starts only if its two layers fit; (0, 1) always at (2, 3)'s first unpack
    assert stats["groups_prefetched"] == (2 if resident == 2 else 1)
    handle.disable()


def test_activation_min_group_bytes_default_and_errors(pool):
    model = _model()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=1000, pool=pool, verbose=False)
    assert handle.engine.min_group_bytes == act.GROUP_BYTES_PER_TENSOR_BYTE * 1000
    handle.disable()
    for bad, error in ((-1, ValueError), (True, TypeError), (1.5, TypeError), ("32MiB", TypeError)):
        with pytest.raises(error, match=r"enable_activation_offload: min_group_bytes must be an int >= 0"):
            offload.enable_activation_offload(model, min_group_bytes=bad, pool=pool, verbose=False)


def test_activation_auto_keeps_one_group_a_layer(pool):
    """Auto mode measures and plans layer by layer: min_group_bytes does not merge its groups."""
    model = _model(n=4)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, min_group_bytes=1 << 40,
                                               pool=pool, verbose=False)
    x = torch.randn(8, 16)
    for _ in range(3):
        _step(model, x)
    plan = handle.plan
    assert plan is not None and all(b > 0 for b in plan["layer_bytes"][:3])
    handle.disable()


def test_activation_autocast_weight_casts_stay(pool, monkeypatch):
    """Under autocast the cached bf16 copies of parameters are kept, activations offloaded."""
    model = _model()
    offloaded = []
    real_pack = act.ActivationEngine.pack_extent  # what may be offloaded, on either hooks' path

    def spy(self, t, *extent):
        packed = real_pack(self, t, *extent)
        if type(packed) is not tuple:
            offloaded.append(t)
        return packed

    monkeypatch.setattr(act.ActivationEngine, "pack_extent", spy)
    x = torch.randn(8, 16)
    saved_ref = []
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved_ref.append(t) or t, lambda t: t):
        loss_ref = _model()(x)
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


def test_activation_respects_outer_hooks(pool):
    """Inside someone else's saved-tensor hooks (save_on_cpu around the model) offload steps aside."""
    ref = _model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    _, grads_ref = _step(ref, x)
    with torch.autograd.graph.save_on_cpu():
        loss = model(x)
    loss.backward()
    _assert_equal(_grads(model), grads_ref)
    assert handle.stats()["groups_offloaded"] == 0


def test_activation_backward_inside_the_block(pool):
    """Backward run inside the `with` (reentrant recomputation saves again): nothing is packed twice."""
    ref = _model(ckpt="reentrant")
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    _, grads_ref = _step(ref, x)
    with offload.activation_offload(min_tensor_bytes=0, pool=pool) as ao:
        loss = model(x)
        ao.boundary()
        loss.backward()
    _assert_equal(_grads(model), grads_ref)
    assert ao.stats()["groups_fetched"] >= 1


@pytest.mark.parametrize("resident", [1, 2, 3])
def test_activation_copies_in_flight_served_from_device(resident, pool, monkeypatch):
    """Copies that never report done (a slow bus): the window waits for the oldest, and the
    groups still in flight when backward starts are served from their device tensors."""
    monkeypatch.setattr(offload.CopyHandle, "ready", lambda self: False)
    ref = _model(n=6)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, resident_groups=resident,
                                               pool=pool)
    x = torch.randn(8, 16)
    for m in (ref, model):
        loss = m(x)
        loss.backward(retain_graph=True)
        loss.backward()  # the second pass finds every group on the host
    _assert_equal(_grads(model), _grads(ref))
    stats = handle.stats()
    assert stats["groups_offloaded"] == 5
    # First backward: the last resident-1 groups come from the device; second: all from the host.
    assert stats["groups_fetched"] == (5 - (resident - 1)) + 5


class _CountingEvent(_FakeEvent):
    def synchronize(self):
        self.clock[1] += 1  # a host wait


@pytest.mark.parametrize("kind", ["auto_none", "auto_some", "async", "async_checkpoint"])
def test_activation_steady_step_never_blocks_the_host(kind, monkeypatch):
    """Once auto mode has settled, and in every async step whose copies are done when looked
    at, no host synchronisation happens (accelerator branches run against fakes): on a
    launch-bound model each one would stop the host running ahead of the device."""
    from offload.core import _backend

    clock = [0, 0]  # event clock, host waits
    compute, d2h, h2d = _FakeStream("compute"), _FakeStream("d2h"), _FakeStream("h2d")
    monkeypatch.setattr(_device, "new_event", lambda device=None, timing=False: _CountingEvent(clock))
    monkeypatch.setattr(_device, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(_device, "copy_streams", lambda device=None: (d2h, h2d))
    monkeypatch.setattr(_device, "synchronize", lambda device=None: clock.__setitem__(1, clock[1] + 1))
    waits = []
    monkeypatch.setattr(offload.CopyHandle, "wait", lambda self: waits.append(self))
    ref = _model(n=5, ckpt="nonreentrant" if kind == "async_checkpoint" else None)
    model = copy.deepcopy(ref)
    mode = "auto" if kind.startswith("auto") else "async"
    with _backend.force_fallback():
        handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=offload.HostPool(),
                                                   verbose=False)
        handle.engine.on_accel = handle.engine.timing = True
        x = torch.randn(8, 16)
        _, grads_ref = _step(ref, x)
        for _ in range(max_tuning_steps(len(handle.layers)) if mode == "auto" else 2):
            if mode == "auto" and handle.plan is not None and not isinstance(handle.planner.clock, _StepClock):
                handle.planner.clock = _StepClock(handle, 1.0 if kind == "auto_none" else 0.02)
            _step(model, x)
        assert mode != "auto" or handle.plan["tuning"]["settled"]
        clock[1] = 0
        waits.clear()
        records = clock[0]
        for _ in range(3):
            _, grads = _step(model, x)
            _assert_equal(grads, grads_ref)
    assert clock[1] == 0 and waits == []
    if kind == "auto_none":
        # Nothing offloaded: the layers run their own forwards, no hook, no boundary, no event.
        assert sum(handle.plan["mask"]) == 0 and handle.stats()["tensors_kept"] == 0
        assert all("forward" not in block.__dict__ for block in model.blocks)
        assert clock[0] == records
    else:
        assert handle.stats()["groups_offloaded"] >= 1
    handle.disable()
    assert all("forward" not in block.__dict__ for block in model.blocks) and "forward" not in model.__dict__
