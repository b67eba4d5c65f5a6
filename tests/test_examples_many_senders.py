"""The RL example with many senders, as users run it: `torchrun --nproc-per-node N+M
examples/rl_weight_update.py --trainer-ranks N --rollout-ranks M`, gloo on the CPU, a tiny model.

Each run checks its summary line: every received tensor bit for bit, and the busiest trainer rank
sending at most 1.1/N of the model's bytes. (test_examples.py runs the one-sender placements.)
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
# Big enough that each tensor's alignment in the buckets is a small part of a rank's bytes.
TINY = ["--device", "cpu", "--iterations", "2", "--hidden", "128", "--layers", "2", "--vocab", "512",
        "--bucket-mib", "1"]
# What a launcher sets: the example starts with none of them, as from a user's shell.
_LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def _summary(trainers: int, rollouts: int, tp: int = 1, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    # The worktree's offload, not an installed one.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(trainers + rollouts),
           str(ROOT / "examples" / "rl_weight_update.py"), *TINY, "--trainer-ranks", str(trainers),
           "--rollout-ranks", str(rollouts), "--rollout-tp", str(tp), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    lines = re.findall(r"^summary (\{.*\})$", done.stdout, re.M)
    assert len(lines) == 1, done.stdout[-3000:]
    assert len(re.findall(r"^rollout rank \d+ iteration \d+: \d+ tensors received in [0-9.]+ ms, bit for bit$",
                          done.stdout, re.M)) == 2 * rollouts, done.stdout[-3000:]
    return json.loads(lines[0])


@pytest.mark.slow
@pytest.mark.parametrize("trainers,rollouts,tp,extra", [(2, 1, 1, ()), (3, 1, 1, ()), (2, 2, 2, ()),
                                                        (2, 1, 1, ("--snapshot",)),
                                                        (4, 1, 1, ("--trainer-replicas", "2")),
                                                        (2, 2, 1, ("--placement", "colocated")),
                                                        (2, 2, 2, ("--placement", "colocated"))])
def test_examples_rl_weight_update_many_senders(trainers, rollouts, tp, extra):
    summary = _summary(trainers, rollouts, tp, *extra)
    assert summary["bitwise"] is True
    per_rank, model = summary["bytes_sent_per_rank"], summary["model_bytes"]
    assert len(per_rank) == trainers and model > 0 and summary["seconds"] > 0
    assert max(per_rank) <= 1.1 * model / trainers, summary
    assert sum(per_rank) >= model  # every byte of the model goes out, from some rank


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
