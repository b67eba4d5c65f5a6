"""Every reader a user has for a parked model, run in a process of its own (a crash is a
failure the parent sees, not the end of the test run).

    python tests/_parked_readers.py MODEL DEVICE OUT_JSON

MODEL: plain, tied or fsdp2 (a one-rank gloo or NCCL world). Builds the model, parks it with
`offload.offload_params` and runs each reader in turn, recording for each either "bitwise" (what
it wrote or returned is bit for bit the weights before parking), "wrong" (anything else it
returned without raising), or the exception's type and message. Ends by reloading and checking
that the weights are intact. The parent asserts on the record.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload  # noqa: E402


def _model(kind: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 48), torch.nn.Linear(48, 96), torch.nn.GELU(),
                                torch.nn.LayerNorm(96), torch.nn.Linear(96, 64, bias=False))
    if kind == "tied":
        model[4] = torch.nn.Linear(48, 64, bias=False)
        model[3] = torch.nn.LayerNorm(48)
        model[1] = torch.nn.Identity()
        model[4].weight = model[0].weight  # as tie_word_embeddings
    model = model.to(device)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (1,))
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _plain(value):
    """A tensor's values on the host; a DTensor's full tensor."""
    if type(value).__name__ == "DTensor":
        value = value.full_tensor()
    return value.detach().cpu()


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        _plain(got[k]).dtype == want[k].dtype and torch.equal(_plain(got[k]), want[k]) for k in want)


def _dcp_round_trip(model, weights, folder, stager) -> bool:
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    if stager == "none":
        dcp.save(state, checkpoint_id=folder)
    else:
        kwargs = {"async_stager": offload.AsyncStager()} if stager == "offload" else {}
        response = dcp.async_save(state, checkpoint_id=folder, **kwargs)
        getattr(response, "upload_completion", response).result()  # torch >= 2.9 answers with two futures
    # Loaded into tensors of the same kinds (DTensors for FSDP2), all zeros first.
    target = {k: torch.zeros_like(v) if type(v).__name__ != "DTensor" else v.new_zeros(v.shape)
              for k, v in _fresh_state(model).items()}
    dcp.load(target, checkpoint_id=folder)
    return _same(target, weights)


def _fresh_state(model):
    # A state dict of the same structure that is not the parked model's: the weights' shapes,
    # on the compute device (DTensors keep their mesh and placements).
    return {k: v.detach().clone() if type(v).__name__ != "DTensor" else v.detach().full_tensor().clone()
            for k, v in model.state_dict().items()}


def _readers(model, weights, folder):
    first = next(model.parameters())

    def torch_save():
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        return _same(torch.load(buffer, weights_only=False), weights)

    def stager_stage():
        with offload.AsyncStager() as stager:
            return _same(stager.stage(model.state_dict()).result(), weights)

    def pack_state_dict():
        state = model.state_dict()
        got = {}
        for bucket in offload.pack_buckets({k: _plain(v) for k, v in state.items()}, 1 << 20):
            got.update({k: v.clone() for k, v in offload.unpack_bucket(bucket.data, bucket.entries)})
        return _same(got, weights)

    return {
        "state_dict": lambda: _same(model.state_dict(), weights),
        "state_dict_keep_vars": lambda: _same(model.state_dict(keep_vars=True), weights),
        "torch_save": torch_save,
        "dcp_save": lambda: _dcp_round_trip(model, weights, os.path.join(folder, "sync"), "none"),
        "dcp_async_save": lambda: _dcp_round_trip(model, weights, os.path.join(folder, "async"), "default"),
        "dcp_async_save_offload_stager": lambda: _dcp_round_trip(model, weights, os.path.join(folder, "off"),
                                                                 "offload"),
        "async_stager_stage": stager_stage,
        "pack_buckets_state_dict": pack_state_dict,
        "copy_to_host_parameter": lambda: _same(
            {"w": offload.copy_to_host([_local(first)]).wait()[0]}, {"w": _plain(first)}),
        "copy_to_device_into_parameter": lambda: offload.copy_to_device(
            [torch.zeros(_local(first).shape, dtype=first.dtype)], _local(first).device, out=[_local(first)],
            require_pinned=False).wait() and False,
        "pack_buckets_parameter": lambda: list(offload.pack_buckets({"w": first}, 1024)) and False,
        "async_stager_parameter": lambda: offload.AsyncStager().stage({"w": first}).result() and False,
        "forward": lambda: model(torch.zeros(2, 3, dtype=torch.long, device=_local(first).device)) and False,
        "load_state_dict": lambda: model.load_state_dict(_fresh_state(model)) and False,
    }


def _local(t):
    return t.to_local() if type(t).__name__ == "DTensor" else t


def main(kind: str, device_name: str, out_path: str) -> None:
    device = torch.device(device_name)
    if kind == "fsdp2":
        import torch.distributed as dist

        store = tempfile.mkdtemp(prefix="offload-parked-")
        # DCP's async_save needs a CPU backend beside NCCL for its own collectives.
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{store}/store", rank=0, world_size=1)
    model = _model(kind, device)
    weights = {k: _plain(v).clone() for k, v in model.state_dict().items()}
    offload.offload_params(model)
    record = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, reader in _readers(model, weights, folder).items():
            try:
                record[name] = "bitwise" if reader() else "wrong"
            except Exception as exc:  # the record says which, the parent decides what is right
                record[name] = f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, (ValueError, RuntimeError, TypeError)):
                    record[name] += "\n" + traceback.format_exc()
    offload.reload_params(model)
    record["after_reload"] = "bitwise" if _same(model.state_dict(), weights) else "wrong"
    with open(out_path, "w") as f:
        json.dump(record, f)
    sys.stdout.flush()
    os._exit(0)  # a gloo world torn down at finalization is not what this checks (_workers.leave_passed_worker)


if __name__ == "__main__":
    main(*sys.argv[1:4])
