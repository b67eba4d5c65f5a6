"""Weight sync between two processes: a gloo world on the CPU (CI) and an NCCL world on two GPUs.

The sender owns a small Llama built from a config (no downloads); the receiver
rebuilds the same model with the same seed and the same edits, so it knows what
must arrive, and checks bit for bit after every sync.
"""

import sys

import pytest
import torch
import torch.distributed as dist

import offload
from _workers import assert_equal_weights, fully_shard_layers, spawn_world

SRC = 0


def _llama(seed: int, device="cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device).eval()


def _train_step(model, step: int) -> None:
    """A deterministic in-place change of every weight (the same on both ranks)."""
    gen = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.device, p.dtype))


def _sd(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


# ---------------------------------------------------------------- scenarios (module level: spawn pickles them)


def _scenario_syncs(rank, device):
    """Device mode three times with training in between, cast with kept dtypes, then the iterator."""
    model = _llama(0, device)
    keep = ["*norm.weight"]
    if rank == SRC:
        sender = offload.WeightSender(src=SRC, bucket_bytes=16 << 10)
        cast = offload.WeightSender(src=SRC, bucket_bytes=16 << 10, dtype=torch.bfloat16, keep_dtype=keep)
        for step in range(3):
            _train_step(model, step)
            t = sender.send(model)
            assert t["buckets"] > 3 and t["pack_ms"] > 0 and t["version"] == step
            assert t["transfer_ms"] > 0  # timed on the host where the collective runs off the accelerator
            assert t["host_copy_ms"] == 0.0 and t["gather_ms"] == 0.0  # phases that did not run
        cast.send(model)
        sender.send(model.state_dict())
        return
    receiver = offload.WeightReceiver(src=SRC)
    mine = _llama(1, device)  # different values until the sync
    replica = _llama(0, device)
    for step in range(3):
        _train_step(replica, step)
        t = receiver.load(mine)
        assert receiver.version == step and t["unpack_ms"] > 0 and t["gather_ms"] == 0.0 and t["transfer_ms"] > 0
        assert_equal_weights(_sd(mine), _sd(replica), f"sync {step}")
    # bf16 except the norms, which keep fp32
    low = _llama(1, device).to(torch.bfloat16)
    for name, mod in low.named_modules():
        if name.endswith("norm"):
            mod.weight.data = mod.weight.data.float()
    receiver.load(low)
    want = {n: (t if n.endswith("norm.weight") else t.to(torch.bfloat16)) for n, t in _sd(replica).items()}
    assert_equal_weights(_sd(low), want, "cast")
    got = dict(receiver.receive(copy=True))  # lm_head and embed_tokens are split over 16 KiB buckets
    assert_equal_weights(got, _sd(replica), "receive")
    assert receiver.timings["transfer_ms"] > 0


def _scenario_host_cache(rank, device):
    """Snapshots taken while training goes on; an older version is what arrives; eviction."""
    model = _llama(0, device)
    replica = _llama(0, device)
    if rank == SRC:
        sender = offload.WeightSender(src=SRC, bucket_bytes=32 << 10, mode="host_cache", keep_versions=2)
        v0 = sender.snapshot(model)
        sender.wait_snapshot(v0)
        _train_step(model, 0)  # the trainer goes on: v0 must not see this
        v1 = sender.snapshot(model)
        sender.wait_snapshot(v1)
        _train_step(model, 1)
        t = sender.send(version=v0)
        assert t["version"] == v0 and t["host_copy_ms"] > 0 and t["transfer_ms"] > 0
        sender.send(version=v1)
        sender.send(model)  # snapshot v2 and send it; v0 is evicted
        assert sender.versions == [1, 2]
        with pytest.raises(ValueError, match="version 0 is not cached"):
            sender.send(version=0)
        return
    receiver = offload.WeightReceiver(src=SRC)
    mine = _llama(1, device)
    receiver.load(mine)
    assert receiver.version == 0
    assert_equal_weights(_sd(mine), _sd(replica), "version 0")
    _train_step(replica, 0)
    receiver.load(mine)
    assert_equal_weights(_sd(mine), _sd(replica), "version 1")
    _train_step(replica, 1)
    receiver.load(mine)
    assert receiver.version == 2
    assert_equal_weights(_sd(mine), _sd(replica), "version 2")


def _scenario_bad_receiver(rank, device):
    """A receiver whose parameter has the wrong shape or dtype raises naming it; the sender is not left hanging."""
    model = _llama(0, device)
    if rank == SRC:
        sender = offload.WeightSender(src=SRC, bucket_bytes=64 << 10)
        for _ in range(4):
            sender.send(model)
        return
    receiver = offload.WeightReceiver(src=SRC)
    wrong = _llama(1, device)
    sd = wrong.state_dict()
    bad_shape = dict(sd, **{"model.norm.weight": torch.zeros(65, device=device)})
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' has shape \\[64\\] in the bucket but the "
                                         "destination has shape \\[65\\]"):
        receiver.load(bad_shape)
    bad_dtype = dict(sd, **{"lm_head.weight": sd["lm_head.weight"].double()})
    with pytest.raises(ValueError, match="tensor 'lm_head.weight' is float32 in the bucket but the destination "
                                         "is float64"):
        receiver.load(bad_dtype)
    missing = {n: t for n, t in sd.items() if n != "model.norm.weight"}
    with pytest.raises(ValueError, match="received tensor 'model.norm.weight' but the target has no tensor"):
        receiver.load(missing)
    receiver.load(wrong)  # and the next sync works
    assert_equal_weights(_sd(wrong), _sd(model), "after errors")


