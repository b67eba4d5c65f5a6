"""Auto mode's probes on the CPU path (auto/probes.py): a plan without a budget timed against steps
without offload, the count searched down, and the schedule made again from the probes' copies."""

import copy

import pytest
import torch

import offload
from offload.core import _device
from offload.activation.auto.planner import max_tuning_steps
from _activation_helpers import (  # noqa: F401 (fixtures: one_thread, pool)
    AUTO_MEASURING_STEPS, StepClock, assert_bitwise_equal, one_thread, pool, small_model, train_step,
)

# These tests run models on the CPU, whose activations are host memory already:
# where an accelerator exists the engine rightly leaves them alone, and
# test_activation_cuda.py covers the GPU.
pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)


@pytest.mark.parametrize("overhead, slow", [(0.02, 1.0), (1.0, 1.0), (0.02, 1.25)])
def test_activation_auto_backs_off_on_measured_steps(overhead, slow, pool, capsys):
    ref = small_model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(ref, x)
    for step in range(max_tuning_steps(len(handle.layers))):
        if step == AUTO_MEASURING_STEPS + 1:  # the plan was made as the step before started
            plan = handle.plan
            assert plan["tuning"]["checked"] and not plan["tuning"]["settled"]
            model_k = plan["tuning"]["model_layers"]
            handle.planner.shared.clock = StepClock(handle, overhead, slow)
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
    plan = handle.plan
    # 3% tolerance: 2% per layer allows one layer, 100% none.
    expected = min(model_k, 1) if overhead < 0.03 else 0
    assert plan["tuning"]["settled"] and sum(plan["mask"]) == expected, plan
    # Steps timed alike every time: each verdict is clear from the steps, none left to the model.
    assert plan["tuning"]["verdicts"] and all(v["by"] == "steps" for v in plan["tuning"]["verdicts"])
    # Each probe's baseline ran without offload, in that probe's own minutes (`slow` or not).
    assert plan["tuning"]["baseline_ms"] and set(plan["tuning"]["baseline_ms"].values()) <= {1000.0, 1000.0 * slow}
    assert plan["offload"] == [n for n, m in zip(handle.layers, plan["mask"]) if m]
    assert "settled on" in capsys.readouterr().out
    stats = handle.stats()
    assert stats["layers_offloaded"] == expected
    if expected == 0:
        assert stats["tensors_kept"] == 0  # no hooks at all: a step exactly as without offload
    handle.disable()


class _LateClock(StepClock):
    """Over the tolerance until the plan is made again (its copies ended late), within it after."""

    def seconds(self, a, b):
        plan = self.handle.plan
        self.overhead = 0.0 if plan is not None and "d2h_gbps_replanned" in plan else 1.0
        return super().seconds(a, b)


