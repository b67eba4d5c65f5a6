"""Auto mode on the CPU path: plans per input shape, schedules run by the engine, budgets and the
allocator's cache. Its measured steps: test_activation_step_measure.py; its probes:
test_activation_probes.py."""

import copy
import dataclasses

import pytest
import torch

import offload
from offload.core import _device
from offload.activation.auto.planner import max_tuning_steps
from _activation_helpers import (  # noqa: F401 (fixtures: one_thread, pool)
    AUTO_MEASURING_STEPS, FakeEvent, FakeStream, Model, assert_bitwise_equal, assert_step_matches,
    log_fetch_and_restore, log_layer_backward, one_thread, pool, predicted_peak_keeping_all, small_model, train_step,
    use_schedule,
)

# These tests run models on the CPU, whose activations are host memory already:
# where an accelerator exists the engine rightly leaves them alone, and
# test_activation_cuda.py covers the GPU.
pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)


def test_activation_auto_plans_and_replans(pool, capsys):
    ref = small_model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool)
    for shape in ((8, 16),) * (AUTO_MEASURING_STEPS + 1) + ((6, 16),) * (AUTO_MEASURING_STEPS + 1):
        x = torch.randn(*shape)
        loss_ref, grads_ref = train_step(ref, x)
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
    printed = capsys.readouterr().out
    assert printed.count("auto plan") == 2 and "[[8, 16]]" in printed and "[[6, 16]]" in printed
    plan = handle.stats()["plan"]
    assert plan["input_shapes"] == [[6, 16]] and len(plan["mask"]) == 4 and plan["mask"][3] is False
    assert plan["eligible_bytes"] > 0

@dataclasses.dataclass
class _Batch:
    x: torch.Tensor


class _NestedInputModel(Model):
    """Takes its input inside a container."""

    def forward(self, batch):
        if isinstance(batch, (list, tuple)):
            return super().forward(batch[0])
        return super().forward(batch.x if isinstance(batch, _Batch) else batch["x"])


@pytest.mark.parametrize("container", ["dict", "list", "userdict", "dataclass"])
def test_activation_auto_replans_on_nested_input_shape(container, pool, capsys):
    """A new input shape inside a dict, a list, a UserDict (Hugging Face's BatchEncoding) or
    a dataclass is a new shape: auto mode measures it and plans again."""
    import collections

    wrap = {"dict": lambda x: {"x": x}, "list": lambda x: [x], "dataclass": _Batch,
            "userdict": lambda x: collections.UserDict(x=x)}[container]
    torch.manual_seed(0)
    ref = _NestedInputModel()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool)
    for n in (8,) * (AUTO_MEASURING_STEPS + 1) + (6,) * (AUTO_MEASURING_STEPS + 1):
        x = torch.randn(n, 16)
        loss_ref, grads_ref = train_step(ref, wrap(x))
        loss, grads = train_step(model, wrap(x))
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
    printed = capsys.readouterr().out
    assert printed.count("auto plan") == 2 and "[[8, 16]]" in printed and "[[6, 16]]" in printed
    assert handle.plan["input_shapes"] == [[6, 16]]


def test_activation_auto_budget_zero_offloads_everything(pool):
    model = small_model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, memory_budget_bytes=0,
                                               pool=pool, verbose=False)
    with pytest.warns(UserWarning, match="cannot meet memory_budget_bytes=0 .* least peak"):
        for _ in range(3):
            train_step(model, torch.randn(8, 16))
    assert handle.plan["mask"] == [True, True, True, False]


def test_activation_schedule_caps_and_fetch_points_bitwise(pool):
    """A schedule that offloads one layer in part: what it keeps stays on the device, every
    gradient is bitwise the same, and each group comes back at its backward point."""
    ref = small_model(n=4)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(ref, x)
    train_step(model, x)
    full = handle.stats()
    use_schedule(handle.engine, 4, caps=[None, 2048, None, None], release_at={0: 2, 1: 4, 2: 5},
               fetch_at={3: [2], 2: [1], 1: [0]})
    for _ in range(2):
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
    stats = handle.stats()
    assert stats["groups_offloaded"] == 3 and stats["tensors_kept"] > full["tensors_kept"]
    assert 0 < stats["d2h_bytes"] < full["d2h_bytes"] and stats["h2d_bytes"] == stats["d2h_bytes"]
    assert stats["groups_prefetched"] == 3 and stats["groups_fetched"] == 3


