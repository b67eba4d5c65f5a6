"""Weight sync under faults: a sender that raises or dies mid-sync, a receiver that dies mid-sync,
a sync that times out (and the exit after it), and a host_cache snapshot that the pool cannot hold.

Each side that survives gets a RuntimeError within its `timeout_s` (not a hang), refuses further
syncs on the broken group, and then syncs bitwise with a new peer on a new group; a process whose
sync timed out destroys its process group and exits within `timeout_s` plus a few seconds. Every
process runs under a join timeout, so a hang fails the test instead of blocking the run.
"""

import datetime
import gc
import multiprocessing.connection
import os
import queue
import signal
import time

import pytest
import torch
import torch.distributed as dist

import offload
from _workers import collect_outcomes, context, gloo_world, reporting_rank  # noqa: F401 (fixture: gloo_world)

TIMEOUT_S = 4.0
# How much later than `timeout_s` the error may come on a loaded shared machine (spawned
# interpreters, other test processes): still far below the process group's own timeout.
SLACK_S = 40.0
_INIT_TIMEOUT = datetime.timedelta(seconds=120)
_JOIN_TIMEOUT_S = 180
BUCKET_BYTES = 4096


def _weights(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {
        "a": torch.randn(700, generator=gen),
        "b": torch.randn(40, 50, generator=gen).to(torch.bfloat16),
        "c": torch.randint(-1000, 1000, (900,), generator=gen, dtype=torch.int64),
        "d": torch.randn(2500, generator=gen),
    }


def _zeros_like(weights: dict) -> dict:
    return {n: torch.zeros_like(t) for n, t in weights.items()}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n


def _init(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=_INIT_TIMEOUT)
    torch.set_num_threads(1)


def _sync_on_new_group(rank: int, step: int) -> None:
    """A new sender/receiver pair on a new group syncs bitwise."""
    group = dist.new_group([0, 1])
    if rank == 0:
        offload.WeightSender(group, bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S).send(_weights(step))
    else:
        target = _zeros_like(_weights(step))
        offload.WeightReceiver(group, timeout_s=TIMEOUT_S).load(target)
        _assert_equal(target, _weights(step))


def _timed_failure(call) -> tuple:
    """(the RuntimeError `call` raised, seconds it took)."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        call()
    return info.value, time.monotonic() - t0


def _check_refuses_again(call) -> None:
    with pytest.raises(RuntimeError, match="cannot sync again"):
        call()


# ------------------------------------------------------------ sender raises (both processes live on)


def _raising_sender_world(rank, init_file, results):
    with reporting_rank(results, rank, destroy_group=False) as put:
        _init(rank, init_file)
        group = dist.new_group([0, 1])
        if rank == 0:
            sender = offload.WeightSender(group, bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S)
            sender.send(_weights(0))
            from offload.weights import sync_options  # the senders' packing (SenderBuckets)

            packed = []
            real = sync_options.copy_spans

            def fail_second_bucket(*args, **kw):
                packed.append(1)
                if len(packed) == 2:
                    raise RuntimeError("injected pack failure")
                return real(*args, **kw)

            sync_options.copy_spans = fail_second_bucket
            try:
                with pytest.raises(RuntimeError, match="injected pack failure"):
                    sender.send(_weights(1))
            finally:
                sync_options.copy_spans = real
            _check_refuses_again(lambda: sender.send(_weights(1)))
            elapsed = None
        else:
            receiver = offload.WeightReceiver(group, timeout_s=TIMEOUT_S)
            target = _zeros_like(_weights(0))
            receiver.load(target)
            _assert_equal(target, _weights(0))
            error, elapsed = _timed_failure(lambda: receiver.load(_zeros_like(_weights(1))))
            assert "offload.WeightReceiver" in str(error) and f"timeout_s={TIMEOUT_S:g}" in str(error), error
            assert "bucket" in str(error) and "new group" in str(error), error
            _check_refuses_again(lambda: receiver.load(_zeros_like(_weights(1))))
        _sync_on_new_group(rank, 2)
        put("ok", elapsed)
    os._exit(0)  # the results are out; the exit after a failed sync is test_faults_timed_out_sync_...'s


def test_faults_sender_raises_mid_sync_receiver_times_out(tmp_path):
    ctx = context()
    results = ctx.Queue()
    init_file = str(tmp_path / "init")
    procs = [ctx.Process(target=_raising_sender_world, args=(rank, init_file, results)) for rank in (0, 1)]
    outcome = _collect(procs, results, expect=2)
    assert all(kind == "ok" for kind, _, _ in outcome.values()), outcome
    elapsed = outcome[1][2]
    assert elapsed < TIMEOUT_S + SLACK_S, f"the receiver's error came after {elapsed:.1f} s"
    assert [p.exitcode for p in procs] == [0, 0]


# ------------------------------------------------------------ one side dies (SIGKILL) mid-sync


def _dying_world(rank, victim, first_file, second_file, results):
    """World one: rank `victim` kills itself mid-sync. The survivor must fail within the
    timeout, then (world two, with a fresh peer) sync bitwise."""
    survivor = rank != victim

    with reporting_rank(results, rank, destroy_group=False) as put:
        _init(rank, first_file)
        group = dist.new_group([0, 1])
        if rank == 0:
            sender = offload.WeightSender(group, bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S)
            sender.send(_weights(0))
            if not survivor:
                from offload.weights import sync_options  # the senders' packing (SenderBuckets)

                real = sync_options.copy_spans
                count = []

                def die_at_second_bucket(*args, **kw):
                    count.append(1)
                    if len(count) == 2:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args, **kw)

                sync_options.copy_spans = die_at_second_bucket
                sender.send(_weights(1))
                raise AssertionError("the sender outlived its own SIGKILL")
            error, elapsed = _timed_failure(lambda: sender.send(_weights(1)))
            assert "offload.WeightSender" in str(error) and "new group" in str(error), error
            _check_refuses_again(lambda: sender.send(_weights(1)))
        else:
            receiver = offload.WeightReceiver(group, timeout_s=TIMEOUT_S)
            target = _zeros_like(_weights(0))
            receiver.load(target)
            _assert_equal(target, _weights(0))
            if not survivor:
                for k, _ in enumerate(receiver.receive()):
                    if k == 1:  # one bucket in, the next ones posted
                        os.kill(os.getpid(), signal.SIGKILL)
                raise AssertionError("the receiver outlived its own SIGKILL")
            error, elapsed = _timed_failure(lambda: receiver.load(_zeros_like(_weights(1))))
            assert "offload.WeightReceiver" in str(error) and "new group" in str(error), error
            _check_refuses_again(lambda: receiver.load(_zeros_like(_weights(1))))
        # The peer is gone: this world is over. A new world with a fresh peer.
        dist.destroy_process_group()
        _init(rank, second_file)
        _sync_on_new_group(rank, 2)
        put("ok", elapsed)
    os._exit(0)


def _fresh_peer(rank, second_file, results):
    with reporting_rank(results, f"fresh {rank}", destroy_group=False) as put:
        _init(rank, second_file)
        _sync_on_new_group(rank, 2)
        put("ok", None)
    os._exit(0)


def _collect(procs, results, expect: int) -> dict:
    """Start `procs`, wait (bounded) for `expect` results, kill what is left; {rank: result}."""
    out = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        while len(out) < expect and time.monotonic() < deadline:
            try:
                kind, rank, value = results.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            out[rank] = (kind, rank, value)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert len(out) == expect, f"a process hung or crashed: results {out}, exit codes {[p.exitcode for p in procs]}"
    return out


@pytest.mark.parametrize("victim", [0, 1], ids=["sender_dies", "receiver_dies"])
def test_faults_peer_killed_mid_sync_survivor_errors_then_syncs_anew(tmp_path, victim):
    ctx = context()
    results = ctx.Queue()
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    procs = [ctx.Process(target=_dying_world, args=(rank, victim, first, second, results)) for rank in (0, 1)]
    procs.append(ctx.Process(target=_fresh_peer, args=(victim, second, results)))
    survivor = 1 - victim
    outcome = _collect(procs, results, expect=2)  # the survivor's and the fresh peer's
    assert set(outcome) == {survivor, f"fresh {victim}"}, outcome
    assert all(kind == "ok" for kind, _, _ in outcome.values()), outcome
    elapsed = outcome[survivor][2]
    assert elapsed < TIMEOUT_S + SLACK_S, f"the survivor's error came after {elapsed:.1f} s"
    assert procs[victim].exitcode == -signal.SIGKILL
    assert procs[survivor].exitcode == 0 and procs[2].exitcode == 0


# ------------------------------------------------------------ a timed-out sync, then exit

EXIT_TIMEOUT_S = 2.0
# How long after `timeout_s` a rank may take to raise, destroy its process group and exit (the
# interpreter's own teardown included). The group's own timeout (_INIT_TIMEOUT) is far beyond it:
# a collective left posted on the group would hold the exit until then.
EXIT_SLACK_S = 8.0


def _timed_out_world(rank, scenario, init_file, release, results):
    """One sync that times out, then `destroy_process_group()` and the process's exit.
    "wrong_src": the receiver names itself as the sender, so both sides broadcast as the root and
    both time out. "never_sent": the sender constructs but never sends, and stays alive (until
    `release`) while the receiver times out."""
    with reporting_rank(results, rank) as put:  # then the group destroyed, and the process's exit
        _init(rank, init_file)
        start = time.monotonic()  # system-wide on Linux: the parent measures the exit against it
        error = None
        if rank == 0:
            held = offload.WeightSender(bucket_bytes=BUCKET_BYTES, timeout_s=EXIT_TIMEOUT_S)
            if scenario == "wrong_src":
                error, _ = _timed_failure(lambda: held.send(_weights(0)))
            else:
                release.wait(_JOIN_TIMEOUT_S)  # alive and silent until the receiver is gone
        else:
            held = offload.WeightReceiver(src=1 if scenario == "wrong_src" else 0, timeout_s=EXIT_TIMEOUT_S)
            error, _ = _timed_failure(lambda: held.load(_zeros_like(_weights(0))))
        put("sync_over", (start, None if error is None else str(error)))
        del held, error  # the group's last references, for the collect after its destroy


@pytest.mark.parametrize("scenario", ["wrong_src", "never_sent"])
def test_faults_timed_out_sync_processes_destroy_group_and_exit(tmp_path, scenario):
    """After a sync that timed out, both processes destroy the process group and exit within
    `timeout_s` plus a few seconds of the sync's start (not at the group's own timeout)."""
    ctx = context()
    results, release = ctx.Queue(), ctx.Event()
    init_file = str(tmp_path / "init")
    procs = [ctx.Process(target=_timed_out_world, args=(rank, scenario, init_file, release, results))
             for rank in (0, 1)]
    outcome, exited = {}, {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + _JOIN_TIMEOUT_S  # spawning and the rendezvous, on a loaded machine
        while len(exited) < 2 and time.monotonic() < deadline:
            try:
                kind, rank, value = results.get(timeout=0.2)
                outcome[rank] = (kind, value)
                if kind == "sync_over":  # from here on the bound is the sync's own
                    deadline = min(deadline, value[0] + EXIT_TIMEOUT_S + EXIT_SLACK_S)
            except queue.Empty:
                pass
            sentinels = [p.sentinel for k, p in enumerate(procs) if k not in exited]
            for ready in multiprocessing.connection.wait(sentinels, timeout=0):
                exited[next(k for k, p in enumerate(procs) if p.sentinel == ready)] = time.monotonic()
            if 1 in exited:
                release.set()  # the never-sending sender may go now
    finally:
        release.set()
        for p in procs:
            p.join(timeout=1.0)
            if p.is_alive():
                p.kill()
                p.join()
    collect_outcomes(results, outcome)
    raised = [0, 1] if scenario == "wrong_src" else [1]
    for rank in raised:
        assert outcome.get(rank, ("",))[0] == "sync_over", f"rank {rank} did not raise: {outcome}"
        took = exited.get(rank, float("inf")) - outcome[rank][1][0]
        assert took < EXIT_TIMEOUT_S + EXIT_SLACK_S, (
            f"rank {rank} exited {took:.1f} s after its sync began (timeout_s={EXIT_TIMEOUT_S:g}); exit codes "
            f"{[p.exitcode for p in procs]}")
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in raised:
        message = outcome[rank][1][1]
        side = "offload.WeightSender" if rank == 0 else "offload.WeightReceiver"
        assert side in message and f"timeout_s={EXIT_TIMEOUT_S:g}" in message, message
        assert "aborted" in message and "destroy_process_group" in message and "new group" in message, message


# ------------------------------------------------------------ in one process


def test_faults_weight_sync_timeout_s_bad_values(gloo_world):
    for bad in (0, -1.0, "5", True, float("nan")):
        with pytest.raises(ValueError, match=r"offload.WeightSender: timeout_s must be"):
            offload.WeightSender(timeout_s=bad)
        with pytest.raises(ValueError, match=r"offload.WeightReceiver: timeout_s must be"):
            offload.WeightReceiver(timeout_s=bad)


@pytest.mark.parametrize("backend_name", ["native", "fallback"])
def test_faults_snapshot_pool_full_raises_and_keeps_weights(gloo_world, backend_name, device):
    """A host_cache snapshot the pool cannot hold: torch.OutOfMemoryError naming the bytes asked
    and held, the weights untouched, the cached snapshot kept, the pool back where it was.

    The weights live on the compute device: with an accelerator present, snapshots copy from it."""
    from offload.core import _backend

    if backend_name == "native" and not _backend.native_available():
        pytest.skip(f"needs the compiled core: {_backend.why_not()}")
    ctx = _backend.force_fallback() if backend_name == "fallback" else _nullcontext()
    with ctx:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(device)
        weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        # Small slabs (native slabs round to 2 MiB) keep the limits below meaningful with pinned memory too.
        pool = offload.HostPool(limit_bytes=6 << 20, slab_bytes=1 << 20)
        sender = offload.WeightSender(mode="host_cache", pool=pool, keep_versions=2)
        v0 = sender.snapshot(model)
        sender.snapshot_ms(v0)
        held = pool.stats()["in_use_bytes"]
        pool.limit_bytes = held + nbytes // 2  # the next snapshot cannot fit
        with pytest.raises(torch.OutOfMemoryError) as info:
            sender.snapshot(model)
        message = str(info.value)
        del info  # its traceback's frames hold what the failed copy had acquired
        gc.collect()
        assert message.startswith("offload.WeightSender.snapshot: cannot copy version 1"), message
        assert f"({nbytes} bytes of weights)" in message and "in use" in message and "keep_versions" in message
        for n, t in model.state_dict().items():
            assert torch.equal(t, weights[n]), n
        assert sender.versions == [v0]
        assert pool.stats()["in_use_bytes"] == held
        # A private read: a snapshot's host tensors are reached only by sending them.
        for t, want in zip(sender._get_snapshot("test", v0).tensors(), weights.values()):
            assert t.device.type == "cpu" and torch.equal(t, want.cpu())
        pool.limit_bytes = 0  # room again: the next snapshot works
        v2 = sender.snapshot(model)
        assert sender.versions == [v0, v2]


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()
