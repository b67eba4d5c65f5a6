"""The npu stand-in (tests/npu_standin) is what runs under OFFLOAD_TEST_DEVICE=npu: offload's
NPU branch, the core's pool and copy engine over c10 streams and events, and real memory
statistics. Skipped in the default run."""

import gc

import pytest
import torch

import offload
from offload.core import _backend, _device
from offload.core._copy_fallback import PyTransfer

from conftest import STANDIN

pytestmark = pytest.mark.skipif(not STANDIN, reason="runs on the npu stand-in only (OFFLOAD_TEST_DEVICE=npu)")


def test_npu_standin_is_the_accelerator_offload_sees():
    assert _device.accelerator_type() == "npu" and _device.compute_device_type() == "npu"
    assert _device.current_device() == torch.device("npu", 0)
    assert _device._module("npu") is torch.npu and torch.npu.native is not None
    assert _device.device_count("npu") == 1 and _device.device_count("cuda") == 0
    assert _device.device_name() == "offload npu stand-in"
    assert _device.is_accelerator(torch.empty(1, device="npu").device)


def test_npu_standin_has_no_pinned_memory():
    assert not _device.pinned_memory_supported()
    with pytest.raises(NotImplementedError, match="no pinned host memory"):
        torch.ones(3).pin_memory()
    assert not _device.is_pinned(torch.ones(3))


def test_npu_standin_pool_and_copy_engine_run_natively():
    assert _backend.native_available(), _backend.why_not()
    pool = offload.HostPool()
    assert pool.native and not pool.pinned  # the core's pool, pageable slabs: no pinner for this device
    x = torch.arange(1000, dtype=torch.float32, device="npu").view(10, 100)
    sources = [x, x.t(), x[:, ::3], torch.zeros(0, device="npu")]
    handle = offload.copy_to_host(sources, pool=pool)
    # A private read: no public attribute says which engine made a handle; here the core's, not PyTorch's.
    assert not isinstance(handle._impl, PyTransfer)
    hosts = handle.wait()
    assert all(h.device.type == "cpu" for h in hosts) and pool.owns(hosts[0])
    for s, h in zip(sources, hosts):
        assert torch.equal(s.cpu(), h)
    back = offload.copy_to_device(handle, pool=pool)
    assert not isinstance(back._impl, PyTransfer)
    back.wait_stream()
    for s, b in zip(sources, back.tensors):
        assert b.device == s.device and b.stride() == s.stride() and torch.equal(s.cpu(), b.cpu())


def test_npu_standin_streams_and_events_order_a_copy():
    device = _device.current_device()
    first, second = _device.new_stream(device), _device.new_stream(device)
    current = _device.current_stream(device)
    assert len({first.stream_id, second.stream_id, current.stream_id}) == 3
    d2h, h2d = _device.copy_streams(device)
    assert d2h.stream_id != h2d.stream_id
    x = torch.zeros(64, device=device)
    with _device.stream_context(first):
        assert _device.current_stream(device) == first
        x.add_(3)
        done = _device.new_event(device, timing=True)
        done.record(first)
    assert _device.current_stream(device) == current
    second.wait_event(done)
    with _device.stream_context(second):
        host = torch.empty(64)
        host.copy_(x, non_blocking=True)
        copied = _device.new_event(device, timing=True)
        copied.record(second)
    copied.synchronize()
    assert done.query() and copied.query()  # work is synchronous: complete once recorded
    assert torch.equal(host, torch.full((64,), 3.0))
    assert 0.0 < done.elapsed_time(copied) < 1000.0  # ms: the copy recorded between them, well under a second


def test_npu_standin_record_stream():
    device = _device.current_device()
    side = _device.new_stream(device)
    x = torch.ones(16, device=device)
    _device.record_stream(x, side)  # the tensor's own record_stream: a no-op kernel here
    pool = offload.HostPool()
    block = pool.acquire(1024)
    assert pool.record_stream(block, side)  # the core's pool records the stream's event on its block
    del block
    assert pool.stats()["in_use_bytes"] == 0


