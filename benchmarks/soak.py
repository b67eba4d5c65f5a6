"""Soak: many repetitions of each capability, memory sampled throughout, results checked bitwise.

    python benchmarks/soak.py --out DIR [--quick]

Sections: activation offload ("async" and "auto") of a small Hugging Face Llama built from a
config, staged DCP saves (`offload.AsyncStager`), weight syncs between two accelerators (NCCL),
and parameter offload/reload cycles. Each samples device memory in use, the host pool's reserved
and in-use bytes and the process RSS after every repetition, and says whether each is flat after
warm-up: its largest value after warm-up exceeds its value at the end of warm-up by at most its
bound (Note [soak bounds]). At intervals each result is compared bit for bit with a reference
computed without offload. Writes DIR/soak.json and prints one row per section: repetitions,
bitwise checks (how many, how often, mismatches), growth after warm-up against its bound, and
what was lost (computed from the checks and the bounds). Exits 1 if any section is not flat or
not exact. `--quick` runs a handful of repetitions on whatever device there is (the CPU test
uses it).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload  # noqa: E402
from offload.core import _device  # noqa: E402

# Note [soak bounds]
# ~~~~~~~~~~~~~~~~~~
# Device memory is sampled as the caching allocator's allocated bytes, after a synchronize and
# one small allocation: a block freed after record_stream() (parameter offload frees the
# storages its copy reads that way) counts as allocated until the allocator processes its
# event, which it does on an allocation; sampled without it the figure says whether that
# happened yet, not what is held. The tensors alive at a sample are the same set at every
# repetition (the soak drops its own references before it samples), so the figure can move
# only where a tensor made again at every repetition lands in a cached block larger than it:
# the allocator hands out a large-pool block without splitting off a remainder of at most
# ALLOCATOR_SLACK_BYTES (its small-allocation size, 1 MiB), and small-pool blocks are split
# exactly. The device bound of a section is therefore that slack times the tensors over that
# size it makes again each repetition and holds at the sample (an activation step's
# gradients); 0 where it holds none (a staged save, an offloaded model).
# The host pool hands out blocks by size class and carves a new block only where no free one
# of its class is left: a repetition's blocks whose copies are not yet seen complete cannot be
# reused, so the pool may hold one more repetition's working set before it stops growing. Its
# bound is POOL_BOUND_BYTES or POOL_BOUND_FRACTION of the figure, whichever is larger. RSS
# gets RSS_BOUND_BYTES: the interpreter's and the allocators' own caches move it a little.
ALLOCATOR_SLACK_BYTES = 1 << 20
POOL_BOUND_BYTES = 4 << 20
POOL_BOUND_FRACTION = 0.02
RSS_BOUND_BYTES = 64 << 20

FULL = {"activation_steps": 1000, "saves": 300, "syncs": 100, "param_cycles": 100, "check_every": 50,
        "warmup": 20}
QUICK = {"activation_steps": 12, "saves": 8, "syncs": 6, "param_cycles": 8, "check_every": 4, "warmup": 3}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Samples:
    """Memory after each repetition, and the bitwise checks made."""

    def __init__(self, device, pool, warmup: int, remade_large: int = 0):
        """`remade_large`: tensors over ALLOCATOR_SLACK_BYTES the section makes again at every
        repetition and holds at the sample (Note [soak bounds])."""
        self.device, self.pool, self.warmup = device, pool, warmup
        self.device_bound = remade_large * ALLOCATOR_SLACK_BYTES
        self.series = {"device_bytes": [], "pool_reserved_bytes": [], "pool_in_use_bytes": [], "rss_bytes": []}
        self.checks = 0
        self.checked_reps = 0
        self.mismatches = []

    def sample(self) -> None:
        on_accel = _device.is_accelerator(self.device)
        if on_accel:  # Note [soak bounds]: what is held, not which freed blocks await their events
            _device.synchronize(self.device)
            torch.empty(1, device=self.device)
        stats = self.pool.stats()
        self.series["device_bytes"].append(_device.memory_allocated(self.device) if on_accel else 0)
        self.series["pool_reserved_bytes"].append(stats["reserved_bytes"])
        self.series["pool_in_use_bytes"].append(stats["in_use_bytes"])
        self.series["rss_bytes"].append(_rss_bytes())

    def checked(self) -> None:
        """One repetition's result was checked (its tensors through `check`)."""
        self.checked_reps += 1

    def check(self, what: str, got, want) -> None:
        self.checks += 1
        if not (got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)):
            self.mismatches.append(what)

    def summary(self, name: str, reps: int, seconds: float, **extra) -> dict:
        flat = {}
        for key, values in self.series.items():
            if len(values) <= self.warmup:
                flat[key] = {"flat": True, "growth_bytes": 0, "bound_bytes": 0, "samples": len(values)}
                continue
            base = values[self.warmup - 1]
            if key == "rss_bytes":
                bound = RSS_BOUND_BYTES
            elif key == "device_bytes":
                bound = self.device_bound
            else:
                bound = max(POOL_BOUND_BYTES, int(POOL_BOUND_FRACTION * base))
            growth = max(values[self.warmup:]) - base
            flat[key] = {"flat": growth <= bound, "growth_bytes": growth, "bound_bytes": bound,
                         "after_warmup": base, "last": values[-1], "samples": len(values)}
        is_flat = all(v["flat"] for v in flat.values())
        exact = bool(self.checks) and not self.mismatches
        if not self.checks:
            lost = "unchecked"
        elif self.mismatches:
            lost = f"{len(self.mismatches)} tensors differ"
        elif not is_flat:
            lost = "memory grew past its bound"
        else:
            lost = "nothing"
        return {"section": name, "repetitions": reps, "seconds": round(seconds, 2), "warmup": self.warmup,
                "memory": flat, "checks": self.checks, "checked_repetitions": self.checked_reps,
                "mismatches": self.mismatches, "flat": is_flat, "exact": exact, "lost": lost, **extra}


