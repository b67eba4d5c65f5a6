"""Deferred refills (copy_to_host(..., out=<CopyHandle>, defer=True)), queued by the core's
worker thread: bitwise, checked before the call returns, in call order, holding no source
once seen complete; and the timing of a copy (copy_seconds, copy_timer).
A test that takes `backend` runs on the compiled core and on the pure-PyTorch path."""

import pytest
import torch

import offload
from _copy_helpers import assert_bitwise, random_tensor
from offload.core import _device


def _refill_handle(device, count=6, numel=700):
    """Sources and a first copy of them, to refill with defer=True."""
    sources = [random_tensor((numel + i,), torch.bfloat16, device) for i in range(count)]
    first = offload.copy_to_host(sources)
    first.wait()
    return sources, first


def test_copy_defer_needs_a_handle(backend, device):
    sources = [torch.ones(3, device=device)]
    with pytest.raises(ValueError, match=r"offload.copy_to_host: defer=True needs out=<CopyHandle>.*got none"):
        offload.copy_to_host(sources, defer=True)
    with pytest.raises(ValueError, match=r"offload.copy_to_host: defer=True needs out=<CopyHandle>.*got list"):
        offload.copy_to_host(sources, out=[torch.empty(3)], defer=True, require_pinned=False)


def test_copy_defer_refills_a_handle_bitwise(backend, device):
    sources, first = _refill_handle(device)
    ptrs = [t.data_ptr() for t in first.tensors]
    for t in sources:
        t.add_(1)  # queued before the call: the deferred copy must see it
    second = offload.copy_to_host(sources, out=first, defer=True)
    for src, h in zip(sources, second.wait()):
        assert_bitwise(src, h)
    assert [t.data_ptr() for t in second.tensors] == ptrs
    assert second.ready()
    if device.type == "cpu":  # host sources: nothing to defer, done on return
        assert second.nbytes == sum(t.numel() * 2 for t in sources)
    core = offload.core._backend.core()
    if backend == "native" and core is not None:
        from offload.core import copy as _copy

        assert _copy._worker_waited_at_exit  # a private flag: the first deferred copy registers the wait at exit
        core.wait_copy_worker()  # nothing pending: returns at once


def test_copy_defer_checks_every_tensor_before_returning(backend, device):
    sources, first = _refill_handle(device)
    stale = list(sources)
    stale[3] = torch.ones(5, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"offload.copy_to_host: .*tensors\[3\]"):
        offload.copy_to_host(stale, out=first, defer=True)
    with pytest.raises(ValueError, match=r"out has 6 tensors but tensors has 5"):
        offload.copy_to_host(sources[:5], out=first, defer=True)
    with pytest.raises(ValueError, match=r"tensors\[2\] is a meta tensor"):
        offload.copy_to_host(sources[:2] + [torch.empty(5, device="meta")] + sources[3:], out=first, defer=True)


def test_copy_defer_of_sources_that_need_a_new_tensor_runs_at_once(backend, device):
    base = random_tensor((8, 10), torch.float32, device)
    waves = random_tensor((5,), torch.complex64, device)
    sources = [base[:, ::3], waves.conj(), torch.ones(4, device=device)]  # a gapped slice, a lazy conj
    first = offload.copy_to_host(sources)
    first.wait()
    base.mul_(2)
    waves.mul_(3)
    second = offload.copy_to_host(sources, out=first, defer=True)
    for src, h in zip(sources, second.wait()):
        assert_bitwise(src, h)


def _copied_with_a_gapped_source(device, at: int):
    """41 sources of 256 KiB copied four a group (group_bytes 1 MiB: eleven groups), source
    `at` a dense copy of a gapped slice; returns (sources, the slice's base, the handle)."""
    sources = [random_tensor((64 << 10,), torch.float32, device) for _ in range(41)]
    base = random_tensor((64, 2048), torch.float32, device)
    sources[at] = base[:, ::2].contiguous()
    first = offload.copy_to_host(sources, group_bytes=1 << 20)
    first.wait()
    return sources, base, first


