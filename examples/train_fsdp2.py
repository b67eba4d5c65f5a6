"""Train a Hugging Face causal LM with FSDP2 under torchrun, with activation offload and async checkpoints.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py --activation-offload auto
    torchrun --nproc-per-node 2 examples/train_fsdp2.py --checkpoint-every 50 --checkpoint-dir ckpt [--resume]
    torchrun --nproc-per-node 2 examples/train_fsdp2.py --device cpu    # gloo, every rank on the CPU: a smaller model
    python examples/train_fsdp2.py --device cpu                          # without torchrun: one process

The model is built from a config (no downloads) and sharded with `fully_shard`
per decoder block, then at the root; AdamW; synthetic tokens, the same for a
step whatever run it is in, so a resumed run sees the data an uninterrupted one
would. One accelerator per rank with NCCL (`--device auto`, the default, when
the host has one), or the CPU with gloo; the CPU's default model is smaller
(`--help` shows both). Started without torchrun, the script trains as a world
of one process. Checkpoints are DCP `async_save`s staged
by `offload.AsyncStager`, whose `protect(optimizer)` makes the optimizer step
wait (on the device) for the staging copy. Each step prints its loss, tokens/s,
peak device memory, the host's time to issue it and the caching allocator's retries
and new device allocations, and, with offload on, the bytes offloaded and the exposed wait
(rank 0's, and the largest of any rank's);
the last line rank 0 prints is `summary {...}`, the run's medians after the
warm-up steps as JSON (benchmarks/bench_train_fsdp2.py reads it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import offload

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch releases that kept FSDP2 under _composable
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True)
class ByDevice:
    """A default that depends on the device: `accel` on an accelerator, `cpu` on the CPU."""

    accel: object
    cpu: object

    def __str__(self) -> str:  # what --help shows
        return f"{self.accel}; {self.cpu} on the CPU"


# The model's shape: on an accelerator one whose activations are worth offloading; on the CPU
# one that two ranks on two cores train for the default steps in under a minute.
BATCH, SEQ, HIDDEN = ByDevice(4, 2), ByDevice(1024, 256), ByDevice(1024, 512)
LAYERS, HEADS, VOCAB = ByDevice(8, 4), ByDevice(16, 8), ByDevice(32000, 8192)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto",
                   help="auto (the host's accelerator, one per rank, else the CPU), cpu, or an accelerator type")
    p.add_argument("--activation-offload", choices=("off", "async", "auto"), default="off",
                   help="async: offload the saved activations of every layer but the last --offload-keep-last; "
                        "auto: measure steps, then plan which layers to offload")
    p.add_argument("--offload-min-tensor-bytes", type=int, default=1 << 20,
                   help="saved tensors smaller than this stay on the device")
    p.add_argument("--offload-keep-last", type=int, default=1,
                   help="last layers whose activations stay on the device (with async: the rest are offloaded)")
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the gathered parameters in forward and backward (FSDP2 mixed precision; the "
                        "sharded weights, gradient reduction and optimizer stay fp32)")
    p.add_argument("--steps", type=int, default=20, help="steps to train to (a resumed run ends at the same step)")
    p.add_argument("--batch", type=int, default=BATCH, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size (the MLP's: 11/4 of it)")
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers")
    p.add_argument("--heads", type=int, default=HEADS, help="attention heads (key and value heads: a quarter)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the synthetic tokens")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go, a folder step-N each")
    p.add_argument("--resume", action="store_true", help="start from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--keep-checkpoints", type=int, default=0,
                   help="keep only the newest N saved checkpoints, deleting older ones (0: keep all)")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="first steps left out of the final summary's medians (allocator and kernel warm-up)")
    p.add_argument("--profile-steps", default=None,
                   help="comma-separated steps to record with torch.profiler; rank 0 writes a Chrome trace of "
                        "each into --profile-dir")
    p.add_argument("--profile-dir", default="profiles", help="where the traces of --profile-steps go")
    args = p.parse_args(argv)
    on_cpu = device_kind(args.device) == "cpu"
    for name, value in vars(args).items():
        if isinstance(value, ByDevice):
            setattr(args, name, value.cpu if on_cpu else value.accel)
    try:
        args.profile_steps = {int(s) for s in (args.profile_steps or "").split(",") if s.strip()}
    except ValueError:
        p.error(f"--profile-steps takes comma-separated step numbers, got {args.profile_steps!r}")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        p.error("--checkpoint-every and --resume need --checkpoint-dir")
    return args


# device_kind and pick_device stand again in rl_weight_update.py: each example runs when copied alone.
def device_kind(requested: str) -> str:
    """The device type `--device` names: with auto, the host's accelerator, else the CPU."""
    if requested != "auto":
        return requested
    return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"