# ------------------------------------------------------------ activation offload


def _llama(device, quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2) if quick else dict(hidden_size=512, intermediate_size=1408,
                                                          num_hidden_layers=6, num_attention_heads=8,
                                                          num_key_value_heads=4)
    config = LlamaConfig(vocab_size=512, max_position_embeddings=1024, **size)
    config._attn_implementation = "eager"  # the same kernels with and without offload
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad for p in model.parameters()]


def soak_activation(device, counts, quick: bool, mode: str) -> dict:
    ref = _llama(device, quick)
    model = copy.deepcopy(ref)
    pool = offload.HostPool()
    handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0 if quick else 1 << 20, pool=pool,
                                               verbose=False)
    # A step's gradients are made again at every step (zero_grad(set_to_none=True)) and held at the sample.
    remade = sum(p.numel() * p.element_size() > ALLOCATOR_SLACK_BYTES for p in model.parameters() if p.requires_grad)
    samples = Samples(device, pool, counts["warmup"] if mode != "auto" else max(counts["warmup"], 12 if quick else 60),
                      remade_large=remade)
    batch, seq = (2, 32) if quick else (4, 512)
    gen = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    steps = counts["activation_steps"]
    for step in range(steps):
        ids = torch.randint(0, 512, (batch, seq), generator=gen).to(device)
        got = _step(model, ids)  # parameters fixed: every step is checkable against the reference
        if step % counts["check_every"] == 0 or step == steps - 1:
            want = _step(ref, ids)
            samples.checked()
            for i, (a, b) in enumerate(zip(got, want)):
                samples.check(f"step {step} grad {i}", a, b)
            del want
            ref.zero_grad(set_to_none=True)  # the reference's gradients are not held at the sample
        del got
        samples.sample()
    _device.synchronize(device)
    seconds = time.perf_counter() - start
    handle.disable()
    return samples.summary(f"activation_{mode}", steps, seconds,
                           checked="every gradient vs the same step without offload")


# ------------------------------------------------------------ staged DCP saves


