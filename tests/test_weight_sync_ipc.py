"""Colocated weight sync (`transport="ipc"`): two processes, buffers shared once, buckets signalled one by one.

On the CPU the buffers are host tensors in shared memory and the control messages
order the work (Note [IPC stand-in] in offload/weights/ipc.py): the protocol, the
two-slot pipeline, buffer reuse and the error paths run as on a device. The
`cuda` test runs the same syncs between two processes on one GPU.
"""

import multiprocessing
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
from _workers import assert_equal_weights, context, spawn_world

SRC = 0
TIMING_KEYS = {"gather_ms", "pack_ms", "host_copy_ms", "transfer_ms", "unpack_ms", "total_ms", "bytes", "buckets",
               "version"}


def _weights(seed: int, device, dtype=torch.float32):
    """Tensors of odd sizes, one larger than a bucket (split), and an int tensor copied as bytes."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (300, 33), "layers.0.w": (37, 41), "layers.0.norm": (41,), "layers.1.w": (64, 17),
              "layers.1.norm": (17,), "head.weight": (33, 300)}
    out = {n: torch.randn(s, generator=gen).to(device, dtype) for n, s in shapes.items()}
    out["positions"] = torch.arange(129, dtype=torch.int64).to(device)
    return out


def _change(weights, step: int) -> None:
    """A deterministic in-place change of every weight (a training step), the same on both sides."""
    gen = torch.Generator().manual_seed(100 + step)
    for t in weights.values():
        if t.is_floating_point():
            t.add_(torch.randn(t.shape, generator=gen).to(t.device, t.dtype))
        else:
            t.add_(step + 1)


# ---------------------------------------------------------------- scenarios (module level: spawn pickles them)


def _scenario_three_syncs(rank, device):
    """Three syncs with the weights changed in between (load in place), a cast sync, then views."""
    bucket = 8 << 10  # several buckets, the large tensors split across them
    if rank == SRC:
        weights = _weights(0, device)
        sender = offload.WeightSender(src=SRC, transport="ipc", bucket_bytes=bucket)
        buffers = None
        for step in range(3):
            _change(weights, step)
            t = sender.send(weights)
            assert set(t) == TIMING_KEYS and t["buckets"] > 4 and t["version"] == step and t["pack_ms"] > 0
            assert t["host_copy_ms"] == 0.0 and t["gather_ms"] == 0.0 and t["transfer_ms"] > 0
            ptrs = [b.data_ptr() for b in sender._ipc._buffers]  # a private read: no seam reports the shared buffers
            assert buffers is None or ptrs == buffers, "the shared buffers are reused across syncs"
            buffers = ptrs
        cast = offload.WeightSender(src=SRC, transport="ipc", bucket_bytes=bucket, dtype=torch.bfloat16,
                                    keep_dtype=["*.norm"])
        cast.send(weights)
        cast.send(weights)  # the plan is not sent again; the receiver knows it by id
        sender.send(weights)
        return
    receiver = offload.WeightReceiver(src=SRC, transport="ipc")
    mine = _weights(1, device)  # different values until the sync
    replica = _weights(0, device)
    for step in range(3):
        _change(replica, step)
        t = receiver.load(mine)
        assert set(t) == TIMING_KEYS and receiver.version == step and t["unpack_ms"] > 0 and t["transfer_ms"] > 0
        assert_equal_weights(mine, replica, f"sync {step}")
    cast_receiver = offload.WeightReceiver(src=SRC, transport="ipc")
    for _ in range(2):
        low = {n: (t.clone() if n.endswith(".norm") or not t.is_floating_point() else t.to(torch.bfloat16))
               for n, t in _weights(2, device).items()}
        cast_receiver.load(low)
        want = {n: (t if n.endswith(".norm") or not t.is_floating_point() else t.to(torch.bfloat16))
                for n, t in replica.items()}
        assert_equal_weights(low, want, "cast")
    got = dict(receiver.receive(copy=True))
    assert_equal_weights(got, replica, "receive")
    assert set(receiver.timings) == TIMING_KEYS


def _scenario_bad_destination(rank, device):
    """A receiver whose destination does not match raises naming it; the sender completes; the next sync works."""
    if rank == SRC:
        weights = _weights(0, device)
        sender = offload.WeightSender(src=SRC, transport="ipc", bucket_bytes=4 << 10)
        sender.send(weights)
        _change(weights, 0)
        sender.send(weights)
        return
    receiver = offload.WeightReceiver(src=SRC, transport="ipc")
    bad = _weights(1, device)
    bad["layers.0.w"] = torch.zeros(41, 37, device=device)
    with pytest.raises(ValueError, match="'layers.0.w' has shape"):
        receiver.load(bad)
    mine = _weights(1, device)
    receiver.load(mine)
    replica = _weights(0, device)
    _change(replica, 0)
    assert_equal_weights(mine, replica, "after a refused sync")


# ---------------------------------------------------------------- pipe channel: peers that die or fail


def _pipe_receiver(conn, mode, result):
    try:
        receiver = offload.WeightReceiver(transport="ipc", channel=conn, timeout_s=5 if mode == "sender_dies" else 20)
        mine = _weights(1, "cpu")
        if mode == "die":
            stream = receiver.receive()
            next(stream)  # takes the first bucket, then the process dies without a word
            os._exit(3)
        if mode == "sender_fails":
            for _ in range(3):
                try:
                    receiver.load(mine)
                except RuntimeError as exc:
                    result.put(str(exc))
                    return
            result.put("no error")
            return
        if mode == "sender_dies":
            start = time.monotonic()
            try:
                receiver.load(mine)
            except RuntimeError as exc:
                result.put(f"{time.monotonic() - start:.1f}|{exc}")
                return
            result.put("no error")
            return
        for step in range(3):
            receiver.load(mine)
            replica = _weights(0, "cpu")
            for s in range(step + 1):
                _change(replica, s)
            assert_equal_weights(mine, replica, f"sync {step}")
        result.put("ok")
    except BaseException:
        result.put(traceback.format_exc())


def _with_receiver(mode):
    ctx = context()
    here, there = ctx.Pipe()
    result = ctx.SimpleQueue()
    proc = ctx.Process(target=_pipe_receiver, args=(there, mode, result))
    proc.start()
    there.close()
    return here, proc, result


def _finish(proc, timeout=60):
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError("the receiver hung")


def test_weight_sync_ipc_cpu_standin_three_syncs_bitwise():
    spawn_world(_scenario_three_syncs, colocated=True)


def test_weight_sync_ipc_bad_destination_names_tensor_and_sender_completes():
    spawn_world(_scenario_bad_destination, colocated=True)


def test_weight_sync_ipc_pipe_channel_three_syncs():
    conn, proc, result = _with_receiver("ok")
    weights = _weights(0, "cpu")
    sender = offload.WeightSender(transport="ipc", channel=conn, bucket_bytes=8 << 10, timeout_s=20)
    for step in range(3):
        _change(weights, step)
        assert sender.send(weights)["buckets"] > 4
        # The buffers follow the tensors, not the host's accelerator (Note [IPC stand-in]); a private
        # read: no seam reports the shared buffers themselves.
        assert sender.device == torch.device("cpu") and sender._ipc._buffers[0].device == torch.device("cpu")
    _finish(proc)
    assert result.get() == "ok"


def test_weight_sync_ipc_receiver_dies_sender_raises():
    conn, proc, result = _with_receiver("die")
    sender = offload.WeightSender(transport="ipc", channel=conn, bucket_bytes=4 << 10, timeout_s=20)
    with pytest.raises(RuntimeError, match="closed the control channel|within 20 s"):
        sender.send(_weights(0, "cpu"))
    _finish(proc)
    assert proc.exitcode == 3
    with pytest.raises(RuntimeError, match="an earlier sync on this channel failed"):
        sender.send(_weights(0, "cpu"))


def test_weight_sync_ipc_unknown_plan_refused():
    conn, proc, result = _with_receiver("sender_fails")
    sender = offload.WeightSender(transport="ipc", channel=conn, bucket_bytes=4 << 10, timeout_s=20)
    weights = _weights(0, "cpu")
    sender.send(weights)  # a first sync the receiver takes (it returns after the error of the second)
    conn.send((1, 1, 12345, 0, None))  # a header naming a plan the receiver never saw
    _finish(proc)
    message = result.get()
    assert "plan 12345" in message and "never received" in message


def test_weight_sync_ipc_sender_dies_receiver_times_out():
    ctx = context()
    here, there = ctx.Pipe()
    result = ctx.SimpleQueue()
    proc = ctx.Process(target=_pipe_receiver, args=(there, "sender_dies", result))
    proc.start()
    there.close()
    # The sender never sends, yet keeps its end open (a hung or stopped trainer): the receiver's timeout ends it.
    _finish(proc, timeout=60)
    elapsed, message = result.get().split("|", 1)
    assert "no sync header from the peer within 5 s" in message
    assert 4.5 <= float(elapsed) < 30
    here.close()


def test_weight_sync_ipc_sender_abort_message_reaches_receiver():
    """A sender that fails after its header sends the error; the receiver raises it."""
    conn, proc, result = _with_receiver("sender_fails")
    sender = offload.WeightSender(transport="ipc", channel=conn, bucket_bytes=4 << 10, timeout_s=20)
    weights = _weights(0, "cpu")
    sender.send(weights)

    def failing_copy(*args, **kwargs):
        raise RuntimeError("pack failed on purpose")

    import offload.weights.ipc as ipc

    original = ipc.copy_spans
    ipc.copy_spans = failing_copy
    try:
        with pytest.raises(RuntimeError, match="pack failed on purpose"):
            sender.send(weights)
    finally:
        ipc.copy_spans = original
    _finish(proc)
    assert "the peer failed during the sync: RuntimeError: pack failed on purpose" in result.get()


def test_weight_sync_ipc_rejects_bad_arguments():
    here, there = multiprocessing.Pipe()
    with pytest.raises(ValueError, match="transport must be one of nccl, ipc, got 'shm'"):
        offload.WeightSender(transport="shm", channel=here)
    with pytest.raises(ValueError, match="channel is the control channel of transport 'ipc'"):
        offload.WeightReceiver(channel=here)
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds > 0, got 0"):
        offload.WeightSender(transport="ipc", channel=here, timeout_s=0)
    with pytest.raises(ValueError, match="mode 'device'"):
        offload.WeightSender(transport="ipc", channel=here, mode="host_cache")
    with pytest.raises(TypeError, match="one end of multiprocessing.Pipe"):
        offload.WeightReceiver(transport="ipc", channel=object())
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="needs a control channel"):
            offload.WeightReceiver(transport="ipc")
    sender = offload.WeightSender(transport="ipc", channel=here)
    with pytest.raises(ValueError, match="snapshots need transport 'nccl'"):
        sender.snapshot({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="'w' must be a contiguous"):
        sender.send({"w": torch.zeros(4, 4).t()})
    here.close()
    there.close()


@pytest.mark.cuda
def test_weight_sync_ipc_cuda_two_processes_one_gpu():
    spawn_world(_scenario_three_syncs, device_type="cuda", colocated=True)


@pytest.mark.cuda
def test_weight_sync_ipc_cuda_bad_destination():
    spawn_world(_scenario_bad_destination, device_type="cuda", colocated=True)


@pytest.mark.cuda
def test_weight_sync_ipc_cuda_mixed_devices_rejected():
    here, there = multiprocessing.Pipe()
    sender = offload.WeightSender(transport="ipc", channel=here)
    mixed = {"a": torch.zeros(4), "b": torch.zeros(4, device=offload.core._device.current_device())}
    with pytest.raises(ValueError, match="tensor 'b' is on cuda:0 but 'a' is on cpu; transport 'ipc' sends every"):
        sender.send(mixed)
    here.close()
    there.close()
