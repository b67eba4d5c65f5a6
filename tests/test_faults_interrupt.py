"""KeyboardInterrupt inside a training step with activation offload on: the interrupted step
leaves no saved-tensor hooks behind and, once its graph is dropped, no host memory held by
offload; the next step's gradients are exact; `disable()` unwraps every layer."""

import copy
import gc

import pytest
import torch
from torch import nn

import offload
from _activation_helpers import MODES, one_thread, small_model, train_step  # noqa: F401 (fixture)
from offload.activation.saved_tensors import top_pack_hook


class _Interrupter(nn.Module):
    """Raises KeyboardInterrupt in its forward (or in its input's backward) when armed."""

    def __init__(self):
        super().__init__()
        self.armed = None  # None, "forward" or "backward"

    def forward(self, x):
        if self.armed == "forward":
            raise KeyboardInterrupt
        if self.armed == "backward" and x.requires_grad:
            def interrupt(grad):
                raise KeyboardInterrupt

            x.register_hook(interrupt)
        return x


def _interruptible(seed=0):
    model = small_model(seed, d=32, n=4)
    stop = _Interrupter()
    model.blocks[2].norm = nn.Sequential(stop, model.blocks[2].norm)  # inside a wrapped layer
    return model, stop


def _assert_clean(pool, baseline):
    assert top_pack_hook() is None  # autograd's saved-tensor hooks stack is empty
    gc.collect()
    assert pool.stats()["in_use_bytes"] == baseline


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_faults_keyboard_interrupt_in_step(backend, mode, where):
    ref, _ = _interruptible()
    model = copy.deepcopy(ref)
    stop = model.blocks[2].norm[0]
    pool = offload.HostPool()
    baseline = pool.stats()["in_use_bytes"]
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, pool=pool, verbose=False)
    x = torch.randn(64, 32)
    _, want = train_step(ref, x)
    steps = 10 if mode == "auto" else 2
    for step in range(steps):
        stop.armed = where if step == steps // 2 else None
        if stop.armed is None:
            _, got = train_step(model, x)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            continue
        with pytest.raises(KeyboardInterrupt):
            train_step(model, x)
        _assert_clean(pool, baseline)
    stop.armed = None
    _, got = train_step(model, x)  # the step after the last interrupted one
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    wrapped = [m for m in model.modules() if "forward" in m.__dict__]
    assert wrapped  # the layers' forwards are wrapped while offload is on
    stop.armed = where
    with pytest.raises(KeyboardInterrupt):
        train_step(model, x)
    handle.disable()  # right after an interrupted step
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    _assert_clean(pool, baseline)
    stop.armed = None
    _, got = train_step(model, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert top_pack_hook() is None
