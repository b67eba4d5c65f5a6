"""`verify=True`: each offloaded group is checksummed as it leaves and when it is back; a difference
raises `ActivationMismatch` naming the layer and the tensor (Note [verify] in offload/activation/verify.py)."""

import copy

import pytest
import torch

import offload
from offload.core import _device
from offload.activation import engine as act
from offload.activation.verify import ActivationMismatch, checksums
from _activation_helpers import (  # noqa: F401 (fixtures: one_thread, pool)
    assert_bitwise_equal, one_thread, pool, small_model, train_step,
)

# CPU models: where an accelerator exists the engine rightly leaves them alone (test_activation_cuda.py).
pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_verify_passes_exact_copies_and_keeps_gradients_bitwise(pool, mode):
    ref = small_model()
    model = copy.deepcopy(ref)
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0, min_group_bytes=0, keep_last=0,
                                               pool=pool, verify=True, verbose=False)
    x = torch.randn(8, 16)
    for _ in range(2):
        loss_ref, grads_ref = train_step(ref, x)
        loss, grads = train_step(model, x)
        assert torch.equal(loss, loss_ref)
        assert_bitwise_equal(grads, grads_ref)
    assert handle.stats()["groups_fetched"] > 0  # the checks ran on copies back
    handle.disable()


def test_verify_names_the_layer_and_tensor_of_a_corrupted_copy(pool, monkeypatch):
    """One byte changed in the copy back of the second layer's group: its backward raises, naming
    the layer and the tensor, where without verify the step would end with wrong gradients."""
    real = act.ActivationEngine._copy_back
    copied_back = []  # the destinations of the copies back, the latest last

    def landed(self, source, out):  # a private patch: only the copy itself can be corrupted
        handle = real(self, source, out)
        handle.synchronize()
        copied_back.append(out)
        return handle

    def corrupt(event):  # a group's "fetched" event follows the copy back it issued
        if event.kind == "fetched" and event.layer == 1:
            copied_back[-1][0][0] += 1

    monkeypatch.setattr(act.ActivationEngine, "_copy_back", landed)
    for verify in (False, True):
        ref = small_model()
        model = copy.deepcopy(ref)
        handle = offload.enable_activation_offload(model, "sync", min_tensor_bytes=0, min_group_bytes=0, keep_last=0,
                                                   pool=pool, verify=verify, verbose=False)
        handle.add_listener(corrupt)
        x = torch.randn(8, 16)
        _, grads_ref = train_step(ref, x)
        if not verify:
            _, grads = train_step(model, x)
            assert any(not torch.equal(g, h) for g, h in zip(grads, grads_ref))  # silently wrong
            continue
        with pytest.raises(ActivationMismatch, match=r"verify=True\): the activations of layer 'blocks.1' came "
                                                     r"back different from what was saved: span 0 of \d+, saved "
                                                     r"through a float32 \[8, 16\] tensor"):
            train_step(model, x)


def test_checksums_tell_a_swap_of_two_words_apart():
    """The sums of bytes and of words stay equal when two words trade places; every other word's do not."""
    a = torch.arange(64, dtype=torch.uint8)
    b = a.clone()
    b[0:4], b[4:8] = a[4:8].clone(), a[0:4].clone()
    sums_a, sums_b = checksums([a]), checksums([b])
    assert sums_a[0, :2].tolist() == sums_b[0, :2].tolist()
    assert not torch.equal(sums_a, sums_b)


def test_verify_must_be_a_bool():
    with pytest.raises(TypeError, match="offload.enable_activation_offload: verify"):
        offload.enable_activation_offload(small_model(), verify="yes")
    with pytest.raises(TypeError, match="offload.activation_offload: verify"):
        offload.activation_offload(verify=1)