def pick_device(requested: str, index: int, needed: int) -> torch.device:
    """This rank's device: device `index` of `requested`'s type, of which the ranks on this host need `needed`."""
    kind = device_kind(requested)
    if kind == "cpu":
        return torch.device("cpu")
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    count = torch.accelerator.device_count() if accel is not None and accel.type == kind else 0
    if count < needed:
        raise SystemExit(f"{os.path.basename(__file__)}: {needed} processes on this host need a {kind} device each, "
                         f"but torch sees {count}; run fewer processes per node, or pass --device cpu (gloo)")
    torch.accelerator.set_device_index(index)
    return torch.device(kind, index)


def init_world(device, argv) -> None:
    """torchrun's world (its environment), or, started without torchrun, a world of this one process."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
        return
    command = shlex.join(["torchrun", "--nproc-per-node", "2", sys.argv[0], *argv])
    print(f"{os.path.basename(__file__)}: started without torchrun, so one process trains alone; for two ranks: "
          f"{command}", file=sys.stderr, flush=True)
    # A store in this process: a world of one has no one to meet, so no address or port.
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 4), vocab_size=args.vocab,
                         max_position_embeddings=args.seq)
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every run
    model = LlamaForCausalLM(config).to(device)
    # An explicit mesh: FSDP2's default one is on the host's accelerator, even for a CPU run.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.param_dtype == "bf16" else None,
                              reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def batch_for(args, step: int, rank: int, device):
    """Synthetic tokens of (step, rank): a resumed run trains on what an uninterrupted one would."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    return ids.to(device)


def latest_checkpoint(root):
    steps = [int(name[5:]) for name in os.listdir(root) if name.startswith("step-") and name[5:].isdigit()]
    return max(steps) if steps else None