def test_activation_schedule_fetches_a_layer_in_pieces_at_several_points(pool):
    """A schedule that brings layer 1 back in two pieces (at layers 3 and 2) and layer 0 in
    three (as backward starts, at 2 and at 1): each piece is queued at its point, in the order
    backward needs the groups, the pieces of a group cover its block once, in order, into one
    device block, and gradients stay bitwise."""
    ref = small_model(n=4)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    engine = handle.engine
    use_schedule(engine, 4, release_at={0: 2, 1: 4, 2: 5}, fetch_at={3: [2, 1], 2: [1, 0], 1: [0]},
                 fetch_at_start=[0], fetch_share={(3, 1): 0.5, (5, 0): 0.25, (2, 0): 0.6})
    log, groups = [], {}

    def logged(event):
        if event.kind == "fetched":
            groups.setdefault(event.layer, set()).add(event.serial)
            log.append((event.layer, event.offset, event.offset + event.nbytes, event.block_bytes))

    handle.add_listener(logged)
    log_layer_backward(model, log, "backward")
    x = torch.randn(8, 16)
    reference = train_step(ref, x)
    for _ in range(2):
        log.clear()
        groups.clear()
        # Bitwise: the pieces land in one device block (were a piece given a block of its own,
        # the views restored from the last one would miss the earlier pieces' bytes).
        assert_step_matches(model, x, reference)
        pieces = [entry for entry in log if entry[0] != "backward"]
        for layer in (0, 1, 2):  # contiguous pieces from 0 to the whole block, of one group
            own = [(lo, hi, size) for g, lo, hi, size in pieces if g == layer]
            assert own[0][0] == 0 and own[-1][1] == own[-1][2]
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(own, own[1:]))
            assert len(groups[layer]) == 1
        layer_1 = [(lo, hi) for g, lo, hi, size in pieces if g == 1]
        assert len(layer_1) == 2 and layer_1[0][1] == -(-layer_1[0][1] // 512) * 512  # at a span boundary
        assert len([p for p in pieces if p[0] == 0]) == 3
        # Each at its point: layer 0's first piece before backward reaches layer 3, layer 1's
        # first at layer 3, its rest and layer 0's second at 2, layer 0's rest at 1.
        order = [(entry[1] if entry[0] == "backward" else entry[0]) for entry in log]
        kinds = ["b" if entry[0] == "backward" else "f" for entry in log]
        assert list(zip(kinds, order)) == [("f", 0), ("b", 3), ("f", 2), ("f", 1), ("b", 2), ("f", 1), ("f", 0),
                                           ("b", 1), ("f", 0), ("b", 0)]
        stats = handle.stats()
        assert stats["h2d_bytes"] == stats["d2h_bytes"] and stats["groups_fetched"] == 3
    handle.disable()


@pytest.mark.parametrize("split_bytes", [256, 4096])
def test_activation_schedule_copies_a_layer_in_parts_while_it_runs(split_bytes, pool):
    """A layer the schedule splits: its first part's copy is queued before the layer ends,
    views of one storage saved in several parts come back bitwise, and every part is fetched
    at its layer's backward point, a layer's last part first (backward needs it first)."""
    ref = small_model(n=4)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    engine = handle.engine
    ends = [k * split_bytes for k in range(1, 64)]
    use_schedule(engine, 4, release_at={0: [2, 3] * 32, 1: 4, 2: 4}, fetch_at={3: [2], 2: [1], 1: [0]},
               split_at={0: ends, 1: ends, 2: ends})
    log = []
    closed = []  # groups (serials) in the order their copies were queued

    def copied(event):
        if event.kind == "closed":
            log.append("copy")
            closed.append(event.serial)

    handle.add_listener(copied)
    model.blocks[0].register_forward_hook(lambda *_: log.append("layer 0 ended"))
    log_fetch_and_restore(handle, log)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(ref, x)
    for _ in range(2):
        log.clear()
        closed.clear()
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
        assert log.index("copy") < log.index("layer 0 ended")
        stats = handle.stats()
        assert stats["groups_offloaded"] > stats["layers_offloaded"] + 3 * (split_bytes == 256)
        assert stats["layers_offloaded"] == 3
        fetched = [e[1] for e in log if e[0] == "fetch"]
        # Each at its point, none on demand (a part whose tensors autograd dropped in forward
        # is freed with them, never fetched).
        assert len(fetched) == stats["groups_prefetched"] == stats["groups_fetched"] > 3 + 3 * (split_bytes == 256)
        assert [g.layer for g in fetched] == sorted((g.layer for g in fetched), reverse=True)
        for later, earlier in zip(fetched, fetched[1:]):
            if later.layer == earlier.layer:
                assert closed.index(later.serial) > closed.index(earlier.serial)
        first_seen = {}  # (what, serial) -> where it first is in the log
        for at, entry in enumerate(log):
            if isinstance(entry, tuple):
                first_seen.setdefault((entry[0], entry[1].serial), at)
        restored = [e[1] for e in log if e[0] == "restore"]
        assert restored
        for event in restored:
            assert first_seen[("fetch", event.serial)] < first_seen[("restore", event.serial)]
    handle.disable()


@pytest.mark.parametrize("case", ["whole", "parts", "tail"])
def test_activation_schedule_releases_on_the_device_at_its_points(monkeypatch, case):
    """The host never sees a copy done (it runs ahead of the device): each group's memory is
    still let go, at its planned point, by a wait on the device; no host wait; each group is
    fetched when backward reaches the layer the schedule names, before it is needed.
    `parts`: layer 0 is copied in two parts, each let go at its own point. `tail`: layer 1 is
    let go at the second tensor saved after the last layer (the head's), not at its end."""
    from offload.activation.auto.schedule import TAIL_POINT

    parts = case == "parts"
    from offload.core import _backend

    clock = [0]
    compute, d2h, h2d = FakeStream("compute"), FakeStream("d2h"), FakeStream("h2d")
    monkeypatch.setattr(_device, "new_event", lambda device=None, timing=False: FakeEvent(clock))
    monkeypatch.setattr(_device, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(_device, "copy_streams", lambda device=None: (d2h, h2d))
    monkeypatch.setattr(offload.CopyHandle, "ready", lambda self: False)
    waits = []
    monkeypatch.setattr(offload.CopyHandle, "wait", lambda self: waits.append(self))
    ref = small_model(n=4)
    model = copy.deepcopy(ref)
    with _backend.force_fallback():
        handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=offload.HostPool(),
                                                   verbose=False)
        engine = handle.engine
        engine.on_accel = engine.timing = True
        if parts:
            use_schedule(engine, 4, release_at={0: [1, 2], 1: 4, 2: 5}, fetch_at={3: [2], 2: [1], 1: [0]},
                       split_at={0: [512]})
        else:
            use_schedule(engine, 4, release_at={0: 2, 1: 4 + TAIL_POINT if case == "tail" else 4, 2: 5},
                       fetch_at={3: [2], 2: [1], 1: [0]})
            if case == "tail":
                engine.schedule.tail_save = 2
        log = []
        running = [None]  # the last block whose forward began (its boundary passed)
        for index, block in enumerate(model.blocks):
            block.norm.register_forward_pre_hook(lambda *_, index=index: running.__setitem__(0, index))

        def settled(event):
            if event.kind == "released":
                log.append(("settle", event.layer, engine.backward_seen, running[0]))

        handle.add_listener(settled)
        # A private spy: the tensors saved after the last layer are counted per tensor, where
        # no event reports (events come once per group); kept to time the tail release point.
        saved_after = engine._saved_after_layers
        monkeypatch.setattr(engine, "_saved_after_layers",
                            lambda: (log.append(("tail", engine._tail + 1)), saved_after()))
        log_fetch_and_restore(handle, log, lambda event: event.layer)
        x = torch.randn(8, 16)
        _, grads_ref = train_step(ref, x)
        for _ in range(2):
            log.clear()
            _, grads = train_step(model, x)
            assert_bitwise_equal(grads, grads_ref)
            # Layer 0 when layer 2 opens (block 1 ran last; in parts: its first part when layer 1
            # opens), layer 1 after the last layer (block 3 ran last), layer 2 when backward starts.
            first = [("settle", 0, False, 0)] if parts else []
            assert [e for e in log if e[0] == "settle"] == first + [("settle", 0, False, 1), ("settle", 1, False, 3),
                                                                     ("settle", 2, True, 3)]
            tail = [e for e in log if e[0] == "tail"]
            if case == "tail":  # the head's Linear saves its input and weight, square() its input
                assert tail == [("tail", 1), ("tail", 2), ("tail", 3)]
                assert log.index(("tail", 2)) < log.index(("settle", 1, False, 3)) < log.index(("tail", 3))
            else:  # counted only where the schedule has a point there
                assert tail == []
            order = [e for e in log if e[0] not in ("settle", "tail")]
            assert [e[1] for e in order if e[0] == "fetch"] == [2, 1, 0] + [0] * parts
            for layer in (0, 1, 2):
                assert order.index(("fetch", layer)) < order.index(("restore", layer))
    assert waits == []
    stats = handle.stats()
    assert stats["forward_wait_seconds"] > 0 and stats["backward_wait_seconds"] > 0  # the device-side waits
    handle.disable()


@pytest.mark.parametrize("idle_gbps, expected", [(1e6, (1e6, 1e6)), (1.0, (5.0, 6.0))])
def test_activation_auto_schedule_starts_from_the_faster_bus_reading(idle_gbps, expected, pool, monkeypatch):
    """Without a budget the schedule takes the faster of the first measuring step's copies
    (here 5 and 6 GB/s) and an idle copy each way."""
    from offload.activation.auto import planner as _activation_plan

    monkeypatch.setattr(_activation_plan, "probe_bandwidth", lambda device: (idle_gbps * 1e9, idle_gbps * 1e9))
    model = small_model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    stats = handle.engine.stats
    monkeypatch.setattr(handle.engine, "stats", lambda: {**stats(), "d2h_gbps": 5.0, "h2d_gbps": 6.0})
    for _ in range(AUTO_MEASURING_STEPS + 1):
        train_step(model, torch.randn(8, 16))
    assert (handle.plan["d2h_gbps"], handle.plan["h2d_gbps"]) == pytest.approx(expected)
    handle.disable()


def test_activation_auto_warns_when_the_budget_cannot_be_met(pool, monkeypatch, capsys):
    monkeypatch.setattr(_device, "max_memory_allocated", lambda device=None: 1 << 30)  # peak 1 GiB
    model = small_model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, memory_budget_bytes="1MiB",
                                               pool=pool)
    with pytest.warns(UserWarning, match="cannot meet memory_budget_bytes=1048576"):
        for _ in range(3):
            train_step(model, torch.randn(8, 16))
    # The plan of least predicted peak runs: the first layers offloaded, the last kept (keep_last).
    plan = handle.plan
    assert plan["budget_met"] is False and plan["predicted_peak_bytes"] == plan["least_peak_bytes"]
    assert plan["mask"][:2] == [True, True] and plan["mask"][3] is False
    assert "does NOT meet memory_budget_bytes=1048576" in capsys.readouterr().out
    import warnings

    with warnings.catch_warnings():  # once per handle
        warnings.simplefilter("error")
        train_step(model, torch.randn(6, 16))
        train_step(model, torch.randn(6, 16))
        train_step(model, torch.randn(6, 16))


