"""Auto mode's measured steps on the CPU path (auto/measure.py): what each measured step runs and
holds, and the layer times, waits, marks and peaks the plan reads from it."""

import copy
import time

import pytest
import torch

import offload
from offload.core import _device
from offload.core import copy as copy_module
from _activation_helpers import (  # noqa: F401 (fixtures: one_thread, pool)
    AUTO_MEASURING_STEPS, Block, Model, assert_bitwise_equal, one_thread, pool, predicted_peak_keeping_all,
    small_model, train_step,
)

# These tests run models on the CPU, whose activations are host memory already:
# where an accelerator exists the engine rightly leaves them alone, and
# test_activation_cuda.py covers the GPU.
pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)


@pytest.mark.parametrize("case", ["fits", "grows", "budget", "no_room"])
def test_activation_auto_measures_layers_without_offload_when_it_fits(case, pool, monkeypatch):
    """The first measuring step offloads every eligible layer; if a step without offload fits
    (and no budget is set) the two measured ones offload nothing, three while the allocator
    grows; else one more offloads everything. Layer bytes are measured either way. Each step
    measured without offload starts with its stream held, longer than the host took to queue
    the forward before it (Note [measured at the device's pace]); the others are not held."""
    from offload.activation.auto.measure import HOLD_CAP_S, HOLD_HOST_FACTOR

    holds, queued = [], []  # each hold asked for, and the host's time to queue the forward before it

    def hold(device, seconds):
        holds.append(seconds)
        queued.append(handle.planner.measurer.forward_host_s)
        return True

    monkeypatch.setattr(_device, "hold", hold)
    reserved = [0]
    if case == "grows":  # the allocator takes new device memory in every step
        monkeypatch.setattr(_device, "memory_reserved", lambda device=None: reserved[0])
    if case == "no_room":  # 1 KiB of device memory: a step without offload might not fit
        monkeypatch.setattr(_device, "mem_get_info", lambda device=None: (1 << 10, 1 << 10))
    ref = small_model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False,
                                               memory_budget_bytes="1GiB" if case == "budget" else None)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(ref, x)
    offloaded = []
    while handle.plan is None:
        reserved[0] += 1 << 20
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
        offloaded.append(handle.stats()["layers_offloaded"])
        assert len(offloaded) < 6
    dry = case in ("fits", "grows")
    # The plan is made at the next forward: the last entry is the first step with it.
    expected = {"fits": [3, 0, 0], "grows": [3, 0, 0, 0], "budget": [3, 3], "no_room": [3, 3]}[case]
    assert offloaded[:-1] == expected and handle.planner.measure_without_offload is dry
    plan = handle.plan
    assert all(b > 0 for b in plan["layer_bytes"][:3]) and all(f > 0 for f in plan["forward_ms"][:3])
    assert len(holds) == (len(expected) - 1 if dry else 0)
    for seconds, host_s in zip(holds, queued):
        assert host_s > 0 and seconds == min(HOLD_CAP_S, HOLD_HOST_FACTOR * host_s)
    assert plan["measured_hold_ms"] == pytest.approx(holds[-1] * 1e3 if dry else 0.0)


def test_activation_auto_holds_the_stream_as_the_first_layer_opens(pool, monkeypatch):
    """A step measured without offload holds its stream as its first layer opens, after what the
    model does before its layers: a Hugging Face model reads its attention mask on the host
    there, a wait for the device that would outlast a hold queued as the forward starts, and
    leave the first layer timed at the host's pace (Note [measured at the device's pace])."""
    order = []

    def hold(device, seconds):
        order.append("hold")
        return True

    monkeypatch.setattr(_device, "hold", hold)

    class ReadsBeforeItsLayers(Model):
        def forward(self, x):
            order.append("read")  # where the host would wait for the device
            return super().forward(x)

    torch.manual_seed(0)
    model = ReadsBeforeItsLayers()
    model.blocks[0].norm.register_forward_pre_hook(lambda module, args: order.append("layer 0"))
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    steps = []
    while handle.plan is None:
        order.clear()
        train_step(model, x)
        steps.append(list(order))
        assert len(steps) < 6
    held = [step for step in steps if "hold" in step]
    assert len(held) == 2  # the two steps measured without offload (as in the test above)
    for step in held:
        assert step.count("hold") == 1 and step.index("read") < step.index("hold") < step.index("layer 0")


def test_activation_auto_takes_each_layers_least_time_over_the_measured_steps(pool, monkeypatch):
    """A stretch of one measured step slowed down (a shared device, the host falling behind) does
    not reach the plan: each layer's forward and backward time, and the head's, is the least
    over the steps measured without offload; a backward one step did not time takes the other's.
    The marks of when a layer saved its bytes, taken in the last step, move onto the least time."""
    from offload.activation.auto.measure import StepMeasurer

    measured = iter([  # seconds, as `step_times` reads them: the first measured step, then the last
        {"fwd": [0.001, 0.005, 0.001, 0.001], "bwd": [None, 0.002, 0.005, 0.002], "tail": 0.004, "head_bwd": 0.001},
        {"fwd": [0.004, 0.001, 0.001, 0.001], "bwd": [None, 0.005, 0.002, None], "tail": 0.001, "head_bwd": 0.003},
    ])
    monkeypatch.setattr(StepMeasurer, "step_times", lambda self: next(measured))
    monkeypatch.setattr(StepMeasurer, "saved_marks", lambda self, record: [(0.5, 0.002), (1.0, 0.004)])
    model = small_model(n=4)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    for _ in range(AUTO_MEASURING_STEPS + 1):
        train_step(model, torch.randn(8, 16))
    plan = handle.plan
    assert next(measured, None) is None  # both steps were read
    assert plan["forward_ms"] == pytest.approx([1.0] * 4)
    # Layer 0's backward is never timed (it ends the step): the median ratio to its forward.
    assert plan["backward_ms"] == pytest.approx([2.0] * 4)
    assert (plan["tail_ms"], plan["head_backward_ms"]) == pytest.approx((1.0, 1.0))
    # Layer 0 took 4 ms in the last step and 1 ms at least: its marks at a quarter of their times.
    assert [t for _, t in plan["saved_ms"][0]] == pytest.approx([0.5, 1.0])
    assert [t for _, t in plan["saved_ms"][1]] == pytest.approx([2.0, 4.0])  # its least is the last step's
    handle.disable()


