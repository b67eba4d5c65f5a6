"""Many-sender weight sync (`WeightSender(senders=...)`) under faults: one of two senders raises
mid-sync, or refuses its tensors before its header while the other sender's is out; a sender process
dies mid-sync; a receiver process dies mid-sync; gloo on the CPU.

Ranks 0 and 1 send (a tensor sharded on both as a DTensor `Shard(0)`, and whole tensors spread
over them), ranks 2 and 3 receive: rank 2 with `load()` into its previous weights, rank 3 with
`receive()`. After a first sync that completes, the second one fails. Every process still alive
must raise a RuntimeError (or complete) within `timeout_s` plus a few seconds, then destroy its
process group and exit, measured in the parent from the start of the failed sync. What the
receivers hold afterwards is checked bitwise (docs/weight_sync.md, "When a sync fails"):
- `receive()` yields only tensors whose pieces all arrived, each bitwise the new value;
- a `load()` target holds, element by element, the previous value or the new one and nothing
  else, and the tensors of buckets that never arrived keep their previous value (all of them
  when a sender refused before its header).
"""

import datetime
import multiprocessing.connection
import os
import queue
import time

import pytest
import torch
import torch.distributed as dist

import offload
from _workers import collect_outcomes, context, reporting_rank

TIMEOUT_S = 2.0
# How long after the failed sync's start a process may take to raise, destroy its group and exit:
# the waits of one sync end within `timeout_s` each, and a receiver's failure on one sender's group
# ends the other sender's sync at its next bounded wait; the rest is a loaded machine's slack. The
# group's own timeout (_INIT_TIMEOUT) is far beyond it.
EXIT_BOUND_S = 2 * TIMEOUT_S + 8.0
_INIT_TIMEOUT = datetime.timedelta(seconds=120)
_JOIN_TIMEOUT_S = 120
BUCKET_BYTES = 4096
SENDERS = [0, 1]
WORLD = 4


def _weights(step: int) -> dict:
    """Full tensors of version `step`; every element differs from the previous version's."""
    gen = torch.Generator().manual_seed(0)
    base = {
        "shared": torch.randn(64, 40, generator=gen),  # sharded over both senders, several buckets each
        "a": torch.randn(1500, generator=gen),  # larger than a bucket: split over buckets
        "b": torch.randn(30, 50, generator=gen).to(torch.bfloat16),
        "c": torch.randn(900, generator=gen),
        "d": torch.randn(2500, generator=gen),
        "e": torch.randn(700, generator=gen),
    }
    return {n: t + step for n, t in base.items()}


