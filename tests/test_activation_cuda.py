"""Activation offload on a GPU: bitwise gradients under deterministic algorithms, the
resident window's memory bound, pool reuse and flat memory over 200 steps, budget plans within their budget, FSDP2."""

import copy
import gc
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.activation.groups import SPAN_ALIGN
from offload.core import _device
from _activation_helpers import settled_budget_plan

pytestmark = pytest.mark.cuda


class Block(nn.Module):
    """Pre-norm transformer block with explicit attention (deterministic in backward)."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.n2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax((q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Stack(nn.Module):
    def __init__(self, d=256, heads=4, n=6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).float().square().mean()


def _stack(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return Stack(**kw).to(_device.current_device(), dtype)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]



def _step_bitwise(ref, model, x, loss_ref) -> None:
    """A step of `model` whose loss and gradients equal `ref`'s (which ran its step already) bit for bit."""
    model.zero_grad()
    loss = model(x)
    loss.backward()
    assert torch.equal(loss, loss_ref)
    for a, b in zip(_grads(ref), _grads(model)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["sync", "async", "auto"])
def test_activation_cuda_bitwise(mode, dtype, deterministic):
    ref = _stack(dtype)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, verbose=False)
    x = torch.randn(2, 64, 256, device=_device.current_device(), dtype=dtype)
    ref.zero_grad()
    loss_ref = ref(x)
    loss_ref.backward()
    # Auto mode measures a step with every layer offloaded, then one or two without offload,
    # then probes its plan in steps alternated with steps without offload: go on to a step
    # of the plan (the sync and async modes offload every step).
    for step in range(8):
        _step_bitwise(ref, model, x, loss_ref)
        if step >= 2 and (handle.plan is not None or mode != "auto") and handle.stats()["groups_offloaded"]:
            break
    stats = handle.stats()
    assert stats["groups_offloaded"] >= 1 and stats["h2d_bytes"] > 0
    assert stats["d2h_gbps"] is not None and stats["d2h_gbps"] > 0.1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_activation_cuda_verify_passes_and_stays_bitwise(mode, deterministic):
    """verify=True sums every group on the device out and back (Note [verify]): the copies of the
    engine pass, over steps whose first layer goes in parts, and gradients stay bitwise."""
    ref = _stack()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, verify=True, verbose=False)
    x = torch.randn(2, 64, 256, device=_device.current_device())
    ref.zero_grad()
    loss_ref = ref(x)
    loss_ref.backward()
    for _ in range(3):
        _step_bitwise(ref, model, x, loss_ref)
    assert handle.stats()["groups_fetched"] >= 1


def test_activation_cuda_llama_bitwise(deterministic):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).to(_device.current_device()).train()
    model = copy.deepcopy(ref)
    offload.enable_activation_offload(model, "async", min_tensor_bytes=0)
    ids = torch.randint(0, 128, (2, 96), device=_device.current_device())
    for m in (ref, model):
        m(input_ids=ids, labels=ids).loss.backward()
    for a, b in zip(_grads(ref), _grads(model)):
        assert torch.equal(a, b)


def _activation_peak(model, x, hold_device_cycles: int = 0):
    """Peak device bytes above what was allocated before the forward. `hold_device_cycles`:
    a spin kernel queued first, so the host runs that far ahead of the device."""
    gc.collect()
    _device.synchronize()
    model.zero_grad(set_to_none=False)
    before = _device.memory_allocated()
    _device.reset_peak_memory_stats()
    if hold_device_cycles:
        _device.spin(_device.current_device(), hold_device_cycles)
    model(x).backward()
    _device.synchronize()
    return _device.max_memory_allocated() - before


