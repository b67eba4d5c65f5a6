"""What the multi-process tests' worker processes share (spawned ranks of a torch.distributed world)."""

import faulthandler
import os
import sys

import torch.multiprocessing as mp


def context():
    """The multiprocessing context the tests start their worker processes in.

    A fork server that has imported torch, where the platform has one: each worker is forked
    from it with torch already imported instead of importing it anew (seconds per process,
    every test). The server imports torch and nothing that touches an accelerator (importing
    torch does not initialise one), so the workers may each initialise theirs; like spawned
    ones, they share no state with the test process. Spawn elsewhere.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def watch_for_aborts() -> None:
    """A rank that aborts (SIGABRT, SIGSEGV) prints its Python stack in its own stderr."""
    faulthandler.enable()


def leave_passed_worker() -> None:
    """End a rank whose checks all passed and whose process group is shut down, skipping
    the interpreter's finalization.

    Tearing down a gloo world that ran FSDP2 collectives at finalization aborted once in
    CI ("terminate called without an active exception": a C++ thread of torch's destroyed
    while joinable) after every check had passed. The order in which torch frees its own
    objects at exit is not what these tests test; a rank that fails a check raises before
    this and still exits non-zero.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(target, args, world: int, timeout_s: float) -> None:
    """Run target(rank, *args, failures) in `world` worker processes (context()) and check them.

    A rank still running after `timeout_s` is killed (a hung rank must not outlive
    the test). Passes only if no rank put a failure (its traceback) in `failures`
    and every rank exited 0.
    """
    ctx = context()
    failures = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(rank, *args, failures)) for rank in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    codes = [p.exitcode for p in procs]
    assert not errors and codes == [0] * world, "\n".join(errors) or f"a rank hung or crashed (exit codes {codes})"