def test_activation_auto_keeps_one_group_a_layer(pool):
    """Auto mode measures and plans layer by layer: min_group_bytes does not merge its groups."""
    model = small_model(n=4)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, min_group_bytes=1 << 40,
                                               pool=pool, verbose=False)
    x = torch.randn(8, 16)
    for _ in range(AUTO_MEASURING_STEPS + 1):
        train_step(model, x)
    plan = handle.plan
    assert plan is not None and all(b > 0 for b in plan["layer_bytes"][:3])
    handle.disable()


def test_activation_schedule_fetches_after_other_hooks_on_the_layer_output(pool):
    """A hook that another library registers on a layer's output after the layer's forward
    (as FSDP2 does to unshard the layer for its backward) runs before the engine fetches the
    groups the schedule brings back at that layer, and gradients stay bitwise."""
    ref = small_model(n=4)
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    use_schedule(handle.engine, 4, release_at={0: 2, 1: 4, 2: 5}, fetch_at={3: [2], 2: [1], 1: [0]})
    log = []
    log_layer_backward(model, log, "library")
    log_fetch_and_restore(handle, log, key=lambda event: event.layer)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(ref, x)
    for _ in range(2):
        log.clear()
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
        for fetched, at in ((2, 3), (1, 2), (0, 1)):
            assert log.index(("library", at)) < log.index(("fetch", fetched)) < log.index(("library", at - 1))


