"""What the multi-process tests' worker processes share (spawned ranks of a torch.distributed world)."""

import faulthandler
import os
import sys


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
