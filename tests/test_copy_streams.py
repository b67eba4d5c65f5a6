"""Stream order of the copies on an accelerator: a copy sees work queued before the call,
sources freed or released early are not reused mid-copy, a consumer waits on the device,
both directions run at once; and the device layer's current stream.
A test that takes `backend` runs on the compiled core and on the pure-PyTorch path."""

import pytest
import torch

import offload
from offload.core import _device


@pytest.mark.cuda
def test_copy_sees_work_queued_before_the_call(backend, device):
    x = torch.zeros(1 << 22, device=device)
    _device.spin(device, 100_000_000)
    x.fill_(3.0)  # queued behind the spin on the current stream
    (host,) = offload.copy_to_host([x]).wait()
    assert bool((host == 3.0).all())


@pytest.mark.cuda
def test_copy_sources_freed_early_are_not_reused_mid_copy(backend, device):
    x = torch.randn(1 << 22, device=device)
    expected = x.cpu()
    _device.spin(device, 200_000_000)  # the copy stream waits behind this
    handle = offload.copy_to_host([x])
    del x
    y = torch.full((1 << 22,), 7.0, device=device)  # would reuse x's memory without record_stream
    (host,) = handle.wait()
    assert torch.equal(host, expected)
    del y


@pytest.mark.cuda
def test_copy_release_sources_returns_memory_in_stream_order(backend, device):
    x = torch.randn(1 << 22, device=device)
    expected = x.cpu()
    ptr = x.data_ptr()
    _device.spin(device, 200_000_000)  # the copy stream waits behind this, so the copy is still to run
    handle = offload.copy_to_host([x])
    handle.release_sources()  # the current stream waits for the copy on the device; no host wait
    assert not handle.ready()
    del x
    y = torch.full((1 << 22,), 7.0, device=device)  # queued after the wait, in x's memory if it was let go
    if backend == "native":  # the core let go of x at once; the fallback's record_stream keeps it until done
        assert y.data_ptr() == ptr
    (host,) = handle.wait()
    assert torch.equal(host, expected)
    assert bool((y == 7.0).all())


def test_copy_release_sources_on_the_host_is_a_plain_copy(backend, device):
    x = torch.randn(1000, device=device)
    handle = offload.copy_to_host([x])
    handle.release_sources()
    (host,) = handle.wait()
    assert torch.equal(host, x.cpu())


@pytest.mark.cuda
def test_copy_consumer_waits_on_the_device_not_the_host(backend, device):
    hosts = offload.copy_to_host([torch.randn(1 << 20, device=device)]).wait()
    _device.spin(device, 50_000_000)
    handle = offload.copy_to_device(hosts, device)
    handle.wait_stream()  # device-side: returns at once
    (result,) = handle.tensors
    copied = result.clone()  # ordered after the copy on the current stream
    assert torch.equal(copied.cpu(), hosts[0])


@pytest.mark.cuda
def test_copy_both_directions_at_once(backend, device):
    down = [torch.randn(1 << 22, device=device) for _ in range(4)]
    up_src = offload.copy_to_host([torch.randn(1 << 22, device=device) for _ in range(4)]).wait()
    h_down = offload.copy_to_host(down)
    h_up = offload.copy_to_device(up_src, device)
    for src, h in zip(down, h_down.wait()):
        assert torch.equal(src.cpu(), h)
    for h, d in zip(up_src, h_up.wait()):
        assert torch.equal(h, d.cpu())


@pytest.mark.cuda
def test_device_current_stream_follows_stream_contexts(device):
    """The device layer's current stream (read through a cache of stream objects) is the one
    a stream context makes current, and the default one again after it; on every device."""
    default = _device.current_stream(device)
    sides = [_device.new_stream(device) for _ in range(70)]  # more than the cache holds
    for side in sides:
        assert side != default
        with _device.stream_context(side):
            assert _device.current_stream(device) == side
            assert _device.current_stream(device.index) == side  # the slow path agrees
            assert _device.current_stream(None) == side
        assert _device.current_stream(device) == default


@pytest.mark.cuda
def test_device_hold_delays_the_stream_not_the_host(device):
    """`hold` queues the wait on the current stream: work queued after it starts about that
    much later (timed by events), and an event recorded after it is still pending when the
    call returns (the host did not wait)."""
    stream = _device.current_stream(device)
    _device.synchronize(device)
    start, end = _device.new_event(device, timing=True), _device.new_event(device, timing=True)
    start.record(stream)
    assert _device.hold(device, 0.05)
    end.record(stream)
    pending = not end.query()
    end.synchronize()
    assert pending
    assert 0.025 <= start.elapsed_time(end) / 1e3 <= 0.5


def test_device_hold_queues_nothing_where_there_is_no_stream():
    assert not _device.hold(torch.device("cpu"), 0.05)
    if _device.is_accelerator(_device.current_device()):
        assert not _device.hold(_device.current_device(), 0.0)