def test_npu_standin_memory_statistics_move():
    device = _device.current_device()
    _device.reset_peak_memory_stats(device)
    before = _device.memory_allocated(device)
    t = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    assert _device.memory_allocated(device) == before + (1 << 20)
    assert _device.memory_reserved(device) == before + (1 << 20)
    del t
    assert _device.memory_allocated(device) == before
    assert _device.max_memory_allocated(device) >= before + (1 << 20)
    _device.reset_peak_memory_stats(device)
    assert _device.max_memory_allocated(device) == before
    free, total = _device.mem_get_info(device)
    assert 0 < free <= total


def test_npu_standin_checkpoint_preserves_rng_state():
    torch.manual_seed(0)
    x = torch.randn(16, 16, device="npu", requires_grad=True)
    state = torch.npu.get_rng_state()
    torch.npu.set_rng_state(state)
    assert torch.equal(torch.npu.get_rng_state(), state)

    def f(a):
        return torch.nn.functional.dropout(a, 0.5).sin().sum()

    torch.manual_seed(1)
    f(x).backward()
    want = x.grad.clone()
    x.grad = None
    torch.manual_seed(1)
    torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False).backward()
    assert torch.equal(x.grad, want)


def test_npu_standin_finished_copies_let_go_of_their_sources():
    """The core holds a device-to-host copy's sources until a later copy or query sees it done
    (Note [in-flight registry]); `release_finished_copies` lets go of them at once."""
    from offload.core.copy import release_finished_copies

    device = _device.current_device()
    release_finished_copies()
    before = _device.memory_allocated(device)
    source = torch.ones(1 << 20, dtype=torch.uint8, device=device)
    handle = offload.copy_to_host([source], pool=offload.HostPool())
    _device.synchronize(device)
    del source, handle
    assert _device.memory_allocated(device) == before + (1 << 20)  # still held for the copy
    release_finished_copies()
    assert _device.memory_allocated(device) == before


class _Stack(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return x


def _event_calls_per_group(layers, timing):
    """The stand-in's event calls in one settled async step of a stack of `layers` layers, each
    offloaded as a group of its own, divided by the step's groups."""
    import npu_standin

    torch.manual_seed(0)
    model = _Stack(layers).to("npu")
    x = torch.randn(4, 32, device="npu")
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=1, min_group_bytes=0, keep_last=0,
                                               timing=timing, verbose=False)
    try:
        for _ in range(3):  # the pool and the event cache warm up
            model(x).sum().backward()
        # Copies that earlier work in the process left to the collector (a compiled graph's)
        # drop their events when collected: not inside the counted step.
        gc.collect()
        before = npu_standin.event_calls()
        model(x).sum().backward()
        after = npu_standin.event_calls()
        groups = handle.stats()["groups_offloaded"]
    finally:
        handle.disable()
    assert groups == layers
    return {name: (after[name] - before[name]) / groups for name in after}


@pytest.mark.parametrize("timing", [False, True])
def test_npu_standin_an_offloaded_group_makes_a_bounded_number_of_event_calls(timing):
    # Each event call is a driver call on a real accelerator, host time a launch-bound step pays
    # per offloaded layer: a group's copy out and back, their order after the compute stream and
    # the reader's wait make a handful, the same for every group however many the step has (a
    # pool that queried every block it holds, each group's host block among them until backward
    # reads it, would grow with the step's groups). A copy's one completion event serves its
    # transfer, the pool's block, the in-flight entry and the timer's end (RecordedEvent in
    # event_cache.h): with one event each, the counts below would be 8 and 14 records.
    few, many = _event_calls_per_group(4, timing), _event_calls_per_group(12, timing)
    assert few["created"] == many["created"] == 0  # settled steps recycle their events
    assert many["recorded"] <= (8 if timing else 4)
    assert many["waited"] <= 4  # 3 where the copy back is seen done before its reader waits
    for name in ("recorded", "waited", "queried"):
        assert many[name] <= few[name] + 1, (name, few, many)