def _train_state(device, quick: bool):
    torch.manual_seed(0)
    width = 64 if quick else 512
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
                                torch.nn.LayerNorm(width)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def soak_staging(device, counts, quick: bool, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model, optimizer = _train_state(device, quick)
    pool = offload.HostPool()
    stager = offload.AsyncStager(pool=pool)
    stager.protect(optimizer)
    samples = Samples(device, pool, counts["warmup"])
    width = model[0].in_features
    pending, kept = None, []
    start = time.perf_counter()
    saves = counts["saves"]
    for k in range(saves):
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": k}
        check = k % counts["check_every"] == 0 or k == saves - 1
        expected = {n: t.detach().clone() for n, t in model.state_dict().items()} if check else None
        if pending is not None:
            pending.result()
        path = os.path.join(root, f"ckpt{k}")
        response = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
        pending = getattr(response, "upload_completion", response)
        model(torch.randn(16, width, device=device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if check:
            pending.result()
            pending = None
            target = {"model": {n: torch.zeros_like(t) for n, t in expected.items()}}
            dcp.load(target, checkpoint_id=path)
            samples.checked()
            for n, t in expected.items():
                samples.check(f"save {k} {n}", target["model"][n], t)
            del target  # the soak's own copies are not held at the sample (Note [soak bounds])
        del expected
        kept.append(path)
        while len(kept) > 2:  # a fresh directory per save; the oldest go
            shutil.rmtree(kept.pop(0), ignore_errors=True)
        samples.sample()
    if pending is not None:
        pending.result()
    seconds = time.perf_counter() - start
    stager.close()
    return samples.summary("staging_dcp", saves, seconds,
                           checked="the checkpoint loaded back vs the model's state at the save")


# ------------------------------------------------------------ parameter offload


def soak_param_offload(device, counts, quick: bool) -> dict:
    model, optimizer = _train_state(device, quick)
    width = model[0].in_features
    model(torch.randn(16, width, device=device)).square().mean().backward()
    optimizer.step()
    pool = offload.HostPool()
    samples = Samples(device, pool, counts["warmup"])
    cycles = counts["param_cycles"]
    start = time.perf_counter()
    for k in range(cycles):
        check = k % counts["check_every"] == 0 or k == cycles - 1
        # The reference lives on the host: a device copy would be held at this cycle's sample.
        want = [t.detach().to("cpu", copy=True) for t in _param_state(model, optimizer)] if check else None
        offload.offload_params(model, grads=True, optimizer=optimizer, pool=pool)
        samples.sample()  # while offloaded: device memory down, pool holds the mirror
        offload.reload_params(model)
        if check:
            samples.checked()
            for i, (a, b) in enumerate(zip(_param_state(model, optimizer), want)):
                samples.check(f"cycle {k} tensor {i}", a.cpu(), b)
        del want  # the soak's own copies are not held at the next sample (Note [soak bounds])
        # A step between cycles: new values, the same shapes.
        model(torch.randn(16, width, device=device)).square().mean().backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    return samples.summary("param_offload", cycles, seconds,
                           checked="parameters, gradients, optimizer state after reload vs before offload")


def _param_state(model, optimizer):
    out = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


# ------------------------------------------------------------ weight sync (two accelerators)


def _sync_rank(rank, init_file, counts, quick, results):
    import torch.distributed as dist

    try:
        _device.set_device(torch.device(_device.accelerator_type(), rank))
        device = _device.current_device()
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        model = _llama(device, quick)
        model.requires_grad_(False)
        pool = offload.HostPool()
        # Each sync packs (sender) or receives (receiver) the model again into its buckets; the
        # sender keeps the last keep_versions (2) versions, a receiver at most as many buffers.
        buckets = sum(n > ALLOCATOR_SLACK_BYTES for n in offload.plan_buckets(model.state_dict()).bucket_sizes)
        samples = Samples(device, pool, counts["warmup"], remade_large=2 * buckets)
        syncs = counts["syncs"]
        sender = offload.WeightSender(timeout_s=120, pool=pool) if rank == 0 else None
        receiver = offload.WeightReceiver(timeout_s=120) if rank == 1 else None
        target = copy.deepcopy(model) if rank == 1 else None
        start = time.perf_counter()
        for k in range(syncs):
            gen = torch.Generator().manual_seed(k)
            with torch.no_grad():  # the same change on both ranks: the receiver knows what must arrive
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen).to(device, p.dtype))
            if rank == 0:
                sender.send(model)
            else:
                receiver.load(target)
                if k % counts["check_every"] == 0 or k == syncs - 1:
                    samples.checked()
                    for (n, a), b in zip(target.state_dict().items(), model.state_dict().values()):
                        samples.check(f"sync {k} {n}", a, b)
            samples.sample()
        _device.synchronize(device)
        seconds = time.perf_counter() - start
        dist.barrier()
        dist.destroy_process_group()
        results.put(samples.summary(f"weight_sync_rank{rank}", syncs, seconds,
                                    checked="the receiver's weights vs the sender's" if rank == 1 else "none here"))
    except BaseException as exc:  # noqa: BLE001 (reported to the parent)
        import traceback

        results.put({"section": f"weight_sync_rank{rank}", "error": traceback.format_exc(), "flat": False,
                     "exact": False})
        raise


def soak_weight_sync(counts, quick: bool, root: str) -> list:
    kind = _device.accelerator_type()
    count = 0 if kind is None else _device._module(kind).device_count()
    if kind != "cuda" or count < 2:
        return [{"section": "weight_sync", "skipped": f"needs 2 CUDA GPUs (NCCL), found {count} {kind or 'none'}"}]
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_sync_rank, args=(r, os.path.join(root, "sync_init"), counts, quick, results))
             for r in (0, 1)]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in procs:
            out.append(results.get(timeout=600))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return sorted(out, key=lambda r: r["section"])