@pytest.mark.parametrize("why", ["slower", "late"])
def test_activation_auto_plans_again_when_copies_run_slower(why, pool, monkeypatch, capsys):
    """After the first probe, the copies' rate under the plan's compute (here 1/10,000 of the
    rate measured while measuring: these small layers copy faster than they run), or a probe
    over the tolerance whose copies, at the planned rate, the compute stream waited for at the
    release points (here 10,000 times their own time), make the schedule again at a lower
    rate, and the search starts over."""
    from offload.activation.auto import probes as _activation_probes
    from offload.activation.auto.schedule import planned_bytes

    seen = []

    def rate(engine, copies):
        seen.append(len(copies))
        planner = handle.planner
        d2h = planner.prober.tuning[planner.key].d2h
        return d2h / 1e4 if why == "slower" else d2h

    monkeypatch.setattr(_activation_probes, "copy_rate", rate)
    monkeypatch.setattr(_activation_probes, "copies_late", lambda copies: 0.0 if why == "slower" else 1e4)
    model = small_model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool)
    x = torch.randn(8, 16)
    loss_ref, grads_ref = train_step(small_model(), x)
    planned = None
    for step in range(60):
        plan = handle.plan
        if plan is not None and planned is None:
            planned = planned_bytes(plan["layer_bytes"], plan["model_mask"], plan["caps"])
            d2h = plan["d2h_gbps"]
            handle.planner.shared.clock = StepClock(handle, 0.0) if why == "slower" else _LateClock(handle, 1.0)
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
        if plan is not None and plan["tuning"]["settled"]:
            break
    # Once: the offloading steps of the first probe (a warm-up and three timed).
    assert seen == [4]
    if why == "slower":
        assert plan["d2h_gbps_under_compute"] == pytest.approx(d2h / 1e4)
        assert plan["d2h_gbps_replanned"] == pytest.approx(d2h / 1e4)
    else:
        assert plan["d2h_gbps_under_compute"] == pytest.approx(d2h)
        assert plan["d2h_gbps_replanned"] == pytest.approx(d2h / (1 + 1e4))
    assert planned_bytes(plan["layer_bytes"], plan["model_mask"], plan["caps"]) < planned
    assert plan["tuning"]["settled"] and sum(plan["mask"]) == plan["tuning"]["model_layers"]
    assert "under the plan's compute" in capsys.readouterr().out
    handle.disable()


def test_activation_auto_reads_the_usual_step_of_a_probe(pool):
    """The copies' rate and lateness of a probe are those of its usual step (the median over
    its offloading steps): one step whose copies ran slow and waited does not make the plan
    again; steps without timed copies are left out."""
    from offload.activation.auto.probes import copies_late
    from offload.activation.auto.shared import copy_rate

    def step(moved, seconds, waited):
        return {"d2h_bytes": moved, "d2h_seconds": seconds, "forward_wait_seconds": waited}

    usual = [step(100, 1.0, 0.01), step(100, 1.0, 0.0), step(100, 1.25, 0.02)]
    slow = step(100, 2.0, 1.0)  # half the rate, waiting half its copies' time
    untimed = step(0, 0.0, 0.0)
    assert copies_late(usual + [slow, untimed]) == pytest.approx((0.01 + 0.016) / 2)
    assert copies_late([untimed]) == 0.0
    handle = offload.enable_activation_offload(small_model(), "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    rate = copy_rate(handle.engine, usual + [slow, untimed])
    assert rate == pytest.approx((100.0 + 80.0) / 2)  # between the 1.0 s and 1.25 s steps
    assert copy_rate(handle.engine, [untimed]) is None
    handle.disable()


@pytest.mark.parametrize("late, overhead", [(1e4, 0.0), (None, 1.0)])
def test_activation_auto_late_copies_keep_the_plan(late, overhead, pool, monkeypatch):
    """No new schedule for copies at the planned rate where the first probe is within the
    tolerance however late they ended (the waits fit in what the 3% is for), nor where it
    missed with waits within RELEASE_WAIT_TOLERANCE of their time (then the search backs off)."""
    from offload.activation.auto import probes as _activation_probes

    late = _activation_probes.RELEASE_WAIT_TOLERANCE if late is None else late
    monkeypatch.setattr(_activation_probes, "copy_rate",
                        lambda engine, copies: handle.planner.prober.tuning[handle.planner.key].d2h)
    monkeypatch.setattr(_activation_probes, "copies_late", lambda copies: late)
    model = small_model()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(8, 16)
    for step in range(60):
        plan = handle.plan
        if plan is not None and plan["tuning"]["settled"]:
            break
        if plan is not None:
            handle.planner.shared.clock = StepClock(handle, overhead)
        train_step(model, x)
    assert plan["tuning"]["settled"]
    assert "d2h_gbps_replanned" not in plan
    # Within the tolerance: the model's count; over it at every count: none.
    assert sum(plan["mask"]) == (plan["tuning"]["model_layers"] if overhead == 0.0 else 0)
    assert plan["tuning"]["model_layers"] > 0
    handle.disable()
