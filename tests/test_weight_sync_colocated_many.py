"""Colocated weight sync from many senders (`WeightSender(senders=..., transport="ipc")`): an FSDP2 (or HSDP)
trainer on N ranks, each paired with a rollout process "on its device", gloo and the IPC transport's
shared-memory stand-in on the CPU (Note [colocated senders]).

Trainer ranks are 0..N-1, rollout ranks N..2N-1; rollout N+i is fed by trainer i over the group {i, N+i}. Every
rollout rebuilds the model with the same seed and steps and checks every tensor bit for bit.
"""

import functools
import sys

import pytest
import torch
import torch.distributed as dist

import offload
from _workers import spawn_world
from test_weight_sync_many import BUCKET, KEEP, _check, _cut, _expected, _mesh_2x2, _model, _tp_slices, _train_step


def _colocated_scenario(rank, device, trainers: int, hsdp: bool, tp: bool):
    """Two syncs in fp32 (load into a target, then receive()), then one cast to bf16 with norms kept in fp32;
    with `tp` each rollout process keeps its tensor-parallel half (rollout i the half i)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    senders = list(range(trainers))
    pairs = [dist.new_group([i, trainers + i]) for i in range(trainers)]  # collective: every rank builds each
    mesh = _mesh_2x2(device) if hsdp else None
    mesh_group = None if hsdp else dist.new_group(senders)
    if rank < trainers:
        plain = offload.WeightSender(senders=senders, transport="ipc", group=pairs[rank], bucket_bytes=BUCKET,
                                     timeout_s=60)
        cast = offload.WeightSender(senders=senders, transport="ipc", group=pairs[rank], bucket_bytes=BUCKET,
                                    dtype=torch.bfloat16, keep_dtype=KEEP, timeout_s=60)
        model = _model(False)
        if mesh is None:
            mesh = DeviceMesh.from_group(mesh_group, device.type)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for step, sender in enumerate([plain, plain, cast]):
            if step < 2:
                _train_step(model, step)
            t = sender.send(model)
            per_rank, total = t["bytes_per_sender"], t["model_bytes"]
            assert t["bytes_sent"] == per_rank[rank] and len(per_rank) == trainers
            assert max(per_rank) <= 1.1 * total / trainers, (per_rank, total)
        return
    pair = rank - trainers
    slices = _tp_slices(pair % 2) if tp else None
    receiver = offload.WeightReceiver(senders=senders, transport="ipc", group=pairs[pair], src=pair, slices=slices,
                                      timeout_s=60)
    cast_receiver = offload.WeightReceiver(senders=senders, transport="ipc", group=pairs[pair], src=pair,
                                           slices=slices, timeout_s=60)
    specs = {n: (slices(n, tuple(t.shape)) if slices else None) for n, t in _model(False).state_dict().items()}

    def expected(steps: int, cast: bool) -> dict:
        return {n: _cut(t, specs[n]) for n, t in _expected(False, steps, cast=cast).items()}

    target = {n: torch.zeros_like(t) for n, t in expected(1, False).items()}
    t = receiver.load(target)
    _check(target, expected(1, False), "colocated load, sync 0")
    assert t["model_bytes"] > 0 and len(t["bytes_per_sender"]) == trainers  # the many-sender figures, as over NCCL
    _check(dict(receiver.receive(copy=True)), expected(2, False), "colocated receive, sync 1")
    _check(dict(cast_receiver.receive(copy=True)), expected(2, True), "colocated, bf16")


@pytest.mark.slow
@pytest.mark.parametrize("trainers,hsdp,tp", [(2, False, False), (3, False, False), (4, True, False),
                                              (2, False, True)])
def test_weight_sync_colocated_many_senders(trainers, hsdp, tp):
    spawn_world(functools.partial(_colocated_scenario, trainers=trainers, hsdp=hsdp, tp=tp), world=2 * trainers)


FAULT_TIMEOUT_S = 2.0
FAULT_BOUND_S = 2 * FAULT_TIMEOUT_S + 8.0  # a sync's bounded waits, and a loaded machine's slack


def _fault_scenario(rank, device):
    """Trainer 1 raises at its second bucket of the second sync: every rank raises a RuntimeError within the bound
    (trainer 0 from its all-gather's timeout, each rollout from its trainer's abort), later syncs on these objects are
    refused, and each rollout's target holds, element by element, the old weights or the new ones."""
    import time

    from torch.distributed.device_mesh import DeviceMesh

    from offload.weights import colocated_many
    from test_faults_weight_sync_many import _check_old_or_new, _source, _weights

    senders = [0, 1]
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mesh_group = dist.new_group(senders)
    if rank in senders:
        sender = offload.WeightSender(senders=senders, transport="ipc", group=pairs[rank], bucket_bytes=4096,
                                      timeout_s=FAULT_TIMEOUT_S)
        mesh = DeviceMesh.from_group(mesh_group, device.type)
        sender.send(_source(0, mesh))
        if rank == 1:
            real, calls = colocated_many.copy_spans, []

            def failing(*args, **kwargs):  # the pack of this sender's second bucket fails
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("injected pack failure")
                return real(*args, **kwargs)

            colocated_many.copy_spans = failing
        start = time.monotonic()
        with pytest.raises(RuntimeError) as failure:
            sender.send(_source(1, mesh))
        assert time.monotonic() - start < FAULT_BOUND_S
        assert ("injected pack failure" if rank == 1 else "the gather of bucket") in str(failure.value)
        with pytest.raises(RuntimeError, match="earlier sync"):
            sender.send(_source(1, mesh))
        return
    pair = rank - 2
    receiver = offload.WeightReceiver(senders=senders, transport="ipc", group=pairs[pair], src=pair,
                                      timeout_s=FAULT_TIMEOUT_S)
    target = {n: torch.zeros_like(t) for n, t in _weights(0).items()}
    receiver.load(target)
    _check(target, _weights(0), "the sync before the failure")
    start = time.monotonic()
    # Its trainer's abort, or its own bounded wait for the next bucket (trainer 0 waits as long in its gather).
    with pytest.raises(RuntimeError, match="failed during the sync|within 2 s"):
        receiver.load(target)
    assert time.monotonic() - start < FAULT_BOUND_S
    _check_old_or_new(target, _weights(0), _weights(1))


