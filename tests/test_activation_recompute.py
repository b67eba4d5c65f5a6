"""Recompute (a layer's forward under a non-reentrant checkpoint, its inputs offloaded) on the CPU
path: gradients bitwise equal to the plain model; auto mode with a budget choosing it."""

import copy

import pytest
import torch
from torch import nn

import offload
from offload.activation.auto import budget_plan
from offload.core import _device
from _activation_helpers import (  # noqa: F401 (fixtures: one_thread, pool)
    assert_bitwise_equal, assert_step_matches, grads_of, one_thread, pool, predicted_peak_keeping_all, small_model,
    train_step,
)
from _workers import gloo_world  # noqa: F401 (fixture)
from test_activation_models import _llama, _shard, fsdp_steps_match, needs_fsdp

pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)

RECOMPUTE = [True, False, True, False]  # layers 0 and 2 recomputed, 1 offloaded, the last kept


def _recomputing(model, pool, recompute=RECOMPUTE, **kw):
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False, **kw)
    handle.set_recomputed(recompute[:len(handle.layers)])
    return handle


def blocks_recompute_matches(device, pool, batch=8):
    """Layers 0 and 2 recomputed, 1 offloaded, on `device`: two steps' loss and gradients
    bitwise equal to the plain model's; (handle, reference model, input) for further checks."""
    ref = small_model().to(device)
    model = copy.deepcopy(ref)
    handle = _recomputing(model, pool)
    x = torch.randn(batch, 16, device=device)
    loss_ref, grads_ref = train_step(ref, x)
    for _ in range(2):
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
    assert handle.stats()["recomputed_layers"] == ["blocks.0", "blocks.2"]
    return handle, ref, x


def test_activation_recompute_blocks_bitwise(pool):
    handle, ref, x = blocks_recompute_matches(torch.device("cpu"), pool)
    stats = handle.stats()
    # Recomputed layers offload only their inputs: fewer tensors than offloading all three layers.
    plain_model = copy.deepcopy(ref)
    plain = _recomputing(plain_model, pool, recompute=[False] * 4)
    train_step(plain_model, x)
    assert 0 < stats["tensors_offloaded"] < plain.stats()["tensors_offloaded"]


class _DropoutBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.out(self.drop(torch.relu(self.lin(x))))


