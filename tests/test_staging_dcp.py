"""offload.AsyncStager under torch.distributed.checkpoint: dcp.async_save through the stager,
then dcp.load, bit for bit (ten saves with training between, the AsyncSaveResponse form,
nested and tied state, structure changes, DTensor placements)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

import offload
from _staging_helpers import assert_same, model_and_optimizer, rich_state, snapshot, tensors_in, train_step
from _workers import gloo_world  # noqa: F401 (fixture)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_staging_dcp_ten_saves_bit_exact(tmp_path, backend, device):
    model, optimizer = model_and_optimizer(device)
    train_step(model, optimizer, device)
    stager = offload.AsyncStager()
    expected, responses = [], []
    for step in range(10):
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": {"step": step, "tag": "run"}}
        expected.append(snapshot(state))
        responses.append(dcp.async_save(state, checkpoint_id=str(tmp_path / f"ckpt{step}"), async_stager=stager))
        train_step(model, optimizer, device)  # change every tensor before the upload finishes
    for response in responses:
        upload = getattr(response, "upload_completion", response)
        upload.result()
    stager.close()
    for step in range(10):
        fresh_model, fresh_optimizer = model_and_optimizer(device)
        train_step(fresh_model, fresh_optimizer, device)
        train_step(fresh_model, fresh_optimizer, device)
        target = {
            "model": fresh_model.state_dict(),
            "optim": fresh_optimizer.state_dict(),
            "extra": {"step": -1, "tag": ""},
        }
        dcp.load(target, checkpoint_id=str(tmp_path / f"ckpt{step}"))
        assert_same(target, expected[step])


def test_staging_dcp_async_save_response(tmp_path, backend, device):
    """With a torch whose async_save takes a future from stage(), the stager gets the
    AsyncSaveResponse form: staging_completion and upload_completion both complete,
    and DCP is not asked to block on staging after starting the upload."""
    from torch.distributed.checkpoint import state_dict_saver

    if not hasattr(state_dict_saver, "AsyncSaveResponse"):
        pytest.skip(f"torch {torch.__version__} has no AsyncSaveResponse (torch >= 2.9)")
    stager = offload.AsyncStager()
    assert stager.should_synchronize_after_execute is False
    state = {"model": {"w": torch.randn(64, 3, device=device), "b": torch.randn(3, device=device)}, "step": 7}
    expected = snapshot(state)
    response = dcp.async_save(state, checkpoint_id=str(tmp_path / "ckpt"), async_stager=stager)
    assert isinstance(response, state_dict_saver.AsyncSaveResponse)
    state["model"]["w"].add_(1)  # after the call: not in the checkpoint
    response.upload_completion.result(timeout=120)  # raises what the upload raised
    assert response.staging_completion.result(timeout=120) is None
    assert response.staging_completion.done() and response.upload_completion.done()
    stager.close()
    target = {"model": {"w": torch.zeros(64, 3, device=device), "b": torch.zeros(3, device=device)}, "step": 7}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    assert_same(target, expected)


def _dcp_round_trip(stager, state, checkpoint_id, target):
    """dcp.async_save `state` through `stager`, change every tensor of it before the
    upload finishes, dcp.load into `target` and compare bit for bit with the state as saved."""
    expected = snapshot(state)
    response = dcp.async_save(state, checkpoint_id=str(checkpoint_id), async_stager=stager)
    for t in tensors_in(state):
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point() and t.element_size() == 1:  # fp8: no arithmetic, its bytes change
            t.view(torch.uint8).add_(1)
        else:
            t.add_(1)
    getattr(response, "upload_completion", response).result(timeout=120)
    dcp.load(target, checkpoint_id=str(checkpoint_id))
    assert_same(target, expected)
    return target


def test_staging_dcp_nested_and_tied_round_trip(tmp_path, backend, device):
    stager = offload.AsyncStager()
    for save in range(3):  # the first save plans, the later ones reuse the plan and buffers
        torch.manual_seed(save)
        state = rich_state(device)
        target = rich_state(device)
        target["tied_b"] = target["tied_a"].clone()  # untied: each key is read from its own checkpoint entry
        for t in tensors_in(target):
            t.zero_()
        _dcp_round_trip(stager, state, tmp_path / f"rich{save}", target)
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False]
    stager.close()


def test_staging_dcp_structure_change_round_trip(tmp_path, backend, device):
    def state(layers, with_optim):
        model = {f"layer{i}.weight": torch.randn(4, i + 2, device=device) for i in range(layers)}
        out = {"model": model, "meta": {"layers": layers}}
        if with_optim:
            steps = {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(4, i + 2, device=device)}
                     for i in range(layers)}
            out["optim"] = {"state": steps, "param_groups": [{"lr": 0.1, "params": list(range(layers))}]}
        return out

    def zeros_like_state(s):
        if isinstance(s, torch.Tensor):
            return torch.zeros_like(s)
        if isinstance(s, dict):
            return {k: zeros_like_state(v) for k, v in s.items()}
        if isinstance(s, list):
            return [zeros_like_state(v) for v in s]
        return s

    stager = offload.AsyncStager()
    shapes = [(3, False), (3, True), (5, True), (3, False)]  # optimizer state appears, the model grows, back
    for number, (layers, with_optim) in enumerate(shapes):
        torch.manual_seed(number)
        s = state(layers, with_optim)
        _dcp_round_trip(stager, s, tmp_path / f"s{number}", zeros_like_state(s))
    assert [r["replanned"] for r in stager.metrics()] == [True, True, True, True]
    stager.close()


def test_staging_dtensor_keeps_placement(tmp_path, gloo_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.randn(8, 4)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "plain": torch.ones(3)}
    stager = offload.AsyncStager()
    staged = stager.stage(state).result()
    assert isinstance(staged["w"], DTensor)
    assert staged["w"].placements == state["w"].placements and staged["w"].device_mesh == mesh
    assert torch.equal(staged["w"].to_local(), full)
    del staged
    response = dcp.async_save(state, checkpoint_id=str(tmp_path), async_stager=stager)
    state["w"].to_local().fill_(0)
    getattr(response, "upload_completion", response).result()
    target = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]), "plain": torch.zeros(3)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    assert torch.equal(target["w"].to_local(), full) and torch.equal(target["plain"], torch.ones(3))
    stager.close()
