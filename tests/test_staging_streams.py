"""A save's values against work on the device: writes queued before stage() are seen, those
after it (an optimizer step behind protect(), a forward that changes buffers, a
wait_stream()) are not, and refills of a buffer set are deferred to the core's worker."""

import pytest
import torch

import offload
from _staging_helpers import assert_same, model_and_optimizer, snapshot, train_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_staging_forward_buffers_and_protect(backend, device):
    model, optimizer = model_and_optimizer(device)
    train_step(model, optimizer, device)
    stager = offload.AsyncStager(forward_buffers=model)
    hook = stager.protect(optimizer)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    expected = snapshot(state)
    future = stager.stage(state)
    train_step(model, optimizer, device)  # forward changes BatchNorm statistics, step changes the rest
    assert_same(future.result(), expected)
    plan = stager._plan  # a private read: no seam says which tensors a save copies first
    early = [u for b in plan.batches if b.copied_first for u in b.units]
    assert len(early) == 3  # running_mean, running_var, num_batches_tracked
    hook.remove()
    stager.close()


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
    model, optimizer = model_and_optimizer(device)
    train_step(model, optimizer, device)
    stager = offload.AsyncStager(forward_buffers=model)
    stager.protect(optimizer)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    expected = snapshot(state)
    future = stager.stage(state)
    train_step(model, optimizer, device)
    assert_same(future.result(), expected)
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