def _assert_gapped_then_dense_refills(sources, base, first, at: int) -> None:
    """A deferred refill whose source `at` is the gapped slice itself (not dense: made
    contiguous on the copy stream), then one of the dense sources: both bitwise."""
    gapped = list(sources)
    gapped[at] = base[:, ::2]
    torch._foreach_add_(sources, 1.0)
    base.add_(1.0)
    handle = offload.copy_to_host(gapped, out=first, defer=True, timing=True)
    for src, h in zip(gapped, handle.wait()):
        assert_bitwise(src, h)
    assert isinstance(handle.copy_seconds(), float)
    torch._foreach_mul_(sources, 2.0)
    handle = offload.copy_to_host(sources, out=first, defer=True, timing=True)
    for src, h in zip(sources, handle.wait()):
        assert_bitwise(src, h)
    assert handle.copy_seconds() > 0


def test_copy_defer_late_groups_are_checked_while_the_first_copy(backend, device):
    """A deferred refill's later groups are queued by the worker as the calling thread
    checks them: a stale source in the last group still raises before the call returns
    (the worker stopped after the groups before it), a last-group source that needs a
    new tensor is copied at once by the calling thread, and every copy (and the next
    refill of the same buffers) is bitwise."""
    sources, base, first = _copied_with_a_gapped_source(device, at=40)  # in the last group
    stale = sources[:40] + [torch.ones(5, device=device)]
    with pytest.raises(ValueError, match=r"tensors\[40\]"):
        offload.copy_to_host(stale, out=first, defer=True, timing=True)
    _assert_gapped_then_dense_refills(sources, base, first, at=40)


def test_copy_defer_second_group_source_that_needs_a_new_tensor(backend, device):
    """A source that needs a new tensor in the second group: the first group (queued
    by the calling thread) stays queued, the worker stops before the second, and the
    calling thread copies the rest at once, all bitwise, and the next refill too."""
    sources, base, first = _copied_with_a_gapped_source(device, at=5)  # in the second group
    _assert_gapped_then_dense_refills(sources, base, first, at=5)


def test_copy_seconds_of_a_timed_copy(backend, device):
    sources, first = _refill_handle(device)
    with pytest.raises(ValueError, match=r"offload.CopyHandle.copy_seconds: this copy was not timed"):
        first.copy_seconds()
    timed = offload.copy_to_host(sources, out=first, defer=True, timing=True)
    timed.wait()
    seconds = timed.copy_seconds()
    assert isinstance(seconds, float) and 0.0 < seconds < 1.0  # a few KiB: well under a second
    plain = offload.copy_to_host(sources, timing=True)  # without defer as well
    plain.wait()
    assert isinstance(plain.copy_seconds(), float)
    back = offload.copy_to_device(plain, device, timing=True)  # and the copy back
    back.wait()
    seconds_back = back.copy_seconds()
    assert isinstance(seconds_back, float) and 0.0 < seconds_back < 1.0
    timer = back.copy_timer()  # the timing apart from the handle and its buffers
    del back
    assert timer.seconds() == seconds_back
    untimed = offload.copy_to_device(plain, device)
    untimed.wait()
    with pytest.raises(ValueError, match=r"offload.CopyHandle.copy_timer: this copy was not timed"):
        untimed.copy_timer()
    with pytest.raises(ValueError, match=r"not timed; pass timing=True to offload.copy_to_host or "
                       r"offload.copy_to_device"):
        untimed.copy_seconds()


@pytest.mark.cuda
def test_copy_defer_of_many_small_tensors_is_bitwise(backend, device):
    sources = [random_tensor((2048 + i % 7,), torch.bfloat16, device) for i in range(4000)]
    first = offload.copy_to_host(sources, group_bytes=32 << 20)
    first.wait()
    for t in sources[::3]:
        t.neg_()
    handle = offload.copy_to_host(sources, out=first, defer=True)
    for src, h in zip(sources, handle.wait()):
        assert_bitwise(src, h)