class _DropoutModel(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(_DropoutBlock(d) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_activation_recompute_dropout_same_rng_bitwise(pool):
    model, ref, x = dropout_recompute_matches(torch.device("cpu"), pool)
    # The RNG after the step is where it is without recompute (the recomputation restores it).
    torch.manual_seed(3)
    train_step(ref, x)
    after_ref = torch.rand(8)
    torch.manual_seed(3)
    train_step(model, x)
    assert torch.equal(torch.rand(8), after_ref)


def dropout_recompute_matches(device, pool):
    """Dropout layers recomputed on `device`: each step's loss and gradients bitwise equal to the
    plain model's under the same seed; (offloaded model, reference, input) for further checks."""
    torch.manual_seed(0)
    ref = _DropoutModel().train().to(device)
    model = copy.deepcopy(ref)
    _recomputing(model, pool)
    x = torch.randn(8, 16, device=device)
    for seed in (1, 2):
        torch.manual_seed(seed)
        loss_ref, grads_ref = train_step(ref, x)
        torch.manual_seed(seed)
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
    return model, ref, x


@pytest.mark.parametrize("user_checkpointing", [False, True])
def test_activation_recompute_llama_bitwise(user_checkpointing, pool):
    base = _llama(4)
    base.config._attn_implementation = "eager"
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    if user_checkpointing:
        for m in (ref, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    handle = _recomputing(model, pool)
    if user_checkpointing:
        assert all(handle.checkpointed)
    ids = torch.randint(0, 64, (2, 12))
    for _ in range(2):
        for m in (ref, model):
            m.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
        assert_bitwise_equal(grads_of(model), grads_of(ref))
    assert handle.stats()["tensors_offloaded"] > 0


def test_activation_recompute_fsdp2_single_process(pool, gloo_world):
    _recompute_fsdp("fsdp2", pool)


def test_activation_recompute_fsdp1_single_process(pool, gloo_world):
    """FSDP1 units (use_orig_params) as the layers: recomputed ones run their unit's forward again
    under the checkpoint (parameters gathered again), offloaded ones copy out; gradients bitwise."""
    _recompute_fsdp("fsdp1", pool)


def _recompute_fsdp(kind, pool):
    """Inside the one-rank gloo world of the `gloo_world` fixture."""
    needs_fsdp(kind)
    ref = _shard(kind, small_model())
    model = _shard(kind, small_model())
    handle = _recomputing(model, pool)
    prefix = fsdp_steps_match(kind, handle, ref, model)
    stats = handle.stats()
    assert stats["recomputed_layers"] == [f"{prefix}blocks.0", f"{prefix}blocks.2"]
    assert stats["tensors_offloaded"] > 0


def test_activation_auto_budget_mixes_recompute_bitwise(pool):
    """A budget below what offload can reach in the window: auto mode recomputes some layers;
    gradients stay bitwise, and the plan says per layer what it chose and its prediction."""
    ref = small_model(n=6)
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    keep_all = predicted_peak_keeping_all(ref, x, pool)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool,
                                               memory_budget_bytes=keep_all // 4, verbose=False)
    loss_ref, grads_ref = train_step(ref, x)
    for _ in range(8):
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
    plan = handle.stats()["plan"]
    assert plan["budget_met"] and plan["predicted_peak_bytes"] <= keep_all // 4
    assert "recompute" in plan["kinds"] and plan["recomputed"] == handle.recomputed_layers()
    assert [layer["kind"] for layer in plan["layers"]] == plan["kinds"]
    check = plan["check"]
    assert check["settled"] and check["measured_step_ms"] > 0 and check["predicted_step_ms"] > 0


@pytest.mark.parametrize("winner", ["rival", "offloading"])
def test_activation_auto_budget_times_an_offloading_plan_against_its_rival_bitwise(pool, monkeypatch, winner):
    """A budget plan that offloads is timed against the fastest plan without offload (Note
    [measured rival] in auto/budget_plan.py): the handle runs each in turn, gradients stay bitwise
    through both, and the settled plan is the one the verdict kept (the margin set so that
    either wins whatever the steps measure)."""
    monkeypatch.setattr(budget_plan, "RIVAL_MARGIN", 1e9 if winner == "rival" else -1e9)
    ref = small_model(n=6)
    x = torch.randn(8, 16)
    keep_all = predicted_peak_keeping_all(ref, x, pool)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool,
                                               memory_budget_bytes=keep_all // 2, verbose=False)
    reference = train_step(ref, x)
    kinds_run = []
    for _ in range(14):
        assert_step_matches(model, x, reference)
        kinds_run.append(list(handle.plan["kinds"]) if handle.plan else None)
    check = handle.plan["check"]
    assert check["settled"] and check["rival"] is not None
    rival = check["rival"]
    assert rival["won"] is (winner == "rival")
    assert "offload" not in rival["kinds"] and rival["measured_step_ms"] > 0
    offloading = [k for k in kinds_run if k and "offload" in k]
    assert offloading and rival["kinds"] in kinds_run  # both ran
    assert handle.plan["kinds"] == (rival["kinds"] if rival["won"] else offloading[0])
    # The check's history holds the plans timed before the one kept, and the check that one's steps.
    timed = [h["measured_step_ms"] for h in check["history"]]
    if rival["won"]:
        assert check["measured_step_ms"] == rival["measured_step_ms"] and timed[-1] > 0
    else:
        assert timed[-1] == rival["measured_step_ms"] and check["measured_step_ms"] == timed[-2]
    handle.disable()


def test_activation_recomputes_the_kept_last_layer_bitwise(pool):
    """A budget plan may recompute the last layer (never offloaded, keep_last), as full
    checkpointing does: its inputs stay on the device, the others' go to the host; gradients
    bitwise (auto/budget.py's allowed() gives the planner that choice)."""
    ref = small_model(n=4)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    handle.set_recomputed([True] * 4)
    x = torch.randn(8, 16)
    reference = train_step(ref, x)
    for _ in range(2):
        assert_step_matches(model, x, reference)
    assert handle.recomputed_layers() == handle.layers and handle.offloaded_layers() == handle.layers[:3]
    assert handle.stats()["layers_offloaded"] == 3
    handle.disable()


def test_activation_recomputed_layers_with_inputs_kept_or_offloaded_bitwise(pool):
    """Every layer recomputed; some keep their inputs on the device, the others' go to the host
    (a budget plan's recomputed inputs kept, Note [recomputed inputs kept] in auto/budget.py);
    gradients bitwise, and only the offloaded ones' tensors are copied."""
    ref = small_model(n=4)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    handle.set_recomputed([True] * 4)
    handle.set_offloaded([True, False, True, False])
    x = torch.randn(8, 16)
    reference = train_step(ref, x)
    for _ in range(2):
        assert_step_matches(model, x, reference)
    assert handle.offloaded_layers() == [handle.layers[0], handle.layers[2]]
    assert handle.stats()["layers_offloaded"] == 2
    handle.disable()


def test_activation_auto_budget_replans_on_a_measured_peak_miss(pool, monkeypatch):
    """A measured peak over the budget (fragmentation the model does not see) adds the excess to
    the model's fixed bytes and plans again, with more recomputed or offloaded."""
    peak = [0]
    monkeypatch.setattr(_device, "max_memory_allocated", lambda device=None: peak[0])
    model = small_model(n=6)
    x = torch.randn(8, 16)
    budget = predicted_peak_keeping_all(model, x, pool) * 3 // 4
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False,
                                               memory_budget_bytes=budget)
    for _ in range(3):
        train_step(model, x)
    first = list(handle.plan["kinds"])
    peak[0] = budget * 5 // 4  # every step of the plan peaks 25% over the budget
    for _ in range(6):
        train_step(model, x)
    plan = handle.plan
    assert plan["check"]["replans"] >= 1 and plan["fixed_bytes"] > 0
    assert plan["kinds"] != first and plan["check"]["history"]
