"""A parked model is never read as if its storages held their values: every reader gets the weights
bit for bit from the host mirror, or an error that names reload_params (Note [parked reads]).

Each model runs its readers in a process of its own (tests/_parked_readers.py), so a reader that
crashes the process fails the test instead of ending the run.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import offload
from offload.core import _device

from _workers import spawn_world

_READERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_parked_readers.py")

# What each reader must do with a parked model: give the weights bit for bit, or refuse by name.
_BITWISE = ("state_dict", "state_dict_keep_vars", "torch_save", "dcp_save", "dcp_async_save",
            "dcp_async_save_offload_stager", "async_stager_stage", "pack_buckets_state_dict", "after_reload")
_REFUSED = {
    "copy_to_host_parameter": ("ValueError", "offload.copy_to_host: tensors[0] has no data"),
    "copy_to_device_into_parameter": ("ValueError", "offload.copy_to_device: out[0] has no data"),
    "pack_buckets_parameter": ("ValueError", "tensor 'w' has no data"),  # a DTensor's: its local shard's
    "async_stager_parameter": ("ValueError", "offload.AsyncStager.stage: state_dict['w'] has no data"),
    "forward": ("RuntimeError", "are parked on the host by offload.offload_params"),
    "load_state_dict": ("RuntimeError", "so load_state_dict has nowhere to write"),
}


def _run_readers(tmp_path, kind: str, device: torch.device) -> dict:
    out = tmp_path / f"{kind}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(_READERS),
                                                                     os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, _READERS, kind, str(device), str(out)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0 and out.exists(), (
        f"the readers of a parked {kind} model ended the process (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _device_for_subprocess(device: torch.device) -> torch.device:
    if device.type not in ("cpu", "cuda"):
        pytest.skip("the reader process builds its model on cpu or cuda")
    return torch.device("cuda:0") if device.type == "cuda" else device


@pytest.mark.parametrize("kind", ["plain", "tied", "fsdp2"])
def test_param_offload_parked_readers_get_the_weights_or_a_named_error(tmp_path, kind, device):
    record = _run_readers(tmp_path, kind, _device_for_subprocess(device))
    for name in _BITWISE:
        assert record[name] == "bitwise", f"{name}: {record[name]}"
    for name, (kind_of_error, words) in _REFUSED.items():
        assert record[name].startswith(kind_of_error + ":"), f"{name}: {record[name]}"
        assert words in record[name] and "reload_params" in record[name], f"{name}: {record[name]}"


def test_param_offload_parked_state_dict_aliases_the_mirror_per_storage(device):
    """One host storage per parked storage (tied weights share one), spanning exactly its bytes: torch.save
    writes the weights once, not the whole mirror block; reload takes the aliases away."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False)).to(device)
    model[1].weight = model[0].weight
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 2, dtype=torch.long, device=device)).sum().backward()
    opt.step()  # the mirror holds the gradient and AdamW's moments too
    weight = model[0].weight.detach().cpu().clone()
    offload.offload_params(model, grads=True, optimizer=opt)
    state = model.state_dict()
    assert state.keys() == {"0.weight", "1.weight"}
    assert state["0.weight"].untyped_storage()._cdata == state["1.weight"].untyped_storage()._cdata
    assert state["0.weight"].untyped_storage().nbytes() == weight.numel() * weight.element_size()
    assert state["0.weight"].device.type == "cpu" and torch.equal(state["0.weight"], weight)
    offload.reload_params(model)
    assert _device.normalize_device(model.state_dict()["0.weight"].device) == _device.normalize_device(device)
    assert torch.equal(model.state_dict()["0.weight"].cpu(), weight)


def test_param_offload_parked_module_is_unhooked_after_reload(device):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 8))).to(device)
    hooks = [(len(m._forward_pre_hooks), len(m._state_dict_hooks), len(m._load_state_dict_pre_hooks))
             for m in model.modules()]
    offload.offload_params(model)
    with pytest.raises(RuntimeError, match=r"this Sequential are parked .* so its Linear cannot run; call "
                                           r"offload.reload_params\(model\) first"):
        model[1][0](torch.zeros(2, 8, device=device))
    offload.reload_params(model)
    assert [(len(m._forward_pre_hooks), len(m._state_dict_hooks), len(m._load_state_dict_pre_hooks))
            for m in model.modules()] == hooks
    model(torch.zeros(2, 8, device=device))


def _send_parked(rank, device):
    """Rank 0 parks its model and sends it twice; rank 1 receives the first sync into its own parked model
    (refused by name, after the buckets are drained, so the sender is not left waiting) and the second into
    the reloaded model. On the host the sender reads the mirror through the state dict; on an accelerator
    it refuses, naming reload_params."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 24)).to(device)
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        offload.offload_params(model)
        sender = offload.WeightSender(src=0, bucket_bytes=1 << 10)
        for _ in range(2):
            if device.type == "cpu":
                sender.send(model)
            else:
                with pytest.raises(ValueError, match="reload_params"):
                    sender.send(model)
        offload.reload_params(model)
        assert all(torch.equal(v.cpu(), weights[k]) for k, v in model.state_dict().items())
    elif device.type == "cpu":
        for p in model.parameters():
            torch.nn.init.zeros_(p)
        receiver = offload.WeightReceiver(src=0)
        offload.offload_params(model)
        with pytest.raises(ValueError, match=r"offload.WeightReceiver.load: the target Sequential is parked by "
                                             r"offload.offload_params; call offload.reload_params\(target\)"):
            receiver.load(model)
        offload.reload_params(model)
        receiver.load(model)
        assert all(torch.equal(v.cpu(), weights[k]) for k, v in model.state_dict().items())


def test_param_offload_parked_model_sends_its_weights_and_refuses_to_receive():
    spawn_world(_send_parked, "cpu")