@pytest.mark.cuda
def test_copy_defer_sees_work_queued_before_the_call(backend, device):
    """On a side stream: the worker thread's own current stream is the default one, so a
    worker that ordered the copy after its thread's stream instead of the caller's would
    read the sources before the fills."""
    sources, first = _refill_handle(device, count=64, numel=1 << 14)
    side = _device.new_stream(device)
    side.wait_stream(_device.current_stream(device))
    with _device.stream_context(side):
        _device.spin(device, 100_000_000)
        for i, t in enumerate(sources):
            t.fill_(float(i))  # queued behind the spin on the caller's (side) stream, before the call
        handle = offload.copy_to_host(sources, out=first, defer=True)
    for i, h in enumerate(handle.wait()):
        assert bool((h == float(i)).all())


@pytest.mark.cuda
def test_copy_defer_sources_dropped_at_once_are_not_reused_mid_copy(backend, device):
    sources, first = _refill_handle(device, count=256, numel=1 << 14)
    expected = [t.cpu() for t in sources]
    _device.spin(device, 200_000_000)  # the copy stream waits behind this
    handle = offload.copy_to_host(sources, out=first, defer=True)
    del sources
    junk = [torch.full((1 << 14,), 7.0, device=device, dtype=torch.bfloat16) for _ in range(256)]
    for h, e in zip(handle.wait(), expected):
        assert_bitwise(e, h)
    del junk


@pytest.mark.cuda
def test_copy_defer_many_in_a_row_complete_in_call_order(backend, device):
    """Refills of one set of buffers land in call order, the last one winning: six deferred
    ones, then deferred ones followed at once by a synchronous one (which waits for the
    worker to queue them before queueing its own)."""
    sources, first = _refill_handle(device, count=300, numel=4096)
    values = [[torch.full_like(t, float(k)) for t in sources] for k in range(6)]
    _device.spin(device, 50_000_000)  # the device is busy while the copies are queued
    handle, deferred = first, []
    for k in range(6):
        handle = offload.copy_to_host(values[k], out=handle, defer=True, timing=True)
        deferred.append(handle)
    handle.wait()
    assert all(d.ready() for d in deferred)
    assert all(bool((t == 5.0).all()) for t in handle.tensors)
    for d in deferred:
        seconds = d.copy_seconds()  # complete once the handle is seen done
        assert isinstance(seconds, float) and seconds > 0.0
    _device.spin(device, 50_000_000)
    for k in range(3):
        handle = offload.copy_to_host(values[k], out=handle, defer=True)
    handle = offload.copy_to_host(values[4], out=handle)  # synchronous, after the deferred ones
    handle.wait()
    assert all(bool((t == 4.0).all()) for t in handle.tensors)


@pytest.mark.cuda
@pytest.mark.native
@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("seen_by", ["synchronize", "ready"])
def test_copy_seen_complete_holds_no_source(device, defer, seen_by):
    """Once a copy is seen complete (synchronize(), or ready() true), the core holds none of
    its sources: their memory goes back as soon as the caller drops them. (The bindings wait
    without the GIL and drop the sources once they have it back.) The pure-PyTorch path holds
    none at any time (record_stream), so this is the core's."""
    sources, first = _refill_handle(device, count=32, numel=1 << 16)
    handle = offload.copy_to_host(sources, out=first, defer=defer)
    if seen_by == "synchronize":
        handle.synchronize()
    else:
        while not handle.ready():
            pass
    held = _device.memory_allocated(device)
    del sources
    assert _device.memory_allocated(device) <= held - 32 * (1 << 16) * 2


@pytest.mark.cuda
def test_copy_defer_release_sources_and_wait_stream(backend, device):
    sources, first = _refill_handle(device, count=32, numel=1 << 16)
    expected = [t.cpu() for t in sources]
    _device.spin(device, 100_000_000)
    handle = offload.copy_to_host(sources, out=first, defer=True)
    held = _device.memory_allocated(device)
    handle.release_sources()  # waits (host) only for the worker to queue, then on the device
    del sources
    # Neither the worker's finished job nor the in-flight registry keeps them.
    assert _device.memory_allocated(device) <= held - 32 * (1 << 16) * 2
    junk = [torch.full((1 << 16,), 5.0, device=device, dtype=torch.bfloat16) for _ in range(32)]
    handle.wait_stream()
    for h, e in zip(handle.wait(), expected):
        assert_bitwise(e, h)
    assert all(bool((j == 5.0).all()) for j in junk)