def _scenario_bad_source(rank, device):
    """A bad source tensor is refused before anything is sent: the receiver, waiting for a sync, gets the next
    good one (it would otherwise wait for buckets that never come until the group's timeout). Then a bad plan
    is refused by the receiver, which still drains its buckets."""
    good = {"w": torch.randn(1000, 100, generator=torch.Generator().manual_seed(0)).to(device),
            "b": torch.arange(100, dtype=torch.float32, device=device)}
    if rank == SRC:
        sender = offload.WeightSender(src=SRC, bucket_bytes=64 << 10)
        bad = {
            r"must be a contiguous strided tensor \(layout torch.strided, shape \[100\], stride \[2\]\)":
                torch.randn(100, 2, device=device).t()[0],
            r"must be a contiguous strided tensor \(layout torch.sparse_coo": torch.eye(100, device=device)
                .to_sparse()[0],
            "is a meta tensor, which has no data to send": torch.empty(100, device="meta"),
        }
        for message, tensor in bad.items():
            with pytest.raises(ValueError, match=f"WeightSender.send: tensor 'b' {message}"):
                sender.send(dict(good, b=tensor))
        sender.send(good)
        # A plan that disagrees with itself ('b' claims 40 elements, its bytes hold 100): the receiver refuses
        # it naming the tensor, and still takes the buckets, so this send returns and the next sync works.
        liar = offload.WeightSender(src=SRC, bucket_bytes=64 << 10)
        lie = offload.plan_buckets(good, 64 << 10).to_dict()
        lie["entries"] = [dict(e, shape=[40]) if e["name"] == "b" else e for e in lie["entries"]]
        plan_of = liar._plan  # a private patch: no public call makes a sender send a plan it does not pack by

        def lying_plan(items):
            plan, plan_id, fresh = plan_of(items)
            plan.to_dict = lambda: lie  # what is broadcast; the buckets are packed by the true plan
            return plan, plan_id, fresh

        liar._plan = lying_plan
        liar.send(good)
        offload.WeightSender(src=SRC, bucket_bytes=64 << 10).send(good)
        return
    receiver = offload.WeightReceiver(src=SRC)
    mine = {n: torch.zeros_like(t) for n, t in good.items()}
    receiver.load(mine)
    assert_equal_weights(mine, good, "after refused sources")
    mine = {n: torch.zeros_like(t) for n, t in good.items()}
    with pytest.raises(ValueError, match=r"WeightReceiver: the plan from rank 0: tensor 'b' has shape \[40\] "
                                         r"\(40 elements\) but holds elements \[0, 100\)"):
        receiver.load(mine)
    receiver.load(mine)
    assert_equal_weights(mine, good, "after a refused plan")


