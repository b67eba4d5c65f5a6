"""An RL weight-update loop: a trainer trains a step, hands the new weights to a rollout engine, repeat.

    torchrun --nproc-per-node 2 examples/rl_weight_update.py --placement separate    # trainer GPU 0, rollout GPU 1
    torchrun --nproc-per-node 2 examples/rl_weight_update.py --placement colocated   # both on GPU 0
    torchrun --nproc-per-node 2 examples/rl_weight_update.py --device cpu            # gloo, host memory
    torchrun --nproc-per-node 3 examples/rl_weight_update.py --trainer-ranks 2 --rollout-ranks 1  # many senders
    torchrun --nproc-per-node 3 examples/rl_weight_update.py --trainer-ranks 2 --snapshot  # ... from host snapshots
    torchrun --nproc-per-node 5 examples/rl_weight_update.py --trainer-ranks 4 --trainer-replicas 2  # from HSDP
    torchrun --nproc-per-node 4 examples/rl_weight_update.py --trainer-ranks 2 --rollout-ranks 2 \
        --placement colocated  # rollout rank 2+i beside trainer rank i on GPU i, over IPC

Rank 0 is the trainer, rank 1 the rollout engine. Each iteration the trainer
takes an optimizer step, sends its weights cast to bf16 (`offload.WeightSender`),
then moves its parameters and optimizer state to host memory
(`offload.offload_params`) so the rollout has the device to itself while it
generates, and brings them back (`offload.reload_params`) for the next step. The
rollout receives `(name, tensor)` pairs and loads them through a
`load_weights(pairs)` method, as inference engines take weights, then checks
them against checksums the trainer computed.

Placements: "separate" sends over the world group (NCCL on GPUs); "colocated"
puts both processes on one device and hands the buckets over through device IPC
(`transport="ipc"`, its control messages over a gloo group). With `--device cpu`
(the default on a host without an accelerator) both run with gloo and host memory
(the IPC path's stand-in: shared memory). The defaults suit every device: on the
CPU two ranks run the loop in seconds. It needs torchrun's two processes: started
with plain `python`, it prints the torchrun command and exits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import time

import torch
import torch.distributed as dist

import offload

TRAINER, ROLLOUT = 0, 1


class _PlacementDefault:
    """--placement's default, shown by --help: colocated, or separate with --trainer-ranks."""

    def __str__(self) -> str:
        return "colocated; separate with --trainer-ranks"


def parse_args(argv=None):
    # One set of defaults for every device: the model is small enough for the CPU to run the loop in seconds.
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--placement", choices=("separate", "colocated"), default=_PlacementDefault(),
                   help="separate: a device each, weights over NCCL; colocated: trainer and rollout share a device, "
                        "weights over IPC (with --trainer-ranks N: rollout rank N+i beside trainer rank i)")
    p.add_argument("--device", default="auto",
                   help="auto (the host's accelerator if it has one, else the CPU), cpu, or an accelerator type")
    p.add_argument("--iterations", type=int, default=3, help="training steps, each followed by a weight update")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (the MLP's: 11/4 of it)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    p.add_argument("--bucket-mib", type=int, default=None,
                   help="bucket size in MiB (default: %(default)s, offload's own)")
    p.add_argument("--trainer-ranks", type=int, default=0,
                   help="many senders: this many ranks train under FSDP2 and each sends its own shards, to "
                        "--rollout-ranks ranks; 0: one trainer, one rollout")
    p.add_argument("--trainer-replicas", type=int, default=1,
                   help="with --trainer-ranks: HSDP, the trainer ranks as this many replicas of an FSDP2 shard group "
                        "(a 2-D mesh); each shard goes from one of its replicas")
    p.add_argument("--rollout-ranks", type=int, default=1, help="rollout ranks, with --trainer-ranks")
    p.add_argument("--rollout-tp", type=int, default=1,
                   help="with --trainer-ranks: rollout ranks per engine, each keeping a tensor-parallel slice")
    p.add_argument("--snapshot", action="store_true",
                   help="with --trainer-ranks: each trainer rank snapshots its shards to host memory after its step "
                        "(mode host_cache) and sends from the snapshot")
    args = p.parse_args(argv)
    if isinstance(args.placement, _PlacementDefault):  # many senders: trainers and rollouts on ranks of their own
        args.placement = "separate" if args.trainer_ranks else "colocated"
    return args


# device_kind and pick_device stand again in train_fsdp2.py: each example runs when copied alone.
def device_kind(requested: str) -> str:
    """The device type `--device` names: with auto, the host's accelerator, else the CPU."""
    if requested != "auto":
        return requested
    return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"


