"""Weight sync from many senders (`WeightSender(senders=...)`): an FSDP2-sharded trainer on 2 or 3 ranks sends
its shards, with no gather, to one receiver, two replicated receivers, or a tensor-parallel pair that each keep
half of every matrix; gloo on the CPU.

Trainer ranks are 0..N-1 (FSDP2 on a mesh of those ranks only), receivers N..N+M-1. Every receiver rebuilds the
unsharded model with the same seed and the same steps, so it knows what must arrive, and checks every tensor (or
its slice) bit for bit; every trainer checks that the busiest sender sends at most 1.1/N of the model's bytes.
"""

import functools
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import offload
from _workers import gloo_world, spawn_world  # noqa: F401 (fixture: gloo_world)

BUCKET = 16 << 10
KEEP = ["*norm.weight"]


class _Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 3 * hidden)
        self.down = nn.Linear(3 * hidden, hidden)


class _Tiny(nn.Module):
    """Odd sizes (rows not divisible by 2 or 3), a tensor larger than a bucket, a 0-d int buffer, tied weights."""

    def __init__(self, tied: bool, hidden: int = 96, vocab: int = 301, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("step", torch.tensor(7, dtype=torch.int64))


def _model(tied: bool) -> _Tiny:
    torch.manual_seed(0)
    return _Tiny(tied)


def _deltas(model, step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _train_step(model, step: int) -> None:
    """The same full-size change of every parameter, plain or FSDP2-sharded (each rank adds its rows)."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for (name, p), delta in zip(model.named_parameters(), _deltas(model, step).values()):
            if type(p).__name__ == "DTensor":
                delta = distribute_tensor(delta, p.device_mesh, p.placements, src_data_rank=None)
            p.add_(delta)


def _expected(tied: bool, steps: int, cast: bool) -> dict:
    replica = _model(tied)
    for step in range(steps):
        _train_step(replica, step)
    out = {}
    for n, t in replica.state_dict().items():
        keep = not cast or n.endswith("norm.weight") or not t.is_floating_point()
        out[n] = t.clone() if keep else t.to(torch.bfloat16)
    return out


def _tp_slices(half: int):
    """A tensor-parallel rank's half: column-parallel `up` and `head` on dim 0, row-parallel `down` on dim 1."""

    def spec(name, shape):
        if name.endswith("up.weight") or name.endswith("up.bias") or name == "head.weight":
            rows = shape[0] // 2
            return 0, half * rows, shape[0] if half else rows
        if name.endswith("down.weight"):
            cols = shape[1] // 2
            return 1, half * cols, shape[1] if half else cols
        return None

    return spec


def _cut(t: torch.Tensor, spec) -> torch.Tensor:
    return t if spec is None else t.narrow(spec[0], spec[1], spec[2] - spec[1])


def _check(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    for n in want:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, (what, n, got[n].shape)
        assert torch.equal(got[n], want[n]), f"{what}: {n}"


def _scenario(rank, device, trainers: int, receivers: int, tp: bool, tied: bool):
    """Two syncs in fp32 (load into a target, then receive()), then one cast to bf16 with norms kept in fp32."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    senders = list(range(trainers))
    mesh_group = dist.new_group(senders)  # collective over the world: every rank builds it
    if rank < trainers:
        plain = offload.WeightSender(senders=senders, bucket_bytes=BUCKET, timeout_s=60)
        cast = offload.WeightSender(senders=senders, bucket_bytes=BUCKET, dtype=torch.bfloat16, keep_dtype=KEEP,
                                    timeout_s=60)
        model = _model(tied)
        mesh = DeviceMesh.from_group(mesh_group, device.type)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        if tied:
            assert model.head.weight is model.embed.weight
        for step, sender in enumerate([plain, plain, cast]):
            if step < 2:
                _train_step(model, step)
            t = sender.send(model)
            per_rank, total = t["bytes_per_sender"], t["model_bytes"]
            assert t["bytes_sent"] == per_rank[rank] == t["bytes"] and t["version"] == [0, 1, 0][step]
            assert len(per_rank) == trainers and t["gather_ms"] == 0.0
            assert max(per_rank) <= 1.1 * total / trainers, (per_rank, total)
            if rank == 0:
                print(f"many senders N={trainers}: bytes per sender {per_rank}, model {total} "
                      f"({max(per_rank) * trainers / total:.3f} x 1/N)", flush=True)
        return
    slices = _tp_slices(rank - trainers) if tp else None
    # One receiver per sender object, built in the same order: each builds its groups (collectively).
    receiver = offload.WeightReceiver(senders=senders, slices=slices, timeout_s=60)
    cast_receiver = offload.WeightReceiver(senders=senders, slices=slices, timeout_s=60)
    mesh_model = _model(tied)
    specs = {n: (slices(n, tuple(t.shape)) if slices else None) for n, t in mesh_model.state_dict().items()}
    # load(): into tensors of the slice's shape (zeros until the sync)
    want = {n: _cut(t, specs[n]) for n, t in _expected(tied, 1, cast=False).items()}
    target = {n: torch.zeros_like(t) for n, t in want.items()}
    t = receiver.load(target)
    assert receiver.version == 0 and t["model_bytes"] > 0 and len(t["bytes_per_sender"]) == trainers
    _check(target, want, "load, sync 0")
    # receive(): (name, tensor) pairs, fresh tensors
    want = {n: _cut(t, specs[n]) for n, t in _expected(tied, 2, cast=False).items()}
    got = dict(receiver.receive())
    assert receiver.version == 1
    _check(got, want, "receive, sync 1")
    # cast: bf16, norms kept in fp32, the int buffer as raw bytes
    want = {n: _cut(t, specs[n]) for n, t in _expected(tied, 2, cast=True).items()}
    if tp or tied:
        got = dict(cast_receiver.receive())
    else:  # into a module, in place
        engine = _model(tied).to(torch.bfloat16)
        for name, mod in engine.named_modules():
            if name.endswith("norm"):
                mod.weight.data = mod.weight.data.float()
        cast_receiver.load(engine)
        got = {n: t.detach() for n, t in engine.state_dict().items()}
    _check(got, want, "cast")


def _host_cache_scenario(rank, device, trainers: int):
    """mode="host_cache": each sender snapshots what it owns, training goes on, and a later send delivers the
    snapshot's weights (not the trained-on ones); the next snapshot goes as the latest version."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    senders = list(range(trainers))
    mesh_group = dist.new_group(senders)
    if rank < trainers:
        sender = offload.WeightSender(senders=senders, mode="host_cache", bucket_bytes=BUCKET, timeout_s=60)
        model = _model(False)
        mesh = DeviceMesh.from_group(mesh_group, device.type)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train_step(model, 0)
        assert sender.snapshot(model) == 0 and sender.versions == [0]
        _train_step(model, 1)  # the snapshot holds step 0's weights whatever training does now
        t = sender.send(version=0)
        per_rank, total = t["bytes_per_sender"], t["model_bytes"]
        assert t["version"] == 0 and t["bytes_sent"] == per_rank[rank] and t["gather_ms"] == 0.0
        assert max(per_rank) <= 1.1 * total / trainers, (per_rank, total)
        assert sender.snapshot(model) == 1 and sender.versions == [0, 1]
        assert sender.send()["version"] == 1  # the latest
        with pytest.raises(ValueError, match="version 0 is already cached"):
            sender.snapshot(model, version=0)
        return
    receiver = offload.WeightReceiver(senders=senders, timeout_s=60)
    target = {n: torch.zeros_like(t) for n, t in _model(False).state_dict().items()}
    receiver.load(target)
    assert receiver.version == 0
    _check(target, _expected(False, 1, cast=False), "host_cache snapshot of step 0, sent after step 1")
    _check(dict(receiver.receive()), _expected(False, 2, cast=False), "host_cache, the latest snapshot")


@pytest.mark.slow
def test_weight_sync_many_host_cache_sends_the_snapshot():
    spawn_world(functools.partial(_host_cache_scenario, trainers=2), world=3)


def _run(trainers: int, receivers: int, tp: bool = False, tied: bool = False):
    spawn_world(functools.partial(_scenario, trainers=trainers, receivers=receivers, tp=tp, tied=tied),
                world=trainers + receivers)


@pytest.mark.slow
def test_weight_sync_many_fsdp2_two_senders_one_receiver():
    _run(2, 1)


@pytest.mark.slow
def test_weight_sync_many_fsdp2_three_senders_tied_weights():
    _run(3, 1, tied=True)


@pytest.mark.slow
def test_weight_sync_many_fsdp2_two_replicated_receivers():
    _run(2, 2)


@pytest.mark.slow
def test_weight_sync_many_fsdp2_tensor_parallel_receivers():
    _run(2, 2, tp=True)


def _mesh_2x2(device):
    """A 2x2 mesh over trainer ranks 0..3 ([[0, 1], [2, 3]]); every rank of the world builds its four groups."""
    from torch.distributed.device_mesh import DeviceMesh

    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # mesh dim 1: ranks that differ in column
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # mesh dim 0: ranks that differ in row
    rank = dist.get_rank()
    if rank >= 4:
        return None
    return DeviceMesh.from_group([columns[rank % 2], rows[rank // 2]], device.type,
                                 mesh=torch.arange(4).view(2, 2), mesh_dim_names=("outer", "inner"))


def _mesh_scenario(rank, device, layout: str):
    """Four trainer ranks on a 2x2 mesh: HSDP (FSDP2 over the mesh: Replicate() on the outer dim, Shard(0) on
    the inner one) or 2-D sharding ((Shard(0), Shard(1)) for matrices, (Shard(0), Replicate()) for vectors);
    a receiver of whole tensors and a tensor-parallel half, each checked bit for bit; fp32, then bf16."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    senders = [0, 1, 2, 3]
    mesh = _mesh_2x2(device)
    if mesh is not None:
        plain = offload.WeightSender(senders=senders, bucket_bytes=BUCKET, timeout_s=60)
        cast = offload.WeightSender(senders=senders, bucket_bytes=BUCKET, dtype=torch.bfloat16, keep_dtype=KEEP,
                                    timeout_s=60)
        model = _model(False)
        if layout == "hsdp":
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            source = model
            assert {tuple(p.placements) for p in model.parameters()} == {(Replicate(), Shard(0))}
        else:
            source = {}
            for name, t in model.state_dict().items():
                if t.dim() == 2:
                    source[name] = distribute_tensor(t, mesh, [Shard(0), Shard(1)], src_data_rank=None)
                elif t.dim() == 1:
                    source[name] = distribute_tensor(t, mesh, [Shard(0), Replicate()], src_data_rank=None)
                else:
                    source[name] = t
        for sender in (plain, cast):
            t = sender.send(source)
            per_rank, total = t["bytes_per_sender"], t["model_bytes"]
            assert t["bytes_sent"] == per_rank[rank] and t["gather_ms"] == 0.0 and len(per_rank) == 4
            # The busiest sender: its share plus at most one box several ranks hold (Note [many senders]), here
            # at most half a tensor, and each piece's alignment in the buckets.
            largest_box = max(t.numel() * t.element_size() for t in _model(False).state_dict().values()) // 2
            assert max(per_rank) <= total / 4 + largest_box + (4 << 10), (per_rank, total, largest_box)
            if rank == 0:
                print(f"many senders, {layout} on 2x2: bytes per sender {per_rank}, model {total} "
                      f"({max(per_rank) * 4 / total:.3f} x 1/N)", flush=True)
        return
    slices = _tp_slices(1) if rank == 5 else None
    receiver = offload.WeightReceiver(senders=senders, slices=slices, timeout_s=60)
    cast_receiver = offload.WeightReceiver(senders=senders, slices=slices, timeout_s=60)
    specs = {n: (slices(n, tuple(t.shape)) if slices else None) for n, t in _model(False).state_dict().items()}
    _check(dict(receiver.receive()), {n: _cut(t, specs[n]) for n, t in _expected(False, 0, cast=False).items()},
           f"{layout}, fp32")
    _check(dict(cast_receiver.receive()), {n: _cut(t, specs[n]) for n, t in _expected(False, 0, cast=True).items()},
           f"{layout}, bf16")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "2d"])
def test_weight_sync_many_from_a_two_dimensional_mesh(layout):
    spawn_world(functools.partial(_mesh_scenario, layout=layout), world=6)


def test_weight_sync_many_boxes_match_dtensor_local_shards():
    """The box each mesh coordinate holds (Note [shard boxes]) is DTensor's own local shape and offset, for
    uneven sizes, a dim sharded twice, and shards left empty."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as local_shape_and_offset

    from offload.weights.many_senders import _box_of

    for shape in [(7,), (301, 96), (5, 3), (2, 9, 4)]:
        for mesh_shape in [(3,), (2, 2), (2, 3), (4, 2)]:
            choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
            for placements in itertools.product(choices, repeat=len(mesh_shape)):
                for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
                    want_shape, want_offset = local_shape_and_offset(shape, mesh_shape, list(coordinate), placements)
                    ranges = [[0, n] for n in shape]
                    for dim, start, stop in _box_of(shape, placements, mesh_shape, coordinate):
                        ranges[dim] = [start, stop]
                    what = (shape, mesh_shape, placements, coordinate)
                    assert tuple(stop - start for start, stop in ranges) == tuple(want_shape), what
                    if all(want_shape):  # an empty shard's offset says nothing
                        assert tuple(start for start, _ in ranges) == tuple(want_offset), what


def test_weight_sync_many_rejects_strided_shards(monkeypatch):
    """FSDP2 over a tensor-parallel shard of the same dim interleaves rows: refused by name, not sent wrong."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from offload.weights import sources
    from offload.weights.many_senders import _boxes

    # A DTensor needs a world of four ranks for this mesh; what _boxes reads of it is faked instead.
    monkeypatch.setattr(sources, "is_dtensor", lambda t: True)

    class FakeDTensor:  # what _boxes reads of a DTensor: placements, mesh, shape
        placements = (_StridedShard(0, split_factor=2), Shard(0))
        shape = (8, 4)

        class device_mesh:  # noqa: N801 (an attribute standing in for DeviceMesh)
            mesh = torch.arange(4).view(2, 2)

    with pytest.raises(ValueError, match="tensor 'w' has placements .* _StridedShard is not one of them"):
        _boxes("test", "w", FakeDTensor(), [0, 1, 2, 3])


def test_weight_sync_many_assigns_whole_tensors_by_bytes():
    """Plain tensors are spread over the senders by bytes, the same way on every rank: the busiest sends
    at most its share plus the largest tensor."""
    from offload.weights.bucket_planner import DtypePolicy
    from offload.weights.many_senders import assign

    sizes = [1000, 10, 999, 500, 501, 3, 7, 250, 250, 1, 64, 64]
    items = [(f"t{i}", torch.empty(n, device="meta")) for i, n in enumerate(sizes)]
    owned = assign("test", items, [0, 1, 2], DtypePolicy())
    assert sorted(p.name for own in owned for p, _ in own) == sorted(n for n, _ in items)
    loads = [sum(p.shape[0] for p, _ in own) for own in owned]
    assert max(loads) <= sum(sizes) / 3 + max(sizes)
    assert max(loads) - min(loads) <= max(sizes)
    assert owned == assign("test", items, [0, 1, 2], DtypePolicy())
    for own in owned:  # model order within a sender
        assert [i for _, i in own] == sorted(i for _, i in own)


def test_weight_sync_many_rejects_bad_arguments():
    with pytest.raises(TypeError, match="WeightSender: senders must be a list of global ranks"):
        offload.WeightSender(senders=3)
    with pytest.raises(ValueError, match=r"WeightSender: senders must name each trainer rank once, got \[0, 0\]"):
        offload.WeightSender(senders=[0, 0])
    with pytest.raises(ValueError, match=r"WeightReceiver: senders must hold global ranks \(ints >= 0\), got -1"):
        offload.WeightReceiver(senders=[0, -1])
    with pytest.raises(TypeError, match="WeightReceiver: the slice of tensor 'w' must be \\(dim, start, stop\\)"):
        offload.WeightReceiver(senders=[0], slices={"w": (0, 1)})
    with pytest.raises(ValueError, match="WeightReceiver: the slice of tensor 'w' must have dim >= 0 and 0 <= start "
                                         "<= stop, got \\(dim=0, start=4, stop=2\\)"):
        offload.WeightReceiver(senders=[0], slices={"w": (0, 4, 2)})
    with pytest.raises(TypeError, match="WeightReceiver: slices must be a mapping"):
        offload.WeightReceiver(senders=[0], slices=[0, 1, 2])
    with pytest.raises(ValueError, match="WeightReceiver: slices= takes parts of tensors that several senders="):
        offload.WeightReceiver(slices={"w": (0, 0, 1)})
    with pytest.raises(ValueError, match="WeightReceiver: with senders= and transport 'ipc' the rollout process takes "
                                         "the weights from the trainer on its device, over their group"):
        offload.WeightReceiver(senders=[0], transport="ipc", ranks=[0, 1])
    with pytest.raises(ValueError, match="WeightSender: transport 'ipc' packs from the device"):
        offload.WeightSender(senders=[0], transport="ipc", mode="host_cache")


def test_weight_sync_many_rejects_a_world_without_receivers(gloo_world):  # noqa: F811 (the fixture)
    with pytest.raises(ValueError, match=r"WeightSender: every rank of the sync group \[0\] is a sender"):
        offload.WeightSender(senders=[0])
    with pytest.raises(ValueError, match=r"WeightReceiver: ranks and senders must be ranks of the world \(0 to 0\), "
                                         "got 1"):
        offload.WeightReceiver(senders=[1], ranks=[0])
    with pytest.raises(ValueError, match="WeightSender: senders= builds a group per sender from ranks="):
        offload.WeightSender(dist.group.WORLD, senders=[0])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
