"""benchmarks/trace_gaps.py on a small made-up trace: the compute stream's gaps, what ended
each and who launched it."""

import json

import pytest

from benchmarks import trace_gaps


def _op(cat, name, ts, dur, stream, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, **args}}


def _host(name, ts, dur, cat="cpu_op", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _trace():
    """A step whose compute stream (7) waits 70 ms for a small copy FSDP2 queued behind the
    engine's copy back on stream 26; stream 19 runs NCCL; stream 22 only copies."""
    return [
        _op("kernel", "gemm", 0, 1000, 7, correlation=1),
        _op("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 71000, 5, 7, correlation=2, bytes=32360),
        _op("kernel", "gemm", 71010, 1000, 7, correlation=3),
        _op("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1000, 70000, 26, correlation=4),
        _op("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 90000, 22, correlation=5),
        _op("kernel", "ncclDevKernel_AllGather_RING", 0, 500, 19, correlation=6),
        _host("cudaLaunchKernel", -3000, 5, cat="cuda_runtime", correlation=1),
        _host("cudaMemcpyAsync", 500, 10, cat="cuda_runtime", correlation=2),
        _host("cudaLaunchKernel", 600, 5, cat="cuda_runtime", correlation=3),
        _host("FSDP::all_gather_copy_out (layers.14)", 400, 200, cat="user_annotation"),
        _host("fsdp::split_with_sizes_copy", 450, 100),
        _host("aten::copy_", 495, 20),
        _host("aten::copy_", 495, 20, tid=2),  # another thread: not the launch's caller
    ]


def test_trace_gaps_finds_the_gap_and_what_it_waited_for():
    events = _trace()
    streams = trace_gaps.device_ops(events)
    assert trace_gaps.compute_stream(streams) == 7  # not the busier copy streams, not NCCL's
    (gap,) = trace_gaps.gaps(events, streams, 7, min_ms=2.0)
    assert gap.start_ms == pytest.approx(1.0) and gap.ms == pytest.approx(70.0)
    assert gap.after_bytes == 32360
    assert gap.ended_with == ["memcpy HtoD on stream 26"]
    assert gap.launched_by == ["aten::copy_", "fsdp::split_with_sizes_copy", "FSDP::all_gather_copy_out (layers.14)"]
    assert trace_gaps.gaps(events, streams, 7, min_ms=80.0) == []
    assert trace_gaps.idle_ms(streams[7]) == pytest.approx(70.005)
    assert trace_gaps.host_lead(events, streams[7]) == pytest.approx([3.0, 70.5, 70.41])


def test_trace_gaps_report_from_a_file(tmp_path, capsys):
    path = tmp_path / "step.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    assert trace_gaps.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "compute stream 7: idle 70.0 ms; 1 gaps over 2 ms" in out
    assert "ended with memcpy HtoD on stream 26" in out
    assert "launched in aten::copy_ < fsdp::split_with_sizes_copy" in out


def test_trace_gaps_without_device_ops_or_compute_stream(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [_host("aten::mm", 0, 10)]}))
    assert trace_gaps.summary(empty) == [f"{empty}: no device ops in the trace"]
    copies = tmp_path / "copies.json"
    copies.write_text(json.dumps([_op("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 10, 22)]))
    assert trace_gaps.summary(copies)[-1] == "  no stream runs kernels without NCCL: no compute stream to read"


def test_trace_gaps_refuses_a_negative_threshold(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        trace_gaps.main([str(tmp_path / "x.json"), "--min-ms", "-1"])
    assert exc.value.code == 2
    assert "--min-ms must be >= 0, got -1.0" in capsys.readouterr().err