@pytest.mark.slow
def test_weight_sync_colocated_many_sender_fails_mid_sync_every_rank_raises():
    spawn_world(_fault_scenario, world=4)


def test_weight_sync_colocated_many_gathered_plan_tiles_each_tensor():
    """The gathered plan (Note [colocated senders]): every sender's bucket k in a slot of the largest one's size,
    each piece a chunk of its full tensor, the chunks numbered in element order and tiling the tensor."""
    from offload.weights.bucket_planner import DtypePolicy
    from offload.weights.colocated_many import gathered_plan
    from offload.weights.many_senders import Piece, plan_senders

    items = [("a", torch.empty(10, 4)), ("b", torch.empty(3000)), ("c", torch.empty(7, 3))]
    every = plan_senders("test", items, [0, 1], DtypePolicy(), 4096, None, (), 256)
    # As a 1-D mesh of two ranks would hold them: "b" and "c" by rows, "a" whole (owned as assign() placed it).
    owned = [[(Piece("b", (3000,), ((0, 0, 1500),)), 1), (Piece("c", (7, 3), ((0, 0, 4),)), 2)],
             [(Piece("a", (10, 4)), 0), (Piece("b", (3000,), ((0, 1500, 3000),)), 1),
              (Piece("c", (7, 3), ((0, 4, 7),)), 2)]]
    plans = []
    for own in owned:
        meta = [(p.name, torch.empty(p.local_shape, device="meta")) for p, _ in own]
        plans.append(offload.plan_buckets(meta, 4096, alignment=256))
    plan, slots = gathered_plan("test", plans, owned, 256)
    assert every.model_bytes == (40 + 3000 + 21) * 4
    assert len(slots) == max(p.num_buckets for p in plans)
    assert plan.bucket_sizes == [2 * s for s in slots] and all(s % 256 == 0 for s in slots)
    for name, numel in (("a", 40), ("b", 3000), ("c", 21)):
        chunks = sorted((e for e in plan.entries if e.name == name), key=lambda e: e.chunk)
        assert [e.start for e in chunks] == sorted(e.start for e in chunks)
        assert sum(e.numel for e in chunks) == numel and chunks[0].start == 0
    # the second sender's entries sit in its slot, past the first sender's
    second = [e for e in plan.entries if e.name == "a"][0]
    assert second.offset >= slots[second.bucket]


def test_weight_sync_colocated_many_refuses_pieces_that_are_not_row_ranges():
    from offload.weights.colocated_many import gathered_plan
    from offload.weights.many_senders import Piece

    owned = [[(Piece("w", (4, 6), ((1, 0, 3),)), 0)], [(Piece("w", (4, 6), ((1, 3, 6),)), 0)]]
    plans = [offload.plan_buckets([("w", torch.empty(4, 3, device="meta"))], 4096, alignment=256)] * 2
    with pytest.raises(ValueError, match="tensor 'w' .* is split into \\[0, 3\\) of dim 1 .* shard it on dim 0"):
        gathered_plan("test", plans, owned, 256)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