def prune_checkpoints(root, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (call only once those are completely written)."""
    steps = sorted(int(name[5:]) for name in os.listdir(root) if name.startswith("step-") and name[5:].isdigit())
    for step in steps[:-keep]:
        shutil.rmtree(os.path.join(root, f"step-{step}"), ignore_errors=True)


def wait_saved(pending) -> None:
    """Wait until a previous async_save is written (its return type differs across torch releases)."""
    done = getattr(pending, "upload_completion", pending)
    done.result()


def peak_memory_bytes(device) -> int:
    accel = getattr(torch, "accelerator", None)
    read = getattr(accel, "max_memory_allocated", None)
    return int(read(device)) if device.type != "cpu" and read is not None else 0


def reset_peak_memory(device) -> None:
    accel = getattr(torch, "accelerator", None)
    reset = getattr(accel, "reset_peak_memory_stats", None)
    if device.type != "cpu" and reset is not None:
        reset(device)


def allocator_counts(device) -> tuple:
    """(retries, device allocations) of the caching allocator so far. A retry frees every cached
    block after an allocation failed and synchronizes the device; a device allocation takes new
    memory from the driver. Both stall the host's launches, so a step that makes them runs slower
    than its kernels and copies alone say."""
    accel = getattr(torch, "accelerator", None)
    read = getattr(accel, "memory_stats", None)
    if device.type == "cpu" or read is None:
        return 0, 0
    stats = read(device)
    return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_device_alloc", 0))


def plan_settled(handle, mode: str) -> bool:
    """Whether activation offload runs its final plan: always in the fixed modes; in auto mode once
    its tuning has settled (before its first plan the step measures, then probe steps alternate
    with steps without offload)."""
    if mode != "auto":
        return True
    plan = handle.plan
    return plan is not None and bool(plan.get("tuning", {}).get("settled", False))


def profiled(args, step: int, rank: int):
    """A torch.profiler context recording this step on rank 0 if --profile-steps names it, else None."""
    if rank != 0 or step not in args.profile_steps:
        return None
    return torch.profiler.profile(activities=torch.profiler.supported_activities())


def summary(args, records, tokens: int, device, handle, settled_at) -> dict:
    """The run in one line of JSON (the last line rank 0 prints): medians over the steps after the
    warm-up and, in auto mode, after its plan settled (the peak memory is also taken from then on)."""
    first = args.warmup_steps
    if settled_at is not None:
        first = max(first, next((i + 1 for i, r in enumerate(records) if r[0] == settled_at), first))
    timed = records[first:] or records
    seconds = [r[1] for r in timed]
    out = {"steps": len(records), "timed_steps": len(timed), "tokens_per_step": tokens,
           "tokens_per_s": tokens / statistics.median(seconds) if seconds else None,
           "step_ms": statistics.median(seconds) * 1e3 if seconds else None,
           "checkpoint_ms": statistics.median(r[2] for r in timed) * 1e3 if timed else None,
           "peak_memory_bytes": peak_memory_bytes(device), "activation_offload": args.activation_offload,
           "checkpoint_every": args.checkpoint_every, "plan_settled": settled_at is not None,
           "tuning_steps": None if settled_at is None else settled_at - records[0][0] + 1}
    if handle is not None:
        s = handle.stats()
        out.update(offloaded_bytes=s["d2h_bytes"], exposed_wait_ms=s["exposed_seconds"] * 1e3,
                   layers_offloaded=s["layers_offloaded"])
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", 0)),
                         int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    init_world(device, argv)
    model = build_model(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start = 0
    if args.resume:
        found = latest_checkpoint(args.checkpoint_dir)
        if found is None:
            raise SystemExit(f"--resume: no checkpoint in {args.checkpoint_dir}")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(args.checkpoint_dir, f"step-{found}"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = found
        if rank == 0:
            print(f"resumed from step {found}", flush=True)

    handle = None
    if args.activation_offload != "off":
        # Auto mode plans with every rank's measurements (a copy one rank does not hide stalls all
        # of them at the next collective) and settles on one plan everywhere: this script's ranks
        # run the same shapes in the same order, as process_group asks.
        group = {"process_group": dist.group.WORLD} if args.activation_offload == "auto" else {}
        handle = offload.enable_activation_offload(model, args.activation_offload,
                                                   min_tensor_bytes=args.offload_min_tensor_bytes,
                                                   keep_last=args.offload_keep_last, **group)
    stager, pending = None, None
    if args.checkpoint_every:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        stager = offload.AsyncStager()
        stager.protect(optimizer)  # optimizer.step() waits, on the device, for the staging copy
        # The save's own collectives run on a background thread: a group of their own keeps
        # them apart from the training collectives of the main thread.
        checkpoint_group = dist.new_group(backend="gloo")

    tokens = args.batch * args.seq * world
    records = []  # (step, seconds, checkpoint seconds) of rank 0, for the summary
    settled_at = None  # the step after which activation offload ran its final plan
    for step in range(start, args.steps):
        # The step's time includes what a save blocks it for (waiting for the previous
        # save, taking the state dict, starting the staging copy).
        t0 = time.perf_counter()
        if stager is not None and step > start and step % args.checkpoint_every == 0:
            # At the top of the step, so the copy overlaps this step's forward and backward.
            if pending is not None:
                wait_saved(pending)
                if args.keep_checkpoints and rank == 0:
                    prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            pending = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                     checkpoint_id=os.path.join(args.checkpoint_dir, f"step-{step}"),
                                     async_stager=stager, process_group=checkpoint_group)
        checkpoint_seconds = time.perf_counter() - t0
        prof = profiled(args, step, rank)
        retries, mallocs = allocator_counts(device)
        with prof if prof is not None else contextlib.nullcontext():
            ids = batch_for(args, step, rank, device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            host_seconds = time.perf_counter() - t0  # the host has issued the step; near the step's time: host-bound
            value = loss.item()  # waits for the step: the time below is the step's
        seconds = time.perf_counter() - t0
        retries_after, mallocs_after = allocator_counts(device)
        if prof is not None:
            os.makedirs(args.profile_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.profile_dir, f"step{step}.json"))
        records.append((step, seconds, checkpoint_seconds))
        if settled_at is None and plan_settled(handle, args.activation_offload):
            settled_at = step
            reset_peak_memory(device)  # the tuning's steps without offload do not set the steady peak
        stats = slowest_wait = None
        if handle is not None:
            stats = handle.stats()
            # The step waits for the rank whose copies were the most exposed (its collectives are
            # late for every rank): every rank's exposed wait, the largest.
            slowest_wait = torch.tensor([stats["exposed_seconds"]], dtype=torch.float64,
                                        device=device if dist.get_backend() != "gloo" else "cpu")
            dist.all_reduce(slowest_wait, op=dist.ReduceOp.MAX)
        if rank == 0:
            line = (f"step {step} loss {value!r} tokens/s {tokens / seconds:.0f} "
                    f"peak_memory_gib {peak_memory_bytes(device) / 2**30:.2f} host_ms {host_seconds * 1e3:.1f} "
                    f"alloc_retries {retries_after - retries} device_allocs {mallocs_after - mallocs}")
            if stager is not None:
                line += f" checkpoint_ms {checkpoint_seconds * 1e3:.1f}"
            if stats is not None:
                line += (f" offloaded_mib {stats['d2h_bytes'] / 2**20:.3f} exposed_wait_ms "
                         f"{stats['exposed_seconds'] * 1e3:.2f} layers_offloaded {stats['layers_offloaded']} "
                         f"exposed_wait_ms_slowest_rank {slowest_wait.item() * 1e3:.2f}")
            print(line, flush=True)
    if pending is not None:
        wait_saved(pending)
        if args.keep_checkpoints and rank == 0:
            prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
    if stager is not None:
        stager.close()
    if rank == 0:
        print("summary " + json.dumps(summary(args, records, tokens, device, handle, settled_at)), flush=True)
    if handle is not None:
        handle.disable()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
