"""benchmarks/model_weight_update.py: the weight-update model's arithmetic on hand-computed cases,
its calibration against the measured two-GPU syncs, and the script's table (CPU, instant)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "model_weight_update.py"


@pytest.fixture(scope="module")
def mwu():
    spec = importlib.util.spec_from_file_location("model_weight_update", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_weight_update"] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("model_weight_update", None)


def _rates(mwu):
    # NVLink 100 GB/s, NIC 80 Gb/s = 10 GB/s, 8 GPUs a host, pack 1 TB/s, unpack 2 TB/s, 0.1 ms a bucket.
    return mwu.Rates(100e9, 80.0, 8, 1e12, 2e12, 1e-4)


def test_model_weight_update_hand_computed_across_hosts(mwu):
    # 64 GB from 16 senders to 16 receivers: 4 GB a sender, 1 GB buckets.
    e = mwu.estimate(mwu.Update(64e9, 16, 16, int(1e9)), _rates(mwu))
    # links: receiver NVLink 64/100 = 0.64 s, sender NIC 4/10 = 0.4 s, receiver host 64/(8 x 10) = 0.8 s
    assert e.bound == "receiver host NICs"
    assert e.transfer_s == pytest.approx(0.8)
    assert e.fill_s == pytest.approx(1e9 / 1e12 + 1e9 / 2e12)  # 1.5 ms
    assert e.buckets == 16 * 4
    assert e.latency_s == pytest.approx(64 * 1e-4)
    assert e.seconds == pytest.approx(0.8 + 1.5e-3 + 6.4e-3)


def test_model_weight_update_receiver_budget_caps_the_bucket(mwu):
    # 8 GB for 2 x 16 buckets: 250 MB buckets, 16 a sender.
    e = mwu.estimate(mwu.Update(64e9, 16, 16, int(1e9), receiver_budget_bytes=8e9), _rates(mwu))
    assert e.bucket_bytes == 250_000_000
    assert e.buckets == 16 * 16
    assert e.seconds == pytest.approx(0.8 + 250e6 / 1e12 + 250e6 / 2e12 + 256 * 1e-4)


def test_model_weight_update_hand_computed_on_one_host(mwu):
    # 2 + 2 GPUs on one host: NVLink only; the receiver takes 8 GB, each sender sends 4 GB.
    e = mwu.estimate(mwu.Update(8e9, 2, 2, int(1e9)), _rates(mwu))
    assert e.bound == "receiver NVLink"
    assert e.seconds == pytest.approx(0.08 + 1.5e-3 + 8 * 1e-4)


def test_model_weight_update_share_smaller_than_a_bucket(mwu):
    # 1 GB over 4 senders in 1 GB buckets: the pipeline fills with a 250 MB bucket, one a sender.
    e = mwu.estimate(mwu.Update(1e9, 4, 4, int(1e9)), _rates(mwu))
    assert e.fill_s == pytest.approx(250e6 / 1e12 + 250e6 / 2e12)
    assert e.buckets == 4


def test_model_weight_update_bad_input_raises(mwu):
    with pytest.raises(ValueError, match="senders"):
        mwu.Update(1e9, 0, 1, 1)
    with pytest.raises(ValueError, match="no room"):
        mwu.bucket_used(mwu.Update(1e9, 4, 4, 1 << 20, receiver_budget_bytes=4))


def test_model_weight_update_calibration_within_15_percent(mwu):
    """Every measured point: the two default rows and the bucket sweep (4 to 240 buckets)."""
    rates = mwu.measured_rates()
    cal, sweep = mwu.calibration(rates), mwu.sweep_check(rates)
    assert [c.name for c in cal] == [m.name for m in mwu.MEASURED] and len(sweep) == len(mwu.SWEEP)
    for c in cal + sweep:
        assert abs(c.error) < 0.15, c
        assert c.model_s > c.ceiling_s  # never faster than one broadcast of all the bytes


def test_model_weight_update_script_prints_every_row(tmp_path):
    out = tmp_path / "model.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], capture_output=True, text=True,
                         timeout=60, check=True)
    lines = run.stdout.splitlines()
    for gpus in (8, 64, 256, 1024):
        for model in ("8B", "70B", "235B", "1T"):
            assert sum(line.startswith(f"| {gpus} (") and f"| {model} |" in line for line in lines) == 1, (gpus, model)
    for who in ("checkpoint-engine | Qwen3-235B", "checkpoint-engine | Kimi-K2", "verl", "Perplexity"):
        assert any(who in line for line in lines), who
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 16 and len(result["anchors"]) == 4
    assert all(r["seconds"] > 0 for r in result["rows"])