class _SlowBlock(Block):
    """A block whose forward takes at least FORWARD_S of host time: its compute, on the CPU path."""

    FORWARD_S = 0.02

    def forward(self, x):
        time.sleep(self.FORWARD_S)
        return super().forward(x)


def test_activation_auto_budget_times_layers_without_their_copy_waits(pool, monkeypatch):
    """A budget measures its steps with every layer offloaded in the window, where the step
    waits for copies: for the oldest copy out as a layer closes, for a layer's copy back as its
    backward starts. Those waits are the bus's time, not the layers': with each wait made to
    take 80 ms, a layer's backward and the stretch from the layers' end to backward's start
    are still measured at their compute (Note [copy waits are not compute])."""
    model = small_model(n=4)
    for block in model.blocks:
        block.__class__ = _SlowBlock
    x = torch.randn(8, 16)
    budget = predicted_peak_keeping_all(model, x, pool) // 2
    wait_s, forward_ms = 0.08, _SlowBlock.FORWARD_S * 1e3
    synchronize = copy_module.CopyHandle.synchronize

    def slow_synchronize(self):
        time.sleep(wait_s)
        synchronize(self)

    monkeypatch.setattr(copy_module.CopyHandle, "synchronize", slow_synchronize)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False,
                                               memory_budget_bytes=budget)
    waits = []  # per wait the planner was told of: whether in backward
    wait_ended = handle.planner.measurer.wait_ended

    def record(layer, begun, backward):
        waits.append(backward)
        wait_ended(layer, begun, backward=backward)

    monkeypatch.setattr(handle.planner.measurer, "wait_ended", record)
    for _ in range(3):
        train_step(model, x)
    plan = handle.plan
    assert plan is not None and len(plan["backward_ms"]) == 4
    assert set(waits) == {False, True}, "the measured steps did not wait for copies both ways: nothing is tested"
    # Each layer's forward holds its sleep, and no wait is taken from it. Its backward sleeps
    # not at all: with the wait for its copy back in it, it would be the cap of 3x the forward.
    assert all(f >= forward_ms for f in plan["forward_ms"]), plan["forward_ms"]
    assert all(b < 1.5 * forward_ms for b in plan["backward_ms"]), plan["backward_ms"]
    assert plan["tail_ms"] < wait_s * 1e3 / 2, plan["tail_ms"]
    handle.disable()


class _PeakInLossModel(Model):
    """Tells a stand-in for the device's peak memory that the step peaks between the head and
    the loss (a Llama's loss upcasts its logits there)."""

    def __init__(self, peak):
        super().__init__()
        self.peak = peak

    def forward(self, x):
        self.peak[0] = 0  # the peak memory statistic is reset as each step starts
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        h = self.head(x)  # saves its input and weight: the 1st and 2nd tensors after the layers
        self.peak[0] = 100
        return h.square().mean()  # the 3rd


def test_activation_auto_finds_the_last_save_before_the_peak(pool, monkeypatch):
    peak = [0]
    monkeypatch.setattr(_device, "max_memory_allocated", lambda device=None: peak[0])
    torch.manual_seed(0)
    model = _PeakInLossModel(peak)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    for _ in range(AUTO_MEASURING_STEPS + 1):
        train_step(model, torch.randn(8, 16))
    m, ms = handle.plan["before_peak"]
    assert m == 2 and 0.0 <= ms < 1.0  # seconds from the layers' end to the head's save: well under one
    # The peak reached before any tensor is saved after the layers (inside them): no such point.
    monkeypatch.setattr(_device, "max_memory_allocated", lambda device=None: 100)
    handle.disable()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    for _ in range(AUTO_MEASURING_STEPS + 1):
        train_step(model, torch.randn(8, 16))
    assert handle.plan["before_peak"] is None


def test_activation_auto_marks_when_layers_save_their_bytes(pool):
    """The measured steps mark when each layer has saved every eighth of its bytes: the plan
    holds, per eligible layer, marks of a rising share saved at rising times within its
    forward, past the last eighth; and the layer's bytes after each of its new spans."""
    from offload.activation.forward import PROFILE_POINTS

    model = small_model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    while handle.plan is None:
        train_step(model, torch.randn(64, 16))
    plan = handle.plan
    eligible = [not k for k in handle.keep]
    assert any(eligible)
    for i, marks in enumerate(plan["saved_ms"]):
        if not eligible[i]:
            continue
        shares = [share for share, _ in marks]
        times = [t for _, t in marks]
        assert 0 < len(marks) <= PROFILE_POINTS and shares == sorted(shares)
        assert (PROFILE_POINTS - 1) / PROFILE_POINTS <= shares[-1] <= 1
        assert shares[0] >= 1 / PROFILE_POINTS and times == sorted(times)
        assert 0 <= times[0] and times[-1] <= plan["forward_ms"][i]
        record = handle.planner.measurer.records[i]  # and its bytes after each new span
        ends = record["span_ends"]
        assert ends == sorted(set(ends)) and ends[-1] == record["capped"] > 0
