"""The activation engine's streams and prefetch on the CPU path: fake streams and events, the window, copies in parts."""

import copy
import gc

import pytest
import torch
from torch import nn

import offload
from offload.core import _device
from offload.activation.auto.planner import max_tuning_steps
from _activation_helpers import (  # noqa: F401 (fixtures: one_thread, pool)
    FakeEvent, FakeStream, StepClock, assert_bitwise_equal, async_logging_fetches, grads_of,
    log_events, log_fetch_and_restore, one_thread, pool, small_model, train_step, use_schedule,
)

# These tests run models on the CPU, whose activations are host memory already:
# where an accelerator exists the engine rightly leaves them alone, and
# test_activation_cuda.py covers the GPU.
pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)


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
    views reading nearly all of it copy all of it): the step copies as many bytes as the same
    step without parts. Gradients stay bitwise."""
    forward_done = [False]
    ready = offload.CopyHandle.ready
    # Every copy seen in flight until forward ends (a copy on the host is done at once; on a
    # device the first part's was still running when k and v were saved). On the class: the
    # core makes the handles of its groups' copies itself.
    monkeypatch.setattr(offload.CopyHandle, "ready", lambda self: forward_done[0] and ready(self))
    torch.manual_seed(0)
    ref = _QKVModel()
    x = torch.randn(64, 16)
    loss_ref, grads_ref = train_step(ref, x)
    copied = {}
    for parts in (True, False):
        model = copy.deepcopy(ref)
        handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, keep_last=0, pool=pool,
                                                   verbose=False)
        engine = handle.engine
        if mode == "auto":  # the schedule's parts
            use_schedule(engine, 3, release_at={0: [2, 3] if parts else 3}, split_at={0: [1]} if parts else {})
        else:  # async mode's first layer in parts, as many as its saves allow
            # A private patch: async mode splits its first layer by what it saved last forward; no option sets it.
            monkeypatch.setattr(engine.forward, "first_layer_parts", lambda layer: [1] if parts else None)
        closed = []
        log_events(handle, closed, kinds=("closed",))
        model.register_forward_hook(lambda *_: forward_done.__setitem__(0, True))
        forward_done[0] = False
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
        copied[parts] = handle.stats()["d2h_bytes"]
        layer0 = [event for event in closed if event.layer == 0]
        assert len(layer0) >= 2 if parts else len(layer0) == 1  # the first layer went in parts
        handle.disable()
    assert copied[True] == copied[False] > 0


def test_activation_stream_paths_with_fake_streams(monkeypatch):
    """The accelerator-only branches (timed waits, copy timings) run against fakes on a CPU.

    On the pure-PyTorch copy path: the compiled core takes only real streams.
    """
    from offload.core import _backend, _device

    with _backend.force_fallback():
        _fake_stream_step(offload.HostPool(), monkeypatch, _device)


def _fake_stream_step(pool, monkeypatch, _device):
    clock = [0]
    compute, d2h, h2d = FakeStream("compute"), FakeStream("d2h"), FakeStream("h2d")
    monkeypatch.setattr(_device, "new_event", lambda device=None, timing=False: FakeEvent(clock))
    monkeypatch.setattr(_device, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(_device, "copy_streams", lambda device=None: (d2h, h2d))
    ref = small_model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, nvtx=True)
    handle.engine.on_accel = handle.engine.timing = True
    x = torch.randn(8, 16)
    _, grads_ref = train_step(ref, x)
    for _ in range(2):
        _, grads = train_step(model, x)
        assert_bitwise_equal(grads, grads_ref)
    stats = handle.stats()
    assert stats["d2h_seconds"] > 0 and stats["h2d_seconds"] > 0 and stats["backward_wait_seconds"] > 0
    assert stats["d2h_gbps"] > 0 and stats["groups_prefetched"] >= 1
    # The copies order themselves after compute and time themselves (the copy layer's
    # handles); the engine's own events time the compute stream's waits for them.
    assert not d2h.log and not h2d.log
    assert compute.log.count("record") >= 2


def test_activation_backward_prefetches_before_the_first_offloaded_group(pool):
    """Backward first runs the kept last layer and the head: the last offloaded group's copy
    back is issued at the step's first unpack, not when backward reaches that group."""
    model, handle, log, x, grads_ref = async_logging_fetches(pool)
    for _ in range(2):
        log.clear()
        _, grads = train_step(model, x)
        assert_bitwise_equal(grads, grads_ref)
        # fetched before backward reached it
        assert log[0][0] == "fetch" and log[1][0] == "restore" and log[1][1].serial == log[0][1].serial
        fetched = [event for what, event in log if what == "fetch"]
        # blocks 0-2, each group once (block 0 in parts from the second step); block 3 is kept
        assert len(fetched) == len({event.serial for event in fetched}) == handle.stats()["groups_offloaded"]
        assert [event.layer for event in fetched if event.n_layers > 0] == [2, 1, 0]  # not a later part
    assert handle.stats()["groups_prefetched"] == handle.stats()["groups_fetched"] > 3


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("ckpt", [None, "non_reentrant"])
def test_activation_small_layers_share_a_group(pool, mode, ckpt):
    """A layer that offloads less than min_group_bytes goes on in one group with the next
    ones, until the group holds that much: blocks 0 and 1 share one, block 2 has its own.
    Every layer is still offloaded, each group copied out and back once, gradients bitwise."""
    ref = small_model(ckpt=ckpt)
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    _, grads_ref = train_step(ref, x)
    probe = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    closed = []
    log_events(probe, closed, ("closed",))
    train_step(model, x)
    layer_bytes = closed[0].nbytes  # block 0's copy: its group's bytes
    assert [event.layer for event in closed] == [0, 1, 2]
    assert probe.engine.min_group_bytes == 0 and probe.stats()["groups_offloaded"] == 3
    probe.disable()
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, min_group_bytes=layer_bytes + 1,
                                               pool=pool, verbose=False)
    log = []
    log_fetch_and_restore(handle, log)
    for _ in range(2):
        log.clear()
        _, grads = train_step(model, x)
        assert_bitwise_equal(grads, grads_ref)
        stats = handle.stats()
        assert stats["layers_offloaded"] == 3 and stats["groups_offloaded"] == 2
        fetched = [event for what, event in log if what == "fetch"]
        assert [(event.layer, event.n_layers) for event in fetched] == [(2, 1), (0, 2)]
        assert stats["h2d_bytes"] == stats["d2h_bytes"] >= 3 * layer_bytes - 3 * 512
    handle.disable()
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0