@pytest.mark.parametrize("budget", [None, 1 << 40, "quarter"])
def test_activation_auto_frees_the_allocator_cache_once_as_the_plan_settles(pool, monkeypatch, budget):
    """Note [fresh segments] in auto/memory.py: the device allocator's cached blocks are given back
    once, at the step the plan settles, never while it is measured, probed or checked; a budget
    plan that keeps every layer is checked against timed steps like any other."""
    model = small_model(n=6)
    x = torch.randn(8, 16)
    if budget == "quarter":
        budget = predicted_peak_keeping_all(model, x, pool) // 4
    freed = []
    monkeypatch.setattr(_device, "empty_cache", lambda: freed.append(settled(handle.plan)))
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False,
                                               memory_budget_bytes=budget)

    def settled(plan):
        if plan is None:
            return False
        return plan["check"]["settled"] if budget is not None else plan["tuning"]["settled"]

    steps = 0
    while not settled(handle.plan):
        assert not freed and steps < max_tuning_steps(6) + 20
        train_step(model, x)
        steps += 1
    assert freed == [True]
    for _ in range(3):
        train_step(model, x)
    assert freed == [True]
    handle.disable()


class _Allocator:
    """The device allocator's statistics as auto mode reads them, moved by the model's spikes."""

    def __init__(self, held):
        self.held = self.peak = held

    def spike(self, nbytes):  # nbytes allocated and freed again
        self.peak = max(self.peak, self.held + nbytes)

    def max_memory_allocated(self, device=None):
        return self.peak

    def memory_allocated(self, device=None):
        return self.held

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.held


