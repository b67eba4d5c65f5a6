"""What the torch.distributed tests share: spawned ranks of a world (their worker processes,
the rendezvous, the report every fault-test rank makes, FSDP2 sharding, a comparison of weights),
and a one-rank gloo world in this process."""

import contextlib
import datetime
import faulthandler
import gc
import os
import shutil
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload

_INIT_TIMEOUT = datetime.timedelta(seconds=120)
_JOIN_TIMEOUT_S = 240


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


@contextlib.contextmanager
def reporting_rank(results, rank, destroy_group: bool = True):
    """Around the body of a fault-test rank: what it reports reaches the parent, whatever happens.

    Yields put(kind, value), which puts (kind, rank, value) into `results` (a multiprocessing
    Queue the parent reads). The rank prints its stack if it aborts (watch_for_aborts). An
    exception is put as ("error", rank, its traceback) and raised again, so the process exits
    non-zero. A body that ends normally then, with `destroy_group`, destroys the process group and
    collects what referred to it, as the interpreter's teardown would: multiprocessing ends a
    worker with os._exit, which skips that teardown, and a group's backend and its threads go only
    with the last references to it (a caught error's traceback holds the sender or receiver in a
    cycle). The body drops its own references first (`del`): its frame outlives the context.
    Either way `results` is flushed before the context ends, so the worker may os._exit after it.
    """
    watch_for_aborts()

    def put(kind, value):
        results.put((kind, rank, value))

    try:
        yield put
        if destroy_group:
            dist.destroy_process_group()
            gc.collect()
    except BaseException:
        put("error", traceback.format_exc())
        raise
    finally:
        results.close()
        results.join_thread()  # what was put reaches the parent before the process ends
        sys.stdout.flush()


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


def _run_scenario(rank, world, init_method, scenario, device_type, colocated, failures):
    watch_for_aborts()
    try:
        # Colocated ranks share one device and talk over a gloo group; otherwise each rank
        # takes the accelerator of its number and, on CUDA, an NCCL group.
        if device_type == "cuda" and not colocated:
            offload.core._device._module("cuda").set_device(rank)
        backend = "nccl" if device_type == "cuda" and not colocated else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=_INIT_TIMEOUT)
        torch.set_num_threads(1)
        device = offload.core._device.current_device() if device_type == "cuda" else torch.device("cpu")
        scenario(rank, device)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        failures.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    leave_passed_worker()


# Rendezvous through a file in a fresh directory, not a TCP port: a port picked
# free in the parent (bind to 0, close) stays free only until some other process
# on the machine takes it, and spawning two interpreters that import torch and
# transformers takes seconds on a loaded machine. Then rank 0's store fails with
# EADDRINUSE (or rank 1 joins another test's store) and the other rank waits until
# the join timeout: a failure seen only when many tests run at once. Gloo's own
# connections bind ports chosen by the OS and exchange them through the store.
def spawn_world(scenario, device_type: str = "cpu", world: int = 2, colocated: bool = False) -> None:
    """Run scenario(rank, device) on every rank of a `world`-process torch.distributed world
    (rendezvous through a file) and check them as run_ranks does. `scenario` is a module-level
    function (spawn pickles it). `colocated`: every rank on the one device, over gloo."""
    rendezvous = tempfile.mkdtemp(prefix="offload-world-")
    init_method = "file://" + os.path.join(rendezvous, "store")
    try:
        run_ranks(_run_scenario, (world, init_method, scenario, device_type, colocated), world, _JOIN_TIMEOUT_S)
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)


def fully_shard_layers(model, layers, device):
    """`model` sharded with FSDP2 over the whole world: each of `layers` that holds parameters, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in layers:
        if any(True for _ in layer.parameters()):  # fully_shard wants parameters to shard
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def assert_equal_weights(got: dict, want: dict, what: str) -> None:
    """Same names, and per name the same dtype and values (compared on the host)."""
    assert got.keys() == want.keys(), what
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n].cpu(), want[n].cpu()), f"{what}: {n}"


def collect_outcomes(results, outcome: dict) -> dict:
    """Add to `outcome` the first (kind, value) each rank put on `results` (a queue of (kind, rank,
    value)), and fail with every rank's "error" report."""
    while not results.empty():
        kind, rank, value = results.get()
        outcome.setdefault(rank, (kind, value))
    errors = [value for kind, value in outcome.values() if kind == "error"]
    assert not errors, "\n".join(errors)
    return outcome


@pytest.fixture
def gloo_world():
    """A one-rank gloo world in this process, for the calls that need a process group."""
    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
