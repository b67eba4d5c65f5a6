"""An RL weight-update loop: a trainer trains a step, hands the new weights to a rollout engine, repeat.

    torchrun --nproc-per-node 2 examples/rl_weight_update.py --placement separate    # trainer GPU 0, rollout GPU 1
    torchrun --nproc-per-node 2 examples/rl_weight_update.py --placement colocated   # both on GPU 0
    torchrun --nproc-per-node 2 examples/rl_weight_update.py --device cpu            # gloo, host memory

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
(the IPC path's stand-in: shared memory).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import offload

TRAINER, ROLLOUT = 0, 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--placement", choices=("separate", "colocated"), default="colocated")
    p.add_argument("--device", default="auto",
                   help="auto (the host's accelerator if it has one, else the CPU), cpu, or an accelerator type")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--bucket-mib", type=int, default=None, help="bucket size (default: offload's)")
    return p.parse_args(argv)


def pick_device(requested: str, index: int, needed: int, placement: str) -> torch.device:
    """This rank's device: device `index` of `requested`'s type, of which this host needs `needed`."""
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    kind = (accel.type if accel is not None else "cpu") if requested == "auto" else requested
    if kind == "cpu":
        return torch.device("cpu")
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


def main(argv=None):
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    if args.placement == "separate":  # a device per process
        device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", 0)),
                             int(os.environ.get("LOCAL_WORLD_SIZE", 1)), args.placement)
    else:
        device = pick_device(args.device, 0, 1, args.placement)
    separate_gpus = device.type != "cpu" and args.placement == "separate"
    dist.init_process_group("nccl" if separate_gpus and device.type == "cuda" else "gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc-per-node 2 (rank 0 trains, rank 1 rolls out)")
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
            ids = torch.randint(0, args.vocab, (2, 64), generator=torch.Generator().manual_seed(it)).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            named = list(model.state_dict().items())
            dist.broadcast_object_list([checksums(named)], src=TRAINER, group=control)
            timings = sender.send(named)
            moved = offload.offload_params(model, optimizer=optimizer)  # the rollout gets the device
            dist.barrier(group=control)  # the rollout generates here
            offload.reload_params(model)
            print(f"iteration {it} loss {loss.item():.4f} sync_ms {timings['total_ms']:.2f} "
                  f"bytes {timings['bytes']} buckets {timings['buckets']} offloaded_bytes {moved.get('bytes', 0)}",
                  flush=True)
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
            print(f"rollout iteration {it}: {count} tensors loaded in {ms:.2f} ms, checked; generated "
                  f"{out.shape[1] - 4} tokens", flush=True)
    dist.barrier(group=control)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