def _scenario_subgroup(rank, device):
    """Three ranks, a sync group of ranks 0 and 2: rank 1 (a trainer peer outside it) constructs a sender with
    the same ranks and is gather-only; rank 2 receives bit for bit; members and non-members are told apart."""
    model = _llama(0, device)
    sender = offload.WeightSender(src=SRC, ranks=[0, 2], bucket_bytes=32 << 10)  # new_group: every rank calls it
    group = sender.group  # the sync group on ranks 0 and 2, the non-member sentinel on rank 1
    if rank == 1:
        assert not sender.member
        for step in range(2):
            t = sender.send(model)
            assert t["bytes"] == 0 and t["buckets"] == 0 and t["version"] == step
        with pytest.raises(ValueError, match="WeightReceiver: this rank \\(1\\) is not in the group"):
            offload.WeightReceiver(src=SRC, group=group)
        return
    with pytest.raises(ValueError, match="WeightSender: src must be a rank of the group, got src=1 for ranks"):
        offload.WeightSender(src=1, group=group)
    if rank == SRC:
        assert sender.member
        with pytest.raises(ValueError, match="WeightSender: reserve_sms must be an int >= 0, got -1"):
            offload.WeightSender(src=SRC, group=group, reserve_sms=-1)
        with pytest.raises(TypeError, match="WeightReceiver: reserve_sms must be an int >= 0, got float"):
            offload.WeightReceiver(src=SRC, group=group, reserve_sms=1.5)
        for step in range(2):
            _train_step(model, step)
            assert sender.send(model)["bytes"] > 0
        return
    receiver = offload.WeightReceiver(src=SRC, group=group)
    mine = _llama(1, device)
    for step in range(2):
        _train_step(model, step)
        receiver.load(mine)
        assert_equal_weights(_sd(mine), _sd(model), f"subgroup sync {step}")


def _sharded_llama(seed: int, device):
    """FSDP2 over both ranks: every decoder layer, then the root."""
    model = _llama(seed, device)
    return fully_shard_layers(model, model.model.layers, device)


def _train_step_sharded(model, step: int) -> None:
    """`_train_step` on DTensor parameters: the same full-size deltas, each rank adding its shard."""
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for p in model.parameters():
            delta = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
            p.add_(distribute_tensor(delta, p.device_mesh, p.placements))


def _scenario_fsdp2_host_cache(rank, device):
    """FSDP2-sharded trainer on both ranks: every rank snapshots (the gathers are collective), rank 0 sends,
    rank 1 receives into a plain model and matches an unsharded replica bit for bit, sync after sync."""
    model = _sharded_llama(0, device)
    sender = offload.WeightSender(src=SRC, bucket_bytes=32 << 10, mode="host_cache", dtype=torch.bfloat16,
                                  keep_dtype=["*norm.weight"])
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    if rank == SRC:
        for step in range(3):
            _train_step_sharded(model, step)
            v = sender.snapshot(model)
            sender.wait_snapshot(v)
            t = sender.send(version=v)
            assert t["version"] == step and t["buckets"] > 3 and t["host_copy_ms"] > 0
        return
    receiver = offload.WeightReceiver(src=SRC)
    replica = _llama(0, device)
    mine = _llama(1, device).to(torch.bfloat16)
    for name, mod in mine.named_modules():
        if name.endswith("norm"):
            mod.weight.data = mod.weight.data.float()
    for step in range(3):
        _train_step_sharded(model, step)
        v = sender.snapshot(model)  # gathers only: rank 1 keeps no host copy
        assert sender.send(version=v)["bytes"] == 0
        receiver.load(mine)
        assert receiver.version == step
        _train_step(replica, step)
        want = {n: (t if n.endswith("norm.weight") else t.to(torch.bfloat16)) for n, t in _sd(replica).items()}
        assert_equal_weights(_sd(mine), want, f"FSDP2 sync {step}")


class _GatherRecorder:
    """Wraps offload.weights.sources.gather: the most bytes of gathered full tensors alive at once.

    Tensors are tracked by weak reference; a tensor the copy engine still holds
    keeps its Python object (PyTorch preserves it while C++ holds the tensor), so
    what the engine keeps alive counts too.
    """

    def __init__(self):
        import offload.weights.sources as ws

        self._gather = ws.gather
        self.alive = []  # (weakref, nbytes)
        self.peak = 0
        self.calls = 0
        ws.gather = self

    def __call__(self, t):
        import weakref

        full = self._gather(t)
        if full is not t:  # a DTensor was gathered
            self.calls += 1
            self.alive = [(r, n) for r, n in self.alive if r() is not None]
            self.alive.append((weakref.ref(full), full.numel() * full.element_size()))
            self.peak = max(self.peak, sum(n for _, n in self.alive))
        return full