class _SpikeInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, allocator, nbytes):
        ctx.allocator, ctx.nbytes = allocator, nbytes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.allocator.spike(ctx.nbytes)
        return grad, None, None


class _SpikyBlock(torch.nn.Module):
    """A block whose forward and backward each allocate and free a working buffer."""

    def __init__(self, block, allocator, forward_bytes, backward_bytes):
        super().__init__()
        self.block, self.allocator = block, allocator
        self.forward_bytes, self.backward_bytes = forward_bytes, backward_bytes

    def forward(self, x):
        self.allocator.spike(self.forward_bytes)
        # Its backward runs after the block's: the last thing of this layer's backward.
        return self.block(_SpikeInBackward.apply(x, self.allocator, self.backward_bytes))


def test_activation_auto_budget_measures_memory_stretch_by_stretch(pool, monkeypatch):
    """Note [memory beside the activations] in auto/budget.py: the measuring step reads the
    allocator's peak of each layer's forward, of the head and the loss with their backward, and
    of each layer's backward, and the plan adds each where it was measured."""
    allocator = _Allocator(10 ** 9)
    for name in ("max_memory_allocated", "memory_allocated", "reset_peak_memory_stats"):
        monkeypatch.setattr(_device, name, getattr(allocator, name))
    forward, backward, tail = [3, 5, 2, 4], [40, 10, 30, 20], 25
    model = small_model()
    model.blocks = torch.nn.ModuleList(
        _SpikyBlock(block, allocator, f << 20, b << 20) for block, f, b in zip(model.blocks, forward, backward))
    head = model.head
    model.head = torch.nn.Sequential(torch.nn.Identity(), head)
    model.head[0].register_forward_hook(lambda *args: allocator.spike(tail << 20))
    runs = []
    from offload.activation.auto import planner as _activation_plan

    class Recorded(_activation_plan.BudgetRun):
        def __init__(self, *args):
            super().__init__(*args)
            runs.append((args[-1], self))

    monkeypatch.setattr(_activation_plan, "BudgetRun", Recorded)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False,
                                               memory_budget_bytes=1 << 40)
    for _ in range(3):
        train_step(model, torch.randn(8, 16))
    assert handle.layers == [f"blocks.{i}" for i in range(4)]
    (memory, run), = runs
    assert memory.at_start == 10 ** 9 and memory.tail == 10 ** 9 + (tail << 20)
    assert list(memory.forward) == [10 ** 9 + (f << 20) for f in forward]
    assert list(memory.backward) == [10 ** 9 + (b << 20) for b in backward]
    assert memory.step_peak == 10 ** 9 + (max(backward) << 20)
    # Less the layers' own activations (a few KiB here) where the plan's replay holds them.
    layers = handle.plan["layers"]
    for i, layer in enumerate(layers):
        assert 0 <= (forward[i] << 20) - layer["forward_extra_bytes"] < 1 << 20
        assert 0 <= (backward[i] << 20) - layer["backward_extra_bytes"] < 1 << 20
    assert 0 <= (tail << 20) - handle.plan["tail_bytes"] < 1 << 20 and handle.plan["fixed_bytes"] == 10 ** 9
    handle.disable()