@pytest.mark.parametrize("resident", [1, 2, 3])
def test_activation_cuda_resident_window_bounds_peak(resident):
    model = _stack(torch.bfloat16, d=512, heads=8, n=8)
    x = torch.randn(2, 1024, 512, device=_device.current_device(), dtype=torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    _activation_peak(model, x)
    plain = _activation_peak(model, x)
    handle = offload.enable_activation_offload(model, "async", resident_groups=resident, min_tensor_bytes=0)
    _activation_peak(model, x)
    offloaded = _activation_peak(model, x)
    stats = handle.stats()
    per_layer = stats["d2h_bytes"] / stats["groups_offloaded"]
    # Forward: the window plus the last layer (kept). Backward: the group being consumed,
    # the one prefetched and the transient gradients of a layer (softmax's are as large as
    # its saved output). Slack for the head and the allocator's rounding. Eight layers
    # without a working window would exceed this for every `resident` tested.
    bound = (resident + 3) * per_layer + (64 << 20)
    assert offloaded <= bound, (offloaded, bound, per_layer, plain)
    assert offloaded < plain


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_activation_cuda_schedule_frees_before_the_peak_with_the_host_ahead(deterministic, split, pieces):
    """Auto mode's schedule lets a group's memory go at its planned point by a wait on the
    device, so a sparse plan lowers the peak even when the host runs far ahead of the device
    (here a spin kernel holds the device back) and so never sees a copy done in forward.
    `split`: the layers are copied in parts while they run, with the same result. `pieces`:
    the layers come back in pieces over several layers' backward, bitwise."""
    from offload.activation.auto.schedule import Schedule

    ref = _stack(torch.bfloat16, d=512, heads=8, n=8)
    model = copy.deepcopy(ref)
    x = torch.randn(2, 1024, 512, device=_device.current_device(), dtype=torch.bfloat16)
    for m in (ref, model):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    _activation_peak(model, x)
    plain = _activation_peak(model, x)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, resident_groups=8)
    _activation_peak(model, x)
    stats = handle.stats()
    per_layer = stats["d2h_bytes"] / stats["groups_offloaded"]
    handle.set_offloaded([i in (0, 1) for i in range(8)])
    ends = [int(per_layer) * k // 4 for k in (1, 2, 3)]
    parts = {0: ends, 1: ends} if split else {}
    if pieces:
        fetch_at, shares = {5: [1], 3: [1, 0], 2: [0]}, {(5, 1): 0.4, (3, 0): 0.5}
    else:
        fetch_at, shares = {3: [1], 2: [0]}, {}
    handle.engine.use_plan(Schedule(8, [None] * 8, {0: 4, 1: 6}, fetch_at, [], parts, fetch_share=shares))

    _activation_peak(model, x, hold_device_cycles=200_000_000)  # ~0.1 s: the host runs ahead of the device
    offloaded = _activation_peak(model, x, hold_device_cycles=200_000_000)
    # Two layers' activations are gone before the peak at the end of forward (slack: rounding).
    assert offloaded <= plain - 2 * per_layer + (16 << 20), (offloaded, plain, per_layer)
    stats = handle.stats()
    assert stats["layers_offloaded"] == 2
    assert stats["groups_prefetched"] == stats["groups_offloaded"]
    assert (stats["groups_offloaded"] > 2) == split
    for m in (ref, model):
        m.zero_grad(set_to_none=False)
        m(x).backward()
    for a, b in zip(_grads(ref), _grads(model)):
        assert torch.equal(a, b)
    handle.disable()


def test_activation_cuda_step_leaves_no_device_memory():
    """After a step device memory is where it was before it: the copy engine held the last
    group fetched back (a layer's activations) until the next step's first copy."""
    model = _stack(torch.bfloat16, d=512, heads=8, n=6)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(2, 1024, 512, device=_device.current_device(), dtype=torch.bfloat16)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0)
    for _ in range(3):
        gc.collect()
        _device.synchronize()
        before = _device.memory_allocated()
        model(x).backward()
        _device.synchronize()
        assert _device.memory_allocated() == before
    assert handle.stats()["groups_fetched"] >= 1
    handle.disable()


