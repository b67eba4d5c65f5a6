"""The host pool at its limit: activation offload degrades (what does not fit stays on the
device, one warning, gradients bitwise); parameter offload refuses cleanly (torch.OutOfMemoryError
naming the bytes asked and held, nothing moved)."""

import copy
import gc
import warnings

import pytest
import torch

import offload
from _activation_helpers import one_thread, small_model, train_step  # noqa: F401 (fixture)

MiB = 1 << 20


def _pool_limited(limit):
    # The native pool grows in 2 MiB granules above a slab: small slabs keep the limit meaningful.
    return offload.HostPool(limit_bytes=limit, slab_bytes=MiB)



def _pool_full_warnings(caught):
    return [w for w in caught if "host pool cannot take" in str(w.message)]


@pytest.mark.parametrize("mode", ["async", "sync", "auto"])
def test_faults_activation_pool_full_keeps_rest_on_device(backend, mode, device, deterministic):
    """Groups of about 1 MiB, a 2 MiB pool: some groups are offloaded, the rest stay on the
    device; every step's gradients equal those without offload; one warning in all.

    Model and input live on the compute device: the engine offloads only tensors there."""
    ref = small_model(d=32, n=4).to(device)
    model = copy.deepcopy(ref)
    pool = _pool_limited(2 * MiB)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(512, 32, device=device)
    _, want = train_step(ref, x)
    offloaded = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10 if mode == "auto" else 3):
            _, got = train_step(model, x)
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
            offloaded.append(handle.engine.stats()["groups_offloaded"])
            assert pool.stats()["in_use_bytes"] == 0  # every block back after backward
    warned = _pool_full_warnings(caught)
    assert len(warned) == 1, [str(w.message) for w in caught]
    message = str(warned[0].message)
    assert "bytes saved by" in message and "stay on the device" in message and "limit_bytes" in message
    assert pool.stats()["peak_in_use_bytes"] <= 2 * MiB
    if mode != "auto":  # auto's plan may choose to offload less once it has measured
        assert max(offloaded) >= 1  # the pool took what fit
    handle.disable()


def test_faults_activation_pool_full_nothing_fits(backend, device, deterministic):
    """A pool that takes nothing: the step runs as without offload (every group kept)."""
    ref = small_model(d=32, n=3).to(device)
    model = copy.deepcopy(ref)
    pool = _pool_limited(1)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(64, 32, device=device)
    _, want = train_step(ref, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _, got = train_step(model, x)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert handle.engine.stats()["groups_offloaded"] == 0
    assert len(_pool_full_warnings(caught)) == 1
    assert pool.stats()["in_use_bytes"] == 0
    handle.disable()


def _state(module, optimizer):
    out = {f"p.{n}": t.detach().clone() for n, t in module.state_dict().items()}
    out.update({f"g.{n}": p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
    for i, state in enumerate(optimizer.state.values()):
        out.update({f"o.{i}.{k}": v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


@pytest.mark.parametrize("grow", [False, True], ids=["first_offload", "state_grew"])
def test_faults_param_offload_pool_full_moves_nothing(backend, grow, device):
    """offload_params into a full pool: torch.OutOfMemoryError naming the bytes asked and held;
    every parameter, gradient and optimizer state is still usable where it was, bitwise; once
    the pool has room, offload and reload round-trip.

    The module lives on the compute device: with an accelerator present, host tensors stay put."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device=device)).square().mean().backward()
    pool = _pool_limited(0)
    if grow:  # a first offload fits; the optimizer's state made afterwards does not
        offload.offload_params(model, grads=True, pool=pool)
        offload.reload_params(model)
        optimizer.step()
    held = pool.stats()["in_use_bytes"]
    pool.limit_bytes = max(held, 1) + 64 * 1024
    before = _state(model, optimizer)
    with pytest.raises(torch.OutOfMemoryError) as info:
        offload.offload_params(model, grads=True, optimizer=optimizer, pool=pool)
    message = str(info.value)
    del info
    gc.collect()
    assert message.startswith("offload.offload_params: cannot get ") and "bytes of pinned host memory" in message
    assert "in use of its limit of" in message and "stay where they are" in message
    assert not offload.params_offloaded(model)
    after = _state(model, optimizer)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    # Usable as it is: a training step runs.
    model(torch.randn(8, 256, device=device)).square().mean().backward()
    optimizer.step()
    pool.limit_bytes = 0
    want = _state(model, optimizer)
    offload.offload_params(model, grads=True, optimizer=optimizer, pool=pool)
    assert offload.params_offloaded(model)
    offload.reload_params(model)
    got = _state(model, optimizer)
    for k in want:
        assert torch.equal(want[k], got[k]), k

