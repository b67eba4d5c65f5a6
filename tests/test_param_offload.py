"""Parameter offload: memory really released, bitwise identical after reload, training goes on identically."""

import pytest
import torch

import offload
from offload.core import _device
from _workers import fully_shard_layers, spawn_world


def _model(device, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 48), torch.nn.GELU(),
                                torch.nn.LayerNorm(48), torch.nn.Linear(48, 64))
    model[4].weight = torch.nn.Parameter(torch.randn(64, 48))  # odd sizes, fresh storage
    return model.to(device)


def _step(model, opt, step: int) -> float:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (4, 7), generator=gen).to(next(model.parameters()).device)
    loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, 64), ids.reshape(-1))
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    return loss.detach()


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.detach().clone() for p in model.parameters()]
    state = [v.detach().clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params, grads, state


def _assert_same(a, b):
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert u.dtype == v.dtype and torch.equal(u, v)


def test_param_offload_round_trip_and_training_identical(device):
    model, ref = _model(device), _model(device)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        _step(model, opt, step)
        _step(ref, ref_opt, step)
    before = _snapshot(model, opt)
    allocated = _device.memory_allocated(device)

    out = offload.offload_params(model, grads=True, optimizer=opt)
    assert offload.params_offloaded(model)
    moved = sum(p.numel() * p.element_size() for p in model.parameters()) * 4  # params, grads, exp_avg(_sq)
    count = len(list(model.parameters()))
    # params, grads, exp_avg, exp_avg_sq (+ the step counters where they live on the compute device)
    assert out["bytes"] >= moved and out["copy_ms"] > 0 and out["storages"] >= 4 * count
    for p in model.parameters():  # storages released, tensors keep their shape and identity
        assert p.untyped_storage().nbytes() == 0 and p.grad.untyped_storage().nbytes() == 0
    if _device.is_accelerator(device):
        assert allocated - _device.memory_allocated(device) >= moved

    back = offload.reload_params(model)
    assert not offload.params_offloaded(model) and back["bytes"] == out["bytes"]
    _assert_same(_snapshot(model, opt), before)
    for step in range(2, 4):  # the optimizer still holds the same tensors: training is unchanged
        assert torch.equal(_step(model, opt, step), _step(ref, ref_opt, step))
    _assert_same(_snapshot(model, opt), _snapshot(ref, ref_opt))


def test_param_offload_new_grads_and_lazy_optimizer_state_move_every_time(device):
    # zero_grad(set_to_none=True), PyTorch's default, makes new gradient tensors every
    # step, and AdamW makes its state at its first step (after the first offload here).
    model, ref = _model(device), _model(device)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def step(m, o, i):
        o.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (4, 7), generator=gen).to(device)
        loss = torch.nn.functional.cross_entropy(m(ids).reshape(-1, 64), ids.reshape(-1))
        loss.backward()
        o.step()
        return loss.detach()

    offload.offload_params(model, grads=True, optimizer=opt)  # no grads, no optimizer state yet
    offload.reload_params(model)
    hosts = []
    for i in range(3):
        assert torch.equal(step(model, opt, i), step(ref, ref_opt, i))
        grads = [p.grad for p in model.parameters()]
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
                 and (v.device == torch.device(device) or not _device.is_accelerator(device))]
        assert grads and state
        offload.offload_params(model, grads=True, optimizer=opt)
        assert sum(t.untyped_storage().nbytes() for t in grads + state) == 0  # nothing left on the device
        # A private read: no seam reports the host mirror, whose reuse is what is checked.
        hosts.append(getattr(model, "_offload_param_mirror").host.data_ptr())
        offload.reload_params(model)
    assert hosts[1] == hosts[2]  # same tensors' sizes: the host mirror is reused
    for i in range(3, 5):
        assert torch.equal(step(model, opt, i), step(ref, ref_opt, i))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
    for s, r in zip(opt.state.values(), ref_opt.state.values()):
        assert all(torch.equal(s[k], r[k]) for k in s)