def test_activation_cuda_served_groups_free_their_memory_as_backward_lets_them_go():
    """Groups that backward serves from the device while their copies still run (the host far
    ahead of the device, here held back by a spin kernel) free their memory as backward lets
    them go, not when the copy engine next sees their copies done: once backward is queued, and
    as the next step starts, the device holds what it held before the step; gradients bitwise."""
    ref = _stack(torch.bfloat16, d=512, heads=8, n=6)
    model = copy.deepcopy(ref)
    for m in (ref, model):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    x = torch.randn(2, 1024, 512, device=_device.current_device(), dtype=torch.bfloat16)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, resident_groups=3)
    at_first_layer, after_backward = [], []
    model.blocks[0].register_forward_pre_hook(lambda module, args: at_first_layer.append(_device.memory_allocated()))
    gc.collect()
    _device.synchronize()
    base = _device.memory_allocated()
    for _ in range(3):
        _device.spin(_device.current_device(), 200_000_000)  # ~0.1 s: no copy is done as backward is queued
        model(x).backward()
        after_backward.append(_device.memory_allocated())
    _device.synchronize()
    stats = handle.stats()
    per_layer = stats["d2h_bytes"] / stats["groups_offloaded"]
    slack = 4 << 20  # the allocator's rounding
    assert max(after_backward) - base <= slack < per_layer, (after_backward, base, per_layer)
    assert max(at_first_layer) - base <= slack, (at_first_layer, base, per_layer)
    for m in (ref, model):
        m.zero_grad(set_to_none=False)
    ref(x).backward()
    _device.spin(_device.current_device(), 200_000_000)
    model(x).backward()
    for a, b in zip(_grads(ref), _grads(model)):
        assert torch.equal(a, b)
    handle.disable()


class CheckpointedStack(Stack):
    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x).float().square().mean()


def test_activation_cuda_checkpoint_inputs_offloaded_lower_peak():
    """With checkpointing only the checkpoint inputs are saved; offloading them leaves about
    two on the device in backward instead of all of them: a lower peak than checkpointing alone."""
    torch.manual_seed(0)
    model = CheckpointedStack(d=512, heads=8, n=8).to(_device.current_device(), torch.bfloat16)
    x = torch.randn(2, 2048, 512, device=_device.current_device(), dtype=torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients stay allocated: the peak is activations
    _activation_peak(model, x)
    plain = _activation_peak(model, x)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0)
    _activation_peak(model, x)
    offloaded = _activation_peak(model, x)
    stats = handle.stats()
    input_bytes = x.numel() * x.element_size()
    # The inputs of layers 1..7 are offloaded (each in the group of the layer before it).
    assert stats["groups_offloaded"] == 7 and stats["d2h_bytes"] >= 7 * input_bytes
    # Checkpointing alone holds 7 inputs while the last layer recomputes; offload about 2.
    assert offloaded <= plain - 3 * input_bytes, (offloaded, plain, input_bytes)
    handle.disable()


def _settled_budget_handle(model, step, budget):
    handle = offload.enable_activation_offload(model, "auto", memory_budget_bytes=budget, min_tensor_bytes=0,
                                               verbose=False)
    return settled_budget_plan(handle, step)


@pytest.mark.parametrize("set_to_none", [False, True])
def test_activation_cuda_budget_plan_stays_within_its_budget(set_to_none):
    """A budget plan's step peaks (the allocator's peak, the whole step) within its budget plus
    5%, whether the gradients stay allocated between steps or are freed and allocated again
    in each backward (Note [memory beside the activations] in auto/budget.py)."""
    model = _stack(torch.bfloat16, d=512, heads=8, n=8)
    x = torch.randn(2, 2048, 512, device=_device.current_device(), dtype=torch.bfloat16)

    def step():
        model.zero_grad(set_to_none=set_to_none)
        model(x).backward()

    probe = _settled_budget_handle(model, step, 1 << 50)
    keep_all, least = probe.plan["predicted_peak_bytes"], probe.plan["least_peak_bytes"]
    probe.disable()
    assert least < keep_all
    for share in (0.75, 0.5, 0.25):
        budget = int(least + (keep_all - least) * share)
        handle = _settled_budget_handle(model, step, budget)
        gc.collect()
        _device.synchronize()
        _device.reset_peak_memory_stats()
        step()
        _device.synchronize()
        peak, plan = _device.max_memory_allocated(), handle.plan
        handle.disable()
        assert plan["budget_met"], plan
        assert peak <= budget * 1.05, (share, peak, budget, plan["kinds"], plan["predicted_peak_bytes"])


