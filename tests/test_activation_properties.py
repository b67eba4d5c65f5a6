"""Activation offload under drawn option sets: every combination of the engine's options that a
user can pass gives the gradients of the model without offload, bit for bit, on the core's
cycle and on the Python one (a listener moves a native step onto the Python cycle), and leaves
no host block in use once the step's graph is gone.

The fixed tests choose one option set per behaviour; these draw them together (window size,
group merging, thresholds, kept layers, checkpointing, verify, several forwards under one
backward, a no-grad pass between steps, a mask every layer saves), where an interaction could
misplace a span.
"""

import gc

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import offload
from offload.core import _device
from _activation_helpers import assert_bitwise_equal, grads_of, one_thread, small_model  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.skipif(_device.accelerator_type() is not None,
                       reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine"),
    pytest.mark.filterwarnings("ignore:.*nothing will be offloaded"),  # drawn keep_first + keep_last may keep all
    pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad"),  # a reentrant checkpoint's no-grad pass
]

EXAMPLES = 30
# Derandomized, no shrinking: a failing draw is reported as drawn, the same on every run.
DRAWN = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])

OPTIONS = st.fixed_dictionaries({
    "mode": st.sampled_from(["async", "sync", "auto"]),  # auto: its measured steps, then its plan
    "resident_groups": st.integers(1, 3),
    "min_tensor_bytes": st.sampled_from([0, 1, 256, 4096]),
    "min_group_bytes": st.sampled_from([None, 0, 2048, 1 << 16]),
    "keep_first": st.integers(0, 1),
    "keep_last": st.integers(0, 2),
    "verify": st.booleans(),
})
STEPS = st.fixed_dictionaries({
    "d": st.sampled_from([8, 16, 24]),
    "layers": st.integers(2, 5),
    "rows": st.integers(3, 9),
    "ckpt": st.sampled_from([None, "non-reentrant", "reentrant"]),
    "forwards": st.integers(1, 2),  # forwards whose losses one backward sums
    "steps": st.integers(1, 3),
    "no_grad_between": st.booleans(),
    "listen": st.booleans(),
    "mask": st.booleans(),  # one mask every layer saves (Note [shared constants])
})


def _steps(model, inputs, case):
    """Run `case["steps"]` training steps on `inputs`; return each step's loss and gradients."""
    results = []
    for step in range(case["steps"]):
        model.zero_grad(set_to_none=True)
        loss = sum(model(x + step) for x in inputs)
        loss.backward()
        results.append((loss.detach(), grads_of(model)))
        if case["no_grad_between"]:
            with torch.no_grad():
                model(inputs[0])
    return results


@DRAWN
@given(options=OPTIONS, case=STEPS)
def test_activation_drawn_options_bitwise_and_no_block_left(backend, options, case):
    model = small_model(seed=0, d=case["d"], n=case["layers"], ckpt=case["ckpt"], mask=case["mask"])
    reference = small_model(seed=0, d=case["d"], n=case["layers"], ckpt=case["ckpt"], mask=case["mask"])
    gen = torch.Generator().manual_seed(case["rows"])
    inputs = [torch.randn(case["rows"], case["d"], generator=gen) for _ in range(case["forwards"])]
    want = _steps(reference, inputs, case)

    pool = offload.HostPool()
    handle = offload.enable_activation_offload(model, pool=pool, verbose=False, **options)
    events = []
    if case["listen"]:
        handle.add_listener(events.append)
    got = _steps(model, inputs, case)
    for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(got, want)):
        assert torch.equal(loss, want_loss), f"step {step}: loss"
        assert_bitwise_equal(grads, want_grads)

    stats = handle.stats()
    offloaded_layers = len(handle.offloaded_layers())
    if options["min_tensor_bytes"] <= 1 and offloaded_layers and case["ckpt"] is None and options["mode"] != "auto":
        # (A layer checkpointed by the model's own call saves only its input, before the
        # layer's forward, and so in the group before it.)
        assert stats["d2h_bytes"] > 0 and stats["groups_offloaded"] > 0
    if case["listen"]:
        # In each step, the groups fetched back are those read back, each once, and only groups
        # copied out and let go on the device are fetched (a group still held when backward
        # reads it is served from the device, and let go after its last read, or never: fetched
        # and restored never).
        for step in {e.step for e in events}:
            serials = {kind: [e.serial for e in events if e.step == step and e.kind == kind]
                       for kind in ("closed", "released", "fetched", "restored")}
            pieces = [(e.serial, e.offset) for e in events if e.step == step and e.kind == "fetched"]
            for kind, seen in (*serials.items(), ("fetched piece", pieces)):
                if kind != "fetched":  # a plan may fetch a group in pieces: each piece once
                    assert len(seen) == len(set(seen)), f"step {step}: a group {kind} twice"
            assert set(serials["fetched"]) == set(serials["restored"])
            assert set(serials["fetched"]) <= set(serials["released"]) <= set(serials["closed"])
    handle.disable()
    del got, model, handle
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0, "a host block is still in use after the step's graph is gone"
