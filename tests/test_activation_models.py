"""Activation offload on whole models on the CPU path: gradients bitwise equal to no offload (Llama, checkpointing, FSDP)."""

import copy
import gc

import pytest
import torch
from torch import nn

import offload
from offload.core import _device
from offload.activation.saved_tensors import storage_ptrs
from _activation_helpers import (  # noqa: F401 (fixtures: one_thread, pool)
    AUTO_MEASURING_STEPS, Block, MODES, assert_bitwise_equal, grads_of, one_thread, pool, small_model, steps_to_run,
    spy_offloaded, train_step,
)
from _workers import gloo_world  # noqa: F401 (fixture)

# These tests run models on the CPU, whose activations are host memory already:
# where an accelerator exists the engine rightly leaves them alone, and
# test_activation_cuda.py covers the GPU.
pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)


@pytest.mark.parametrize("mode", MODES)
def test_activation_blocks_bitwise(mode, backend, pool):
    ref = small_model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(ref, x)
    for _ in range(AUTO_MEASURING_STEPS + 1):  # auto measures, then runs its plan
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
    stats = handle.stats()
    # The last of 4 layers stays by default; auto mode's schedule copies the first in parts,
    # and so does async mode once a forward has shown the first layer's size. Auto mode keeps
    # the layer before the last too: its group could come back only in the last layer's
    # backward, before the step's peak (Note [backward's room]).
    offloaded = ["blocks.0", "blocks.1"] if mode == "auto" else ["blocks.0", "blocks.1", "blocks.2"]
    assert stats["offloaded_layers"] == offloaded
    assert stats["layers_offloaded"] == len(offloaded)
    assert stats["groups_offloaded"] == 3 if mode == "sync" else stats["groups_offloaded"] > 3
    assert stats["d2h_bytes"] > 0 and stats["h2d_bytes"] == stats["d2h_bytes"]
    assert stats["tensors_offloaded"] > 20
    handle.disable()
    assert "forward" not in model.__dict__ and all("forward" not in b.__dict__ for b in model.blocks)
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0


def _llama(layers):
    """A Llama-architecture model from a tiny config, random weights (no download)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


@pytest.mark.parametrize("mode", MODES)
def test_activation_llama_bitwise(mode, pool):
    ref = _llama(3)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    assert handle.layers == ["model.layers.0", "model.layers.1", "model.layers.2"]
    offloaded = []
    for _ in range(steps_to_run(mode)):
        ids = torch.randint(0, 64, (2, 12))
        losses = []
        for m in (ref, model):
            m.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[1], losses[0])
        assert_bitwise_equal(grads_of(model), grads_of(ref))
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
    assert_bitwise_equal(grads_of(model), grads_of(ref))
    # Only the checkpoint inputs are offloaded: far fewer tensors and bytes than without checkpointing.
    with_ckpt, without = handle.stats(), h_plain.stats()
    assert 0 < with_ckpt["tensors_offloaded"] <= 6 * 3
    assert with_ckpt["d2h_bytes"] < without["d2h_bytes"] / 3


@pytest.mark.parametrize("ckpt", ["reentrant", "non_reentrant", "wrapper"])
def test_activation_checkpoint_variants(ckpt, pool):
    if ckpt == "wrapper":
        wrapper_mod = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
        ref = small_model()
        for i, block in enumerate(ref.blocks):
            ref.blocks[i] = wrapper_mod.checkpoint_wrapper(block)
    else:
        ref = small_model(ckpt=ckpt)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(ref, x)
    for _ in range(2):
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
    stats = handle.stats()
    assert stats["groups_offloaded"] >= 2
    assert stats["tensors_offloaded"] <= 3 * 2  # the checkpoint inputs (and its dummy), not the activations


def needs_fsdp(kind: str) -> None:
    """Skip where this torch has no FSDP of `kind` ("fsdp1", "fsdp2")."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if (kind == "fsdp2" and not hasattr(fsdp, "fully_shard")) or (
            kind == "fsdp1" and not hasattr(fsdp, "FullyShardedDataParallel")):
        pytest.skip(f"needs torch.distributed with {kind}")


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


def fsdp_steps_match(kind, handle, ref, model) -> str:
    """The handle's layers are the four blocks (FSDP1 names them through its wrapper), and two
    steps' gradients are bitwise those of `ref`; returns the layers' name prefix."""
    prefix = "_fsdp_wrapped_module." if kind == "fsdp1" else ""
    assert handle.layers == [f"{prefix}blocks.{i}" for i in range(4)]
    x = torch.randn(8, 16)
    for _ in range(2):
        for m in (ref, model):
            m.zero_grad()
            m(x).backward()
        assert_bitwise_equal(_full_grads(kind, ref), _full_grads(kind, model))
    return prefix


def _full_grads(kind, model):
    if kind == "fsdp2":
        return [p.grad.full_tensor() for p in model.parameters()]
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_activation_fsdp_single_process(kind, pool, monkeypatch, gloo_world):
    """FSDP units are the layers; unsharded parameters are never offloaded (gloo, CPU)."""
    needs_fsdp(kind)
    ref = _shard(kind, small_model())
    model = _shard(kind, small_model())
    clashes, offloaded = [], []

    def spy(t):  # offloaded: compare with the parameters as they are now
        live = storage_ptrs(model.parameters())
        offloaded.append(t)
        if t.untyped_storage().data_ptr() in live:
            clashes.append(tuple(t.shape))

    spy_offloaded(monkeypatch, spy)  # on either hooks' path
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool)
    fsdp_steps_match(kind, handle, ref, model)
    assert offloaded and not clashes
    assert handle.stats()["layers_offloaded"] == 3


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = small_model()

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("shard_root", [False, True])
def test_activation_fsdp2_nested_units_are_the_innermost(shard_root, pool, gloo_world):
    """fully_shard on each block and on a module holding them: the blocks are the layers
    (was: the holding unit, the only layer, kept as the last one: nothing offloaded)."""
    needs_fsdp("fsdp2")
    from torch.distributed import fsdp

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
    assert_bitwise_equal(_full_grads("fsdp2", ref), _full_grads("fsdp2", model))
    assert handle.stats()["groups_offloaded"] == 3