def test_activation_cuda_settled_plan_keeps_no_copy_sources():
    """A plan that settles on offloading nothing holds no device memory for the measuring steps'
    copies (the core holds a copy's sources until a later copy sees it done; Note [fresh
    segments] in auto/memory.py)."""
    model = _stack(torch.bfloat16, d=512, heads=8, n=4)
    x = torch.randn(2, 2048, 512, device=_device.current_device(), dtype=torch.bfloat16)

    def step():
        model.zero_grad(set_to_none=False)
        model(x).backward()

    step()
    gc.collect()
    _device.synchronize()
    before = _device.memory_allocated()
    handle = _settled_budget_handle(model, step, 1 << 50)
    assert handle.plan["kinds"] == ["keep"] * 4 and handle.stats()["plan"]["check"]["settled"]
    step()
    gc.collect()
    _device.synchronize()
    assert _device.memory_allocated() - before < (8 << 20), (before, _device.memory_allocated())
    handle.disable()


def _rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# Note [host bound]: a step takes one pool block per offloaded group, of the group's spans laid
# out at SPAN_ALIGN boundaries (at most SPAN_ALIGN more per tensor than the bytes copied),
# rounded up to the block's size class (at most `largest_round_up` more per group). A block
# goes back when its group is freed, with the step's graph, in its backward; one whose last
# reference goes only later (a copy let go after the next step began) is the previous step's.
# So while a step offloads, the pool holds its blocks and at most the previous step's: two
# steps' blocks are the most it can have in use at once, whatever the timing (how many of the
# previous step's are still out is the timing, and what the bound must not depend on). A
# block lost per step would pass it within a few dozen of the ~200 steps measured.
_POOL_PROBE_SIZES = [(1 << k) + 1 for k in range(9, 31)] + [(k << 21) + 1 for k in range(1, 64)]


def test_activation_cuda_200_steps_flat_memory():
    # Garbage of earlier tests in reference cycles is freed whenever the cyclic collector
    # runs; it once dropped the figure below by a whole model (~100 MB: the resident-window
    # test's, then kept alive by the wrapped forwards' cycle, since removed) mid-loop.
    # Collect it first, so every figure below is this test's own memory.
    gc.collect()
    _device.synchronize()
    model = _stack(torch.bfloat16, d=256, heads=4, n=4)
    pool = offload.HostPool()
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool)
    x = torch.randn(2, 256, 256, device=_device.current_device(), dtype=torch.bfloat16)
    device_after, host_peak, rss = [], [], []
    for step in range(200):
        model.zero_grad(set_to_none=False)
        model(x).backward()
        _device.synchronize()
        # Buffers freed after a record_stream() stay counted until the caching
        # allocator next processes its events, which it does on an allocation:
        # one small allocation makes the figure mean "memory still in use".
        torch.empty(1, device=_device.current_device())
        if step >= 5:
            # No gc.collect() between steps except at step 10: a step that left device
            # memory in cyclic garbage would show as a drop there.
            device_after.append(_device.memory_allocated())
            host_peak.append(pool.stats()["peak_in_use_bytes"])
            if not pool.native:  # the native pool may count blocks whose events it has not polled yet
                assert pool.stats()["in_use_bytes"] == 0  # every block went back after backward
        if step in (10, 199):
            gc.collect()
            rss.append(_rss_bytes())
    assert max(device_after) == min(device_after), (
        f"device memory after a step varies: {min(device_after)} .. {max(device_after)} bytes; "
        f"first steps {device_after[:8]}")
    # The host pool's peak, bounded by what the engine can hold at once (Note [host bound]).
    stats = handle.stats()
    largest_round_up = max(pool.block_bytes(n) - n for n in _POOL_PROBE_SIZES)
    step_blocks = (stats["d2h_bytes"] + stats["tensors_offloaded"] * SPAN_ALIGN
                   + stats["groups_offloaded"] * largest_round_up)
    assert max(host_peak) <= 2 * step_blocks, (
        f"host pool peak {max(host_peak)} bytes is more than two steps' blocks can take ({2 * step_blocks}): "
        f"{stats['groups_offloaded']} groups, {stats['d2h_bytes']} bytes a step; peaks {host_peak[:8]} ...")
    assert rss[1] - rss[0] < (128 << 20)
    assert stats["step"] == 199 and stats["groups_prefetched"] >= 1
    if pool.native:
        assert pool.stats()["cache_hits"] > 100