def pick_device(requested: str, index: int, needed: int, placement: str) -> torch.device:
    """This rank's device: device `index` of `requested`'s type, of which this host needs `needed`."""
    kind = device_kind(requested)
    if kind == "cpu":
        return torch.device("cpu")
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    count = torch.accelerator.device_count() if accel is not None and accel.type == kind else 0
    if count < needed:
        raise SystemExit(f"{os.path.basename(__file__)}: --placement {placement} needs {needed} {kind} device(s) on "
                         f"this host, but torch sees {count}; use --placement colocated (one device), or pass "
                         "--device cpu (gloo)")
    torch.accelerator.set_device_index(index)
    return torch.device(kind, index)


def build_model(args, device, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


class Rollout:
    """A stand-in inference engine: bf16 weights loaded by name, as `model.load_weights(weights)` does."""

    def __init__(self, model):
        self.model = model.eval()
        self.params = dict(model.state_dict())

    @torch.no_grad()
    def load_weights(self, weights) -> int:
        count = 0
        for name, tensor in weights:
            self.params[name].copy_(tensor)
            count += 1
        return count

    @torch.no_grad()
    def generate(self, prompt, tokens: int = 4):
        ids = prompt
        for _ in range(tokens):
            logits = self.model(input_ids=ids).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        return ids


def checksums(named) -> torch.Tensor:
    """Per tensor, the fp64 sum of its bf16 values: equal on both sides iff the bytes arrived as sent."""
    return torch.stack([t.detach().to(torch.bfloat16).double().sum().cpu() for _, t in named])


def tp_slice(tp_rank: int, tp: int):
    """A tensor-parallel rollout rank's share of each weight: column-parallel matrices (q/k/v, gate/up,
    embeddings, lm_head) by rows, row-parallel ones (o_proj, down_proj) by columns; norms whole."""

    def spec(name, shape):
        if tp == 1 or len(shape) != 2:
            return None
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        if shape[dim] % tp:
            return None
        size = shape[dim] // tp
        return dim, tp_rank * size, (tp_rank + 1) * size

    return spec


def digest(t: torch.Tensor) -> str:
    """The tensor's bytes, hashed: equal digests mean equal bits."""
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def expected_digests(model, tp: int) -> dict:
    """(tp rank, name) -> digest of what that rollout rank must hold: the full bf16 tensor, sliced. Every trainer
    rank takes part (each DTensor is gathered, one at a time, for this check only; the sync gathers nothing)."""
    out = {}
    for name, t in model.state_dict().items():
        full = (t.full_tensor() if hasattr(t, "full_tensor") else t).to(torch.bfloat16)
        for r in range(tp):
            spec = tp_slice(r, tp)(name, tuple(full.shape))
            out[(r, name)] = digest(full if spec is None else full.narrow(spec[0], spec[1], spec[2] - spec[1]))
    return out


def say(line: str) -> None:
    """Print `line` in one write: several ranks share the launcher's stdout, and print's separate
    write of the newline lets another rank's line land between the two."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train_step(model, optimizer, args, it: int, device: torch.device) -> torch.Tensor:
    """One optimizer step of the trainer on a batch of random tokens (the same batches on every run);
    returns the loss."""
    ids = torch.randint(0, args.vocab, (2, 64), generator=torch.Generator().manual_seed(it)).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def trainer_mesh(n: int, replicas: int, device: torch.device):
    """The trainers' device mesh (None on a rollout rank), built on every rank: `new_group` is collective over
    the world. One replica: FSDP2 over ranks 0..n-1. Several: HSDP's 2-D mesh, `replicas` rows of n / replicas
    ranks; FSDP2 shards along a row and replicates down a column."""
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    if replicas == 1:
        group = dist.new_group(list(range(n)))
        return DeviceMesh.from_group(group, device.type) if rank < n else None
    width = n // replicas
    rows = [dist.new_group(list(range(r * width, (r + 1) * width))) for r in range(replicas)]
    columns = [dist.new_group(list(range(c, n, width))) for c in range(width)]
    if rank >= n:
        return None
    return DeviceMesh.from_group([columns[rank % width], rows[rank // width]], device.type,
                                 mesh=torch.arange(n).view(replicas, width), mesh_dim_names=("replicate", "shard"))


def run_many_senders(args, device: torch.device) -> None:
    """--trainer-ranks N --rollout-ranks M: ranks 0..N-1 train under FSDP2 and each sends its own shards
    (`WeightSender(senders=...)`, nothing gathered); ranks N.. are rollout engines, in groups of --rollout-tp
    ranks that each keep a tensor-parallel slice (`WeightReceiver(slices=...)`). Every received tensor is checked
    bit for bit (sha256) against the trainer's; rank 0 ends with `summary {json}`."""
    from torch.distributed.fsdp import fully_shard

    n, m, tp, replicas = args.trainer_ranks, args.rollout_ranks, args.rollout_tp, args.trainer_replicas
    rank, world = dist.get_rank(), dist.get_world_size()
    name = os.path.basename(__file__)
    if world != n + m or m < 1 or tp < 1 or m % tp or replicas < 1 or n % replicas:
        raise SystemExit(f"{name}: --trainer-ranks {n} --rollout-ranks {m} --rollout-tp {tp} --trainer-replicas "
                         f"{replicas} runs under torchrun --nproc-per-node {n + m} (got {world} processes), with "
                         "--rollout-ranks a multiple of --rollout-tp and --trainer-ranks one of --trainer-replicas")
    colocated = args.placement == "colocated"
    if colocated and (m != n or args.snapshot):
        raise SystemExit(f"{name}: --placement colocated pairs each trainer rank with one rollout rank on its device "
                         f"(sending from the device): --rollout-ranks {n}, no --snapshot")
    # Collective over the world, in this order on every rank: the control group, the trainers' mesh, then the
    # sender's groups (one per trainer rank, built by WeightSender / WeightReceiver alike).
    control = dist.new_group(backend="gloo") if device.type != "cpu" else dist.group.WORLD
    trainers = list(range(n))
    mesh = trainer_mesh(n, replicas, device)
    # Colocated: trainer rank i hands the weights to rollout rank n + i over their own (host) group.
    pairs = [dist.new_group([i, n + i], backend="gloo") for i in range(n)] if colocated else None
    bucket = None if args.bucket_mib is None else args.bucket_mib << 20
    seconds, sent, ok = [], 0, True
    if rank < n:
        model = build_model(args, device)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        over = {"transport": "ipc", "group": pairs[rank]} if colocated else {}
        sender = offload.WeightSender(senders=trainers, dtype=torch.bfloat16, bucket_bytes=bucket,
                                      mode="host_cache" if args.snapshot else "device", **over)
        for it in range(args.iterations):
            loss = train_step(model, optimizer, args, it, device)
            start = time.perf_counter()
            if args.snapshot:  # the shards go to host memory now; the send could run while the next step trains
                timings = sender.send(version=sender.snapshot(model))
            else:
                timings = sender.send(model)
            seconds.append(time.perf_counter() - start)
            sent, model_bytes = timings["bytes_sent"], timings["model_bytes"]
            digests = expected_digests(model, tp)
            dist.broadcast_object_list([digests if rank == 0 else None], src=0, group=control)
            if rank == 0:
                say(f"iteration {it} loss {loss.item():.4f} sync_ms {seconds[-1] * 1e3:.2f} bytes_sent "
                    f"{timings['bytes_per_sender']} of {model_bytes}")
    else:
        tp_rank = (rank - n) % tp
        if colocated:
            receiver = offload.WeightReceiver(senders=trainers, transport="ipc", group=pairs[rank - n], src=rank - n,
                                              slices=tp_slice(tp_rank, tp))
        else:
            receiver = offload.WeightReceiver(senders=trainers, slices=tp_slice(tp_rank, tp))
        rollout = Rollout(build_model(args, device, torch.bfloat16)) if tp == 1 else None
        for it in range(args.iterations):
            start = time.perf_counter()
            if rollout is not None:  # a whole model: loaded by name, as an engine's load_weights does
                count = rollout.load_weights(receiver.receive())
                got = rollout.params
            else:  # a tensor-parallel engine's shards
                got = dict(receiver.receive())
                count = len(got)
            seconds.append(time.perf_counter() - start)
            box = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            want = {n_: d for (r, n_), d in box[0].items() if r == tp_rank}
            ok = ok and got.keys() == want.keys() and all(digest(got[n_]) == d for n_, d in want.items())
            if rollout is not None:
                rollout.generate(torch.zeros(1, 4, dtype=torch.long, device=device))
            say(f"rollout rank {rank} iteration {it}: {count} tensors received in {seconds[-1] * 1e3:.2f} ms, "
                f"{'bit for bit' if ok else 'DIFFERENT'}")
        model_bytes = receiver.timings["model_bytes"]
    every = [None] * world
    dist.all_gather_object(every, (seconds, sent, ok), group=control)
    if rank == 0:
        summary = {"trainer_ranks": n, "trainer_replicas": replicas, "rollout_ranks": m, "rollout_tp": tp,
                   "iterations": args.iterations,
                   "bitwise": all(o for _, _, o in every),
                   # send() on the slowest trainer rank (a rollout's clock also runs while the trainers train)
                   "seconds": max(s[-1] for s, _, _ in every[:n]),
                   "seconds_per_sync": [max(s[i] for s, _, _ in every[:n]) for i in range(args.iterations)],
                   "bytes_sent_per_rank": [b for _, b, _ in every[:n]], "model_bytes": model_bytes}
        say("summary " + json.dumps(summary))
    bitwise = all(o for _, _, o in every)
    dist.barrier(group=control)
    dist.destroy_process_group()
    if not bitwise:
        raise SystemExit(f"{name}: a rollout's weights differ from the trainer's")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:  # a trainer and a rollout engine: one process cannot be both
        command = shlex.join(["torchrun", "--nproc-per-node", "2", sys.argv[0], *argv])
        raise SystemExit(f"{os.path.basename(__file__)}: needs two processes (rank 0 trains, rank 1 rolls out); "
                         f"launch it with: {command}")
    rank = int(os.environ["RANK"])
    if args.placement == "separate":  # a device per process
        device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", 0)),
                             int(os.environ.get("LOCAL_WORLD_SIZE", 1)), args.placement)
    elif args.trainer_ranks:  # trainer rank i and rollout rank N + i on device i
        n = args.trainer_ranks
        device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", 0)) % n, n, args.placement)
    else:
        device = pick_device(args.device, 0, 1, args.placement)
    separate_gpus = device.type != "cpu" and args.placement == "separate"
    if device.type == "cuda" and args.placement == "colocated" and args.trainer_ranks:
        dist.init_process_group("cuda:nccl,cpu:gloo")  # the trainers' gathers on the devices, IPC signals on the host
    else:
        dist.init_process_group("nccl" if separate_gpus and device.type == "cuda" else "gloo")
    if args.trainer_ranks:
        return run_many_senders(args, device)
    if dist.get_world_size() != 2:
        raise SystemExit(f"{os.path.basename(__file__)}: needs two processes (rank 0 trains, rank 1 rolls out), "
                         f"got {dist.get_world_size()}; run with torchrun --nproc-per-node 2")
    # Small control messages (checksums, and the IPC path's signals) go over gloo.
    control = dist.new_group(backend="gloo") if separate_gpus else dist.group.WORLD
    bucket = None if args.bucket_mib is None else args.bucket_mib << 20
    transport = "ipc" if args.placement == "colocated" else "nccl"
    sync_group = control if transport == "ipc" else None

    if rank == TRAINER:
        model = build_model(args, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sender = offload.WeightSender(sync_group, src=TRAINER, dtype=torch.bfloat16, bucket_bytes=bucket,
                                      transport=transport)
        for it in range(args.iterations):
            loss = train_step(model, optimizer, args, it, device)
            named = list(model.state_dict().items())
            dist.broadcast_object_list([checksums(named)], src=TRAINER, group=control)
            timings = sender.send(named)
            moved = offload.offload_params(model, optimizer=optimizer)  # the rollout gets the device
            dist.barrier(group=control)  # the rollout generates here
            offload.reload_params(model)
            say(f"iteration {it} loss {loss.item():.4f} sync_ms {timings['total_ms']:.2f} "
                f"bytes {timings['bytes']} buckets {timings['buckets']} offloaded_bytes {moved.get('bytes', 0)}")
    else:
        rollout = Rollout(build_model(args, device, torch.bfloat16))
        receiver = offload.WeightReceiver(sync_group, src=TRAINER, transport=transport)
        for it in range(args.iterations):
            box = [None]
            dist.broadcast_object_list(box, src=TRAINER, group=control)
            start = time.perf_counter()
            count = rollout.load_weights(receiver.receive())
            ms = (time.perf_counter() - start) * 1e3
            got = checksums(list(rollout.params.items()))
            if count != len(rollout.params) or not torch.equal(got, box[0]):
                raise SystemExit(f"iteration {it}: the rollout's weights differ from the trainer's")
            out = rollout.generate(torch.zeros(1, 4, dtype=torch.long, device=device))
            dist.barrier(group=control)
            say(f"rollout iteration {it}: {count} tensors loaded in {ms:.2f} ms, checked; generated "
                f"{out.shape[1] - 4} tokens")
    dist.barrier(group=control)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
