"""The errors a user of offload.AsyncStager can hit: bad state dicts (also a tensor that
turns bad after the plan is cached), bad arguments; and no warning but offload's own."""

import warnings

import pytest
import torch

import offload
from _staging_helpers import assert_same, snapshot

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.not_standin("the stand-in has no sparse tensors (torch.sparse has no PrivateUse1 kernels there)")
def test_staging_bad_input(device):
    stager = offload.AsyncStager()
    with pytest.raises(ValueError, match=r"state_dict\['m'\]\['w'\] is a meta tensor"):
        stager.stage({"m": {"w": torch.empty(3, device="meta")}})
    with pytest.raises(TypeError, match=r"state_dict\['cfg'\]\[1\] is a builtins.object"):
        stager.stage({"cfg": [1, object()]})
    with pytest.raises(TypeError, match=r"state_dict\['f'\] is a builtins.function"):
        stager.stage({"f": lambda: 0})
    with pytest.raises(ValueError, match="layout torch.sparse_coo"):
        stager.stage({"s": torch.eye(3, device=device).to_sparse()})
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        stager.stage([torch.ones(1)])
    with pytest.raises(TypeError, match="unexpected keyword"):
        stager.stage({}, bogus=1)
    with pytest.raises(ValueError, match="ring_size must be an int >= 1"):
        offload.AsyncStager(ring_size=0)
    with pytest.raises(TypeError, match="ring_size must be an int >= 1"):
        offload.AsyncStager(ring_size=1.5)
    with pytest.raises(ValueError, match="when_busy must be 'wait' or 'raise'"):
        offload.AsyncStager(when_busy="block")
    with pytest.raises(ValueError, match=r"forward_buffers names \['model.nope'\]"):
        offload.AsyncStager(forward_buffers=["model.nope"]).stage({"model": {"w": torch.ones(1, device=device)}})
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        stager.protect(object())


@pytest.mark.not_standin("the stand-in has no sparse tensors (torch.sparse has no PrivateUse1 kernels there)")
def test_staging_bad_tensor_in_a_later_save(device):
    """A tensor that turns meta or sparse after the structure is cached (generated code,
    cached plan) gets the first save's message, not a raw error from reading its pointer."""
    cases = [
        (lambda: torch.empty(4, device="meta"), ValueError, r"state_dict\['m'\]\['w[89]'\] is a meta tensor"),
        (lambda: torch.eye(2, device=device).to_sparse(), ValueError,
         r"state_dict\['m'\]\['w[89]'\] has layout torch.sparse_coo"),
        (lambda: torch.eye(2, device=device).to_sparse_csr(), ValueError,
         r"state_dict\['m'\]\['w[89]'\] has layout torch.sparse_csr"),
    ]
    for watched in (False, True):  # w9 alone, or tied to w8 (a slot whose layout _resolve compares itself)
        stager = offload.AsyncStager(ring_size=1)

        def state(last):
            layer = {f"w{j}": torch.full((4,), float(j), device=device) for j in range(9)}
            layer["w9"] = last
            if watched:
                layer["w8"] = last
            return {"m": layer}

        for _ in range(3):  # the third save runs generated code and the cached plan
            stager.stage(state(torch.ones(4, device=device))).result()
        for make, error, message in cases:
            with pytest.raises(error, match=message):
                stager.stage(state(make()))
        good = state(torch.arange(4.0, device=device))
        assert_same(stager.stage(good).result(), snapshot(good))  # the stager still works
        stager.close()


def test_staging_warnings_are_ours_only():
    # The stager implements synchronize_staging itself: no deprecation warning from the protocol.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload.AsyncStager().synchronize_staging()


def test_staging_busy_timeout_must_be_a_number():
    with pytest.raises(TypeError, match="offload.AsyncStager: busy_timeout_s must be a number of seconds > 0, got str"):
        offload.AsyncStager(busy_timeout_s="")
    with pytest.raises(ValueError, match="offload.AsyncStager: busy_timeout_s must be > 0, got nan"):
        offload.AsyncStager(busy_timeout_s=float("nan"))