def _fsdp2_run(rank, world, init_method, result_dir):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dev = torch.device(_device.accelerator_type(), rank)
    _device.set_device(dev)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world)
    try:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        ref = _stack(torch.float32)
        model = copy.deepcopy(ref)
        for m in (ref, model):
            for block in m.blocks:
                fully_shard(block)
            fully_shard(m)
        handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0)
        torch.manual_seed(1 + rank)
        x = torch.randn(2, 64, 256, device=dev)
        ok = True
        for _ in range(2):
            losses = []
            for m in (ref, model):
                m.zero_grad()
                loss = m(x)
                loss.backward()
                losses.append(loss.detach())
            ok &= torch.equal(losses[0], losses[1])
            for a, b in zip(ref.parameters(), model.parameters()):
                ok &= torch.equal(a.grad.full_tensor(), b.grad.full_tensor())
        ok &= handle.layers == [f"blocks.{i}" for i in range(6)] and handle.stats()["layers_offloaded"] == 5
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write("ok" if ok else "mismatch")
    finally:
        torch.use_deterministic_algorithms(False)
        dist.destroy_process_group()


def test_activation_cuda_fsdp2_one_gpu(tmp_path):
    _fsdp2_run(0, 1, f"file://{tmp_path}/rdzv", str(tmp_path))
    assert (tmp_path / "rank0").read_text() == "ok"


@pytest.mark.multi_gpu
def test_activation_cuda_fsdp2_two_gpus(tmp_path):
    import torch.multiprocessing as mp

    # A file rendezvous: a port found by binding and releasing it can be taken by another process first.
    mp.spawn(_fsdp2_run, args=(2, f"file://{tmp_path}/rdzv", str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["ok", "ok"]


def test_activation_cuda_views_keep_alignment():
    """Restored views sit at the same address modulo 512 as the originals, with their layout."""
    seen = {}

    class Saver(torch.autograd.Function):
        @staticmethod
        def forward(ctx, base):
            ctx.save_for_backward(base[3:], base.t()[1:, 5:], base.view(-1)[77:].view(-1, 1))
            return base.clone()

        @staticmethod
        def backward(ctx, grad):
            seen["saved"] = ctx.saved_tensors
            return grad

    inner = torch.randn(64, 64, device=_device.current_device(), requires_grad=True) * 1
    originals = [inner[3:], inner.t()[1:, 5:], inner.view(-1)[77:].view(-1, 1)]
    # sync: the group's copy is settled at once, so backward restores from the host (async
    # would serve this last group from the device tensors still held).
    with offload.activation_offload("sync", min_tensor_bytes=0) as ao:
        out = Saver.apply(inner)
    out.sum().backward()
    assert ao.stats()["h2d_bytes"] > 0
    for got, want in zip(seen["saved"], originals):
        assert got.data_ptr() != want.data_ptr() and got.data_ptr() % 512 == want.data_ptr() % 512
        assert got.stride() == want.stride() and torch.equal(got, want)