def test_param_offload_mirror_allocated_once_and_tied_weights_move_once(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False)).to(device)
    model[1].weight = model[0].weight  # tied, as in LMs with tie_word_embeddings
    names = {id(p) for p in model.parameters()}
    first = offload.offload_params(model)
    host_ptr = getattr(model, "_offload_param_mirror").host.data_ptr()  # a private read: no seam reports it
    offload.reload_params(model)
    second = offload.offload_params(model)
    assert getattr(model, "_offload_param_mirror").host.data_ptr() == host_ptr
    assert first["storages"] == second["storages"] == len(names)
    offload.reload_params(model)
    assert model[1].weight is model[0].weight


def test_param_offload_bad_calls_raise(device):
    model = _model(device)
    with pytest.raises(RuntimeError, match="reload_params: the parameters of this Sequential are not offloaded"):
        offload.reload_params(model)
    offload.offload_params(model)
    with pytest.raises(RuntimeError, match="offload.offload_params: the parameters of this Sequential are already "
                                           "offloaded"):
        offload.offload_params(model)
    offload.reload_params(model)
    with pytest.raises(TypeError, match="offload.offload_params: module must be a torch.nn.Module"):
        offload.offload_params([torch.zeros(3)])


# ---------------------------------------------------------------- FSDP and FSDP2


def _local(t):
    return t.to_local() if type(t).__name__ == "DTensor" else t


def _shard(model, wrap: str, device):
    """Every layer with parameters, then the root: FSDP (v1, flat parameters) or FSDP2 (DTensor parameters)."""
    if wrap == "fsdp2":
        return fully_shard_layers(model, model, device)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for i, layer in enumerate(model):
        if any(True for _ in layer.parameters()):
            model[i] = FSDP(layer, device_id=device)
    return FSDP(model, device_id=device)


def _check_fsdp(wrap: str, device) -> None:
    model, ref = _shard(_model(device), wrap, device), _shard(_model(device), wrap, device)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _step(model, opt, 0)
    _step(ref, ref_opt, 0)
    on_accelerator = device.type != "cpu"
    allocated = _device.memory_allocated(device) if on_accelerator else 0
    out = offload.offload_params(model, grads=True, optimizer=opt)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    held = [_local(t) for p in model.parameters() for t in (p, p.grad)] + [_local(v) for v in state]
    assert state and sum(t.untyped_storage().nbytes() for t in held) == 0  # the local shards, grads, state
    if on_accelerator:
        assert _device.memory_allocated(device) <= allocated - out["bytes"] + (1 << 20)
    offload.reload_params(model)
    for step in range(1, 3):
        assert torch.equal(_step(model, opt, step), _step(ref, ref_opt, step))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(_local(p), _local(q)) and torch.equal(_local(p.grad), _local(q.grad))


# spawn_world runs a module-level function of (rank, device): one per wrapping.
def _scenario_fsdp1(rank, device):
    _check_fsdp("fsdp1", device)


def _scenario_fsdp2(rank, device):
    _check_fsdp("fsdp2", device)


@pytest.mark.parametrize("wrap", ["fsdp1", "fsdp2"])
@pytest.mark.skipif(_device.accelerator_type() not in (None, "cuda"),
                    reason="the one-process world is gloo on the CPU or NCCL on CUDA; HCCL is not wired here")
def test_param_offload_fsdp_one_process(wrap):
    """A one-process world (gloo on the CPU in CI; NCCL where there is a GPU, since offload moves only accelerator
    tensors there): FSDP's flat parameters / FSDP2's DTensor shards, their grads and AdamW's state leave (0 bytes
    held) and training goes on bit for bit after reload."""
    spawn_world(_scenario_fsdp1 if wrap == "fsdp1" else _scenario_fsdp2, _device.accelerator_type() or "cpu", world=1)


@pytest.mark.cuda
@pytest.mark.multi_gpu
def test_param_offload_fsdp2_two_gpus():
    spawn_world(_scenario_fsdp2, "cuda")
