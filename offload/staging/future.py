"""`StagingFuture`: the host state dict of one `AsyncStager.stage()` call.

No thread watches the copies: the future completes when someone asks
(`result()`, `done()`, `exception()` or `AsyncStager.synchronize_staging()`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Optional


class StagingFuture(Future):
    """The host state dict of one `stage()` call, complete once its copies are.

    No thread watches the copies: the future completes when someone asks —
    `result()` (which waits; the wait releases the interpreter lock), `done()`,
    `exception()` or `AsyncStager.synchronize_staging()`. DCP's upload thread calls
    `result()` at once, so `AsyncSaveResponse.staging_completion` fires on time.
    The dict itself is made by the first `result()` (on DCP's upload thread, so not
    inside `stage()`), from the leaves as they were at `stage()`. While this future
    (or the dict it returns) is alive, its buffer set is busy.
    """

    def __init__(self, build, scalars, host_leaves, handles, spent=None):
        super().__init__()
        self._spent = spent  # handles of earlier saves, let go by result() (SaveLog.spent)
        # What the staged dict is made of, until the first result() makes it
        # (StateTree.build): the non-tensor leaves as of stage() and a list of the
        # host tensors of its own, which keeps the buffer set busy meanwhile.
        self._parts = (build, scalars, host_leaves)
        self._staged = None
        self._pending = [h for h in handles if h is not None]
        self._finish_lock = threading.Lock()
        # Not _finish_lock: set_result runs done-callbacks (DCP's calls result())
        # in the thread that holds that one.
        self._build_lock = threading.Lock()
        self._finish(block=False)

    def _finish(self, block: bool, timeout: Optional[float] = None) -> None:
        if Future.done(self):
            return
        pending = self._pending
        if pending is None:
            return
        try:
            if block and timeout is not None:
                deadline = time.perf_counter() + timeout
                while not all(h.ready() for h in pending):
                    if time.perf_counter() >= deadline:
                        return
                    time.sleep(0.0005)
            elif block:
                for handle in pending:
                    handle.synchronize()
            elif not all(h.ready() for h in pending):
                return
        except BaseException as error:  # a failed copy fails the future, not the waiter's thread
            with self._finish_lock:
                if not Future.done(self):
                    self._pending = None
                    with self._build_lock:  # a dict made while the copies ran is never handed out
                        self._parts = self._staged = None
                    self.set_exception(error)
            return
        with self._finish_lock:
            if not Future.done(self):
                self._pending = None
                self.set_result(None)  # the copies are complete; result() returns the staged dict

    def _staged_dict(self):
        with self._build_lock:
            if self._parts is not None:
                build, scalars, host_leaves = self._parts
                self._staged = build(scalars, host_leaves)
                self._parts = None
            return self._staged

    def done(self) -> bool:
        self._finish(block=False)
        return super().done()

    def result(self, timeout: Optional[float] = None):
        if not Future.done(self):
            self._staged_dict()  # made while the copies run: it reads none of their bytes
        # Earlier saves' handles (their copies are complete) go while this one's copies
        # run, not after the wait, where freeing them would delay the return.
        if self._spent:
            self._spent.clear()
        self._finish(block=True, timeout=timeout)
        super().result(timeout=None if super().done() else 0)  # raises a failed copy's error, or TimeoutError
        return self._staged_dict()

    def exception(self, timeout: Optional[float] = None):
        self._finish(block=True, timeout=timeout)
        return super().exception(timeout=None if super().done() else 0)