@pytest.mark.parametrize("resident", [1, 2])
def test_activation_backward_start_prefetch_counts_layers(pool, resident):
    """The fetch as backward starts stays within the window counted in layers: a group of two
    small layers is brought back then only if two layers fit, else at the first unpack."""
    ref = small_model(n=5)
    model = copy.deepcopy(ref)
    x = torch.randn(8, 16)
    _, grads_ref = train_step(ref, x)
    probe = offload.enable_activation_offload(model, min_tensor_bytes=0, pool=pool, verbose=False)
    closed = []
    log_events(probe, closed, ("closed",))
    train_step(model, x)
    layer_bytes = max(event.nbytes for event in closed)  # one group a layer: its bytes
    probe.disable()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, min_group_bytes=layer_bytes + 1,
                                               resident_groups=resident, pool=pool, verbose=False)
    _, grads = train_step(model, x)
    assert_bitwise_equal(grads, grads_ref)
    stats = handle.stats()
    assert stats["layers_offloaded"] == 4 and stats["groups_offloaded"] == 2 and stats["groups_fetched"] == 2
    # (2, 3) as backward starts only if its two layers fit; (0, 1) always at (2, 3)'s first unpack
    assert stats["groups_prefetched"] == (2 if resident == 2 else 1)
    handle.disable()


@pytest.mark.parametrize("resident", [1, 2, 3])
def test_activation_copies_in_flight_served_from_device(resident, pool, monkeypatch):
    """Copies that never report done (a slow bus): the window waits for the oldest, and the
    groups still in flight when backward starts are served from their device tensors."""
    monkeypatch.setattr(offload.CopyHandle, "ready", lambda self: False)
    ref = small_model(n=6)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, resident_groups=resident,
                                               pool=pool)
    # A listener keeps the groups' cycle in Python, where the patched CopyHandle answers (the
    # core's twin reads its transfers directly; test_saved_tensor_hooks.py holds the two equal).
    log_events(handle, [])
    x = torch.randn(8, 16)
    for m in (ref, model):
        loss = m(x)
        loss.backward(retain_graph=True)
        loss.backward()  # the second pass finds every group on the host
    assert_bitwise_equal(grads_of(model), grads_of(ref))
    stats = handle.stats()
    assert stats["groups_offloaded"] == 5
    # First backward: the last resident-1 groups come from the device; second: all from the host.
    assert stats["groups_fetched"] == (5 - (resident - 1)) + 5


class _CountingEvent(FakeEvent):
    def synchronize(self):
        self.clock[1] += 1  # a host wait


@pytest.mark.parametrize("kind", ["auto_none", "auto_some", "async", "async_checkpoint"])
def test_activation_steady_step_never_blocks_the_host(kind, monkeypatch):
    """Once auto mode has settled, and in every async step whose copies are done when looked
    at, no host synchronisation happens (accelerator branches run against fakes): on a
    launch-bound model each one would stop the host running ahead of the device."""
    from offload.core import _backend

    clock = [0, 0]  # event clock, host waits
    compute, d2h, h2d = FakeStream("compute"), FakeStream("d2h"), FakeStream("h2d")
    monkeypatch.setattr(_device, "new_event", lambda device=None, timing=False: _CountingEvent(clock))
    monkeypatch.setattr(_device, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(_device, "copy_streams", lambda device=None: (d2h, h2d))
    monkeypatch.setattr(_device, "synchronize", lambda device=None: clock.__setitem__(1, clock[1] + 1))
    waits = []
    monkeypatch.setattr(offload.CopyHandle, "wait", lambda self: waits.append(self))
    ref = small_model(n=5, ckpt="nonreentrant" if kind == "async_checkpoint" else None)
    model = copy.deepcopy(ref)
    mode = "auto" if kind.startswith("auto") else "async"
    with _backend.force_fallback():
        handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=offload.HostPool(),
                                                   verbose=False)
        handle.engine.on_accel = handle.engine.timing = True
        x = torch.randn(8, 16)
        _, grads_ref = train_step(ref, x)
        for _ in range(max_tuning_steps(len(handle.layers)) if mode == "auto" else 2):
            if mode == "auto" and handle.plan is not None and not isinstance(handle.planner.shared.clock, StepClock):
                handle.planner.shared.clock = StepClock(handle, 1.0 if kind == "auto_none" else 0.02)
            train_step(model, x)
        assert mode != "auto" or handle.plan["tuning"]["settled"]
        clock[1] = 0
        waits.clear()
        records = clock[0]
        for _ in range(3):
            _, grads = train_step(model, x)
            assert_bitwise_equal(grads, grads_ref)
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