# ------------------------------------------------------------ driver


def _mib(n) -> str:
    return f"{n / (1 << 20):.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for soak.json")
    parser.add_argument("--quick", action="store_true", help="a handful of repetitions (CPU smoke run)")
    parser.add_argument("--only", default="", help="comma-separated sections: activation,staging,sync,params")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    counts = QUICK if args.quick else FULL
    only = set(filter(None, args.only.split(",")))
    device = _device.current_device()
    if device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = []
    scratch = tempfile.mkdtemp(prefix="offload-soak-")
    try:
        if not only or "activation" in only:
            for mode in ("async", "auto"):
                rows.append(soak_activation(device, counts, args.quick, mode))
        if not only or "staging" in only:
            rows.append(soak_staging(device, counts, args.quick, scratch))
        if not only or "sync" in only:
            rows.extend(soak_weight_sync(counts, args.quick, scratch))
        if not only or "params" in only:
            rows.append(soak_param_offload(device, counts, args.quick))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {
        "device": _device.device_name(device), "torch": torch.__version__, "native": offload.native_available(),
        "quick": args.quick, "counts": counts, "bounds": {"allocator_slack_bytes": ALLOCATOR_SLACK_BYTES,
                                                         "pool_bytes": POOL_BOUND_BYTES,
                                                         "pool_fraction": POOL_BOUND_FRACTION,
                                                         "rss_bytes": RSS_BOUND_BYTES},
        "date": datetime.date.today().isoformat(), "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "sections": rows,
    }
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print("growth after warm-up / its bound, in MiB: device (allocated), host pool (reserved), process RSS")
    print(f"{'case':<18} {'reps':>5} {'s':>7}  {'checked bitwise':<26} {'device':<11} {'pool':<11} {'rss':<11} lost")
    ok = True
    for r in rows:
        if "skipped" in r:
            print(f"{r['section']:<18} skipped: {r['skipped']}")
            continue
        if "error" in r:
            print(f"{r['section']:<18} ERROR\n{r['error']}")
            ok = False
            continue
        m = r["memory"]
        checked = f"{r['checks']} tensors at {r['checked_repetitions']} of {r['repetitions']} reps"
        growth = " ".join(f"{_mib(m[k]['growth_bytes'])}/{_mib(m[k]['bound_bytes'])}".ljust(11)
                          for k in ("device_bytes", "pool_reserved_bytes", "rss_bytes"))
        print(f"{r['section']:<18} {r['repetitions']:>5} {r['seconds']:>7}  {checked:<26} {growth} {r['lost']}")
        ok = ok and r["exact"] and r["flat"]
    print(f"wrote {os.path.join(args.out, 'soak.json')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