def _scenario_fsdp2_host_cache_per_layer(rank, device):
    """FSDP2 host_cache snapshots gather a bounded group at a time (never a whole layer, never the model), reuse
    the host buffers of evicted versions, and an older version sent after a newer snapshot arrives bit for bit."""
    model = _sharded_llama(0, device)
    recorder = _GatherRecorder()
    bucket = 32 << 10
    sender = offload.WeightSender(src=SRC, bucket_bytes=bucket, mode="host_cache", keep_versions=2)
    replica = _llama(0, device)  # unsharded, the same steps
    sizes = {n: t.numel() * t.element_size() for n, t in replica.state_dict().items()}
    layer = sum(b for n, b in sizes.items() if n.startswith("model.layers.0."))
    bound = max(bucket, max(sizes.values()))  # one group: bucket_bytes, or one larger tensor
    assert bound < layer < sum(sizes.values())
    receiver = None if rank == SRC else offload.WeightReceiver(src=SRC)
    mine = _llama(1, device)
    buffers = {}  # version -> data pointers of its host copies (src)
    for step in range(3):
        versions, wants = [], []
        for half in range(2):  # two snapshots, then both are sent, the older first
            _train_step_sharded(model, 2 * step + half)
            _train_step(replica, 2 * step + half)
            v = sender.snapshot(model)
            assert recorder.peak <= bound, f"{recorder.peak} bytes of gathered tensors alive at once (bound {bound})"
            sender.wait_snapshot(v)
            versions.append(v)
            wants.append(_sd(replica))
        assert versions == [2 * step, 2 * step + 1]
        for v, want in zip(versions, wants):
            if rank == SRC:
                snap = sender._snapshots[v]  # a private read: no seam reports a snapshot's copies and buffers
                assert len(snap.handles) > 2  # several groups, several copies
                buffers[v] = [t.data_ptr() for t in snap.tensors()]
                t = sender.send(version=v)
                assert t["version"] == v and t["bytes"] > 0
            else:
                assert sender.send(version=v)["bytes"] == 0
                receiver.load(mine)
                assert receiver.version == v
                assert_equal_weights(_sd(mine), want, f"FSDP2 version {v}")
        assert sender.versions == versions
    assert recorder.calls == 6 * len(sizes)  # every snapshot gathered every tensor once, on both ranks
    if rank == SRC:  # a version's host buffers are those of the version it evicted
        assert buffers[2] == buffers[0] and buffers[4] == buffers[2] and buffers[3] == buffers[1]


@pytest.mark.slow
def test_weight_sync_gloo_device_mode_consecutive_syncs():
    spawn_world(_scenario_syncs)


@pytest.mark.slow
@pytest.mark.skipif(offload.core._device.accelerator_type() is not None,
                    reason="host_cache snapshots copy from the accelerator; a CPU model on a GPU host is refused "
                           "by copy_to_host (the NCCL test covers host_cache there)")
def test_weight_sync_gloo_host_cache_versions():
    spawn_world(_scenario_host_cache)


@pytest.mark.slow
def test_weight_sync_gloo_bad_receiver_names_tensor():
    spawn_world(_scenario_bad_receiver)


@pytest.mark.slow
def test_weight_sync_gloo_bad_source_and_bad_plan_refused():
    spawn_world(_scenario_bad_source)


@pytest.mark.slow
def test_weight_sync_gloo_rank_outside_group_is_gather_only():
    spawn_world(_scenario_subgroup, world=3)


def test_weight_sync_rejects_bad_keep_versions():
    with pytest.raises(ValueError, match="WeightSender: keep_versions must be an int >= 1, got 0"):
        offload.WeightSender(mode="host_cache", keep_versions=0)
    with pytest.raises(TypeError, match="WeightSender: keep_versions must be an int >= 1, got float"):
        offload.WeightSender(mode="host_cache", keep_versions=1.5)


def test_weight_sync_needs_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        offload.WeightSender()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        offload.WeightReceiver()


_ON_THE_CPU_ONLY = pytest.mark.skipif(
    offload.core._device.accelerator_type() is not None,
    reason="host_cache snapshots copy from the accelerator; the NCCL test covers FSDP2 there")


@pytest.mark.slow
@_ON_THE_CPU_ONLY
def test_weight_sync_gloo_fsdp2_host_cache():
    spawn_world(_scenario_fsdp2_host_cache)


@pytest.mark.slow
@_ON_THE_CPU_ONLY
def test_weight_sync_gloo_fsdp2_host_cache_gathers_per_group():
    spawn_world(_scenario_fsdp2_host_cache_per_layer)


@pytest.mark.cuda
@pytest.mark.multi_gpu
def test_weight_sync_nccl_fsdp2_host_cache():
    spawn_world(_scenario_fsdp2_host_cache, "cuda")


@pytest.mark.cuda
@pytest.mark.multi_gpu
def test_weight_sync_nccl_device_mode():
    spawn_world(_scenario_syncs, "cuda")


@pytest.mark.cuda
@pytest.mark.multi_gpu
def test_weight_sync_nccl_host_cache():
    spawn_world(_scenario_host_cache, "cuda")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