def _source(step: int, mesh) -> dict:
    """What a sender passes: `shared` as this rank's rows of a Shard(0) DTensor, the rest whole."""
    from torch.distributed.tensor import DTensor, Shard

    full = _weights(step)
    rows = full["shared"].shape[0] // len(SENDERS)
    local = full["shared"][dist.get_rank() * rows:(dist.get_rank() + 1) * rows].clone()
    full["shared"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return full


def _not_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a strided view that is not contiguous, which a sender refuses."""
    if t.dim() == 1:
        return torch.stack([t, t], 1)[:, 0]
    return t.t().contiguous().t()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _check_old_or_new(target: dict, old: dict, new: dict) -> tuple:
    """Every element of the target is bitwise its old or its new value; (new elements, old elements)."""
    fresh = stale = 0
    for n, t in target.items():
        is_old, is_new = _bits(t) == _bits(old[n]), _bits(t) == _bits(new[n])
        assert bool((is_old | is_new).all()), f"tensor {n!r} holds values that are neither old nor new"
        fresh += int(is_new.sum())
        stale += int(is_old.sum())
    return fresh, stale


def _fail_at_second_bucket(how: str):
    """Patch the sender's packing (sync_options.SenderBuckets, every sender's) so that its second bucket of the
    next sync raises or kills the process."""
    from offload.weights import sync_options

    real, count = sync_options.copy_spans, []

    def failing(*args, **kw):
        count.append(1)
        if len(count) == 2:
            if how == "raise":
                raise RuntimeError("injected pack failure")
            os._exit(17)  # dies as a lost node would: no cleanup, no message
        return real(*args, **kw)

    sync_options.copy_spans = failing


def _rank_main(rank, scenario, init_file, release, results):
    """One rank: a sync that completes, then one that fails per `scenario`; ("sync_over", rank,
    (start, what happened)) before the group is destroyed and the process exits. A sender that
    raised holds its groups (alive, connections open) until `release`: the others must not learn
    of its failure from a closed connection, only from their bounded waits."""
    with reporting_rank(results, rank) as put:  # then the groups destroyed, and the process's exit
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                                timeout=_INIT_TIMEOUT)
        torch.set_num_threads(1)
        mesh_group = dist.new_group(SENDERS)  # collective over the world: every rank builds it
        if rank in SENDERS:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(mesh_group, "cpu")
            held = offload.WeightSender(senders=SENDERS, bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S)
            held.send(_source(0, mesh))
            if (scenario, rank) == ("sender_raises", 1):
                _fail_at_second_bucket("raise")
            elif (scenario, rank) == ("sender_dies", 1):
                _fail_at_second_bucket("die")
            source = _source(1, mesh)
            if (scenario, rank) == ("sender_refuses", 1):  # checked after the other sender's header is out
                source = {n: t if n == "shared" else _not_contiguous(t) for n, t in source.items()}
            start = time.monotonic()  # system-wide on Linux: the parent measures the exit against it
            try:
                held.send(source)
                outcome = ("completed", None)
            except ValueError as exc:  # its own tensors refused, before its header: nothing posted
                assert (scenario, rank) == ("sender_refuses", 1), exc
                outcome = ("raised", str(exc))
            except RuntimeError as exc:
                outcome = ("raised", str(exc))
                with pytest.raises(RuntimeError, match="cannot sync again"):
                    held.send(source)
            if scenario in ("sender_raises", "sender_refuses") and rank == 1:
                put("sync_over", (start, outcome))
                release.wait(_JOIN_TIMEOUT_S)
                outcome = None
        else:
            held = offload.WeightReceiver(senders=SENDERS, timeout_s=TIMEOUT_S)
            old, new = _weights(0), _weights(1)
            target = {n: torch.zeros_like(t) for n, t in old.items()}
            held.load(target)
            assert all(torch.equal(target[n], old[n]) for n in old)
            got = {}
            start = time.monotonic()
            try:
                if rank == 2:
                    held.load(target)
                else:
                    for name, t in held.receive():
                        got[name] = t
                        if scenario == "receiver_dies" and len(got) == 2:  # a few buckets in, more posted
                            os._exit(17)
                outcome = ("completed", None)
            except RuntimeError as exc:
                outcome = ("raised", str(exc))
                with pytest.raises(RuntimeError, match="cannot sync again"):
                    held.load(target)
            if rank == 2:
                fresh, stale = _check_old_or_new(target, old, new)
                outcome += (fresh, stale)
            else:  # only whole tensors, each bitwise the new value: nothing partial
                for name, t in got.items():
                    assert torch.equal(t, new[name]), f"receive() yielded {name!r} before all its pieces arrived"
                if outcome[0] == "completed":
                    assert got.keys() == new.keys()
                outcome += (sorted(got),)
        if outcome is not None:
            put("sync_over", (start, outcome))
        del held, mesh_group  # the groups' last references, for the collect after their destroy


def _run(scenario: str, init_file: str) -> tuple:
    """Run the four ranks; ({rank: (kind, value)}, {rank: seconds from its failed sync's start to its exit},
    exit codes)."""
    ctx = context()
    results, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rank_main, args=(rank, scenario, init_file, release, results))
             for rank in range(WORLD)]
    outcome, exited = {}, {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + _JOIN_TIMEOUT_S  # spawning and the rendezvous, on a loaded machine
        while len(exited) < WORLD and time.monotonic() < deadline:
            try:
                kind, rank, value = results.get(timeout=0.1)
                outcome[rank] = (kind, value)
                if kind == "sync_over":  # from here on the bound is the failed sync's
                    deadline = min(deadline, value[0] + EXIT_BOUND_S + 2.0)
            except queue.Empty:
                pass
            sentinels = [p.sentinel for k, p in enumerate(procs) if k not in exited]
            for ready in multiprocessing.connection.wait(sentinels, timeout=0):
                exited[next(k for k, p in enumerate(procs) if p.sentinel == ready)] = time.monotonic()
            if all(outcome.get(r, ("",))[0] == "sync_over" for r in (2, 3)):
                release.set()  # the receivers are done: the raising sender may go
    finally:
        release.set()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    collect_outcomes(results, outcome)
    took = {r: exited.get(r, float("inf")) - v[0] for r, (_, v) in outcome.items()}
    return outcome, took, [p.exitcode for p in procs]


@pytest.mark.parametrize("scenario", ["sender_raises", "sender_refuses", "sender_dies", "receiver_dies"])
def test_faults_many_senders_failure_mid_sync_errors_exits_and_keeps_whole_tensors(tmp_path, scenario):
    outcome, took, codes = _run(scenario, str(tmp_path / "init"))
    victim = 3 if scenario == "receiver_dies" else 1
    dead = scenario in ("sender_dies", "receiver_dies")
    survivors = [r for r in range(WORLD) if not (dead and r == victim)]
    assert sorted(outcome) == survivors, f"a process hung or crashed: {outcome}, exit codes {codes}"
    for r in survivors:
        assert took[r] < EXIT_BOUND_S, (f"rank {r} exited {took[r]:.1f} s after its failed sync began "
                                        f"(timeout_s={TIMEOUT_S:g}); exit codes {codes}")
        assert codes[r] == 0, codes
    if dead:
        assert codes[victim] == 17, codes
    print(scenario, {r: round(took[r], 2) for r in survivors}, {r: outcome[r][1][1][0] for r in survivors})

    what = {r: outcome[r][1][1] for r in survivors}
    if scenario == "sender_raises":
        assert what[1][0] == "raised" and "injected pack failure" in what[1][1], what[1]
    if scenario == "sender_refuses":
        assert what[1][0] == "raised" and "must be a contiguous strided tensor" in what[1][1], what[1]
    if victim == 1:  # a sender failed: no receiver can complete; each names the step, a sender and the timeout
        for r in (2, 3):
            kind, message = what[r][:2]
            assert kind == "raised", (r, what[r])
            assert "offload.WeightReceiver" in message and f"timeout_s={TIMEOUT_S:g}" in message, message
            step = "the header" if scenario == "sender_refuses" else "bucket"
            assert step in message and "new group" in message, message
    for r in SENDERS:  # a sender that did not fail itself: completes (its buckets went out) or names the failure
        if r in what and what[r][0] == "raised" and not (r == 1 and scenario.startswith("sender_")):
            assert "offload.WeightSender" in what[r][1] and "new group" in what[r][1], what[r]
    if 2 in what:
        kind, _, fresh, stale = what[2]
        if kind == "completed":
            assert stale == 0, what[2]
        elif scenario == "sender_refuses":  # no bucket is taken before every header is in
            assert fresh == 0, what[2]
        elif victim == 1:  # the buckets round-robin before the failed one were unpacked, the later ones never came
            assert fresh > 0 and stale > 0, what[2]
    if victim == 1:
        assert what[3][2] != sorted(_weights(0)), "receive() yielded every tensor of a failed sync"
    if scenario == "sender_refuses":
        assert what[3][2] == [], what[3]
