"""benchmarks/soak.py --quick: every section runs, stays flat after warm-up and matches its reference bitwise."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _soak(tmp_path, *extra):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--out", str(tmp_path),
                             "--quick", *extra], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    with open(tmp_path / "soak.json") as f:
        return json.load(f)


def _check(summary, sections):
    rows = {r["section"]: r for r in summary["sections"]}
    assert set(sections) <= set(rows), rows.keys()
    for name in sections:
        row = rows[name]
        assert row["exact"] and row["flat"] and row["checks"] > 0 and not row["mismatches"], row
        assert set(row["memory"]) == {"device_bytes", "pool_reserved_bytes", "pool_in_use_bytes", "rss_bytes"}


def test_faults_soak_quick_staging_and_params(tmp_path):
    _check(_soak(tmp_path, "--only", "staging,params"), ["staging_dcp", "param_offload"])


@pytest.mark.slow
def test_faults_soak_quick_all(tmp_path):
    summary = _soak(tmp_path)
    _check(summary, ["activation_async", "activation_auto", "staging_dcp", "param_offload"])
    sync = [r for r in summary["sections"] if r["section"].startswith("weight_sync")]
    assert sync and all("skipped" in r or (r["exact"] and r["flat"]) for r in sync), sync
