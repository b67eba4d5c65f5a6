"""The examples run as users run them: `torchrun --nproc-per-node 2`, gloo on the CPU (tiny models)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(script, *args, timeout=240):
    env = dict(os.environ)
    # The worktree's offload, not an installed one: the script's own folder comes first on its path.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / script), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def _losses(out):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)", out, re.M)}


TINY = ["--batch", "2", "--seq", "32", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "256",
        "--offload-min-tensor-bytes", "0"]


def test_examples_train_fsdp2_checkpoint_resume_same_loss(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    whole = _torchrun("train_fsdp2.py", *TINY, "--steps", "4", "--activation-offload", "async",
                      "--checkpoint-every", "2", "--checkpoint-dir", ckpt)
    first = _losses(whole)
    assert sorted(first) == [0, 1, 2, 3]
    assert "tokens/s" in whole and "offloaded_mib" in whole and "exposed_wait_ms" in whole
    assert os.path.isdir(os.path.join(ckpt, "step-2"))
    resumed = _torchrun("train_fsdp2.py", *TINY, "--steps", "4", "--activation-offload", "async",
                        "--checkpoint-dir", ckpt, "--resume")
    assert "resumed from step 2" in resumed
    second = _losses(resumed)
    assert sorted(second) == [2, 3]
    assert second[2] == first[2] and second[3] == first[3], (first, second)  # the printed repr: every bit


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_examples_rl_weight_update_checks_weights(placement):
    out = _torchrun("rl_weight_update.py", "--placement", placement, "--iterations", "3", "--hidden", "64",
                    "--layers", "2", "--vocab", "256", "--bucket-mib", "1")
    assert len(re.findall(r"(?<!rollout )iteration \d+ loss", out)) == 3
    assert len(re.findall(r"rollout iteration \d+: \d+ tensors loaded in [0-9.]+ ms, checked", out)) == 3
