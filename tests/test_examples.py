"""The examples run as users run them: `torchrun --nproc-per-node 2`, tiny models.

`--device cpu` (gloo) everywhere, whatever accelerators the host has; the runs on
accelerators are marked: one GPU (colocated), two GPUs (NCCL).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offload.core import _device

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(script, *args, timeout=240, check=True):
    env = dict(os.environ)
    # The worktree's offload, not an installed one: the script's own folder comes first on its path.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / script), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if not check:
        return done
    assert done.returncode == 0, f"{script} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def _losses(out):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)", out, re.M)}


TINY = ["--device", "cpu", "--batch", "2", "--seq", "32", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "256",
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
    _check_rl(_torchrun("rl_weight_update.py", "--device", "cpu", "--placement", placement, *RL_TINY))


RL_TINY = ["--iterations", "3", "--hidden", "64", "--layers", "2", "--vocab", "256", "--bucket-mib", "1"]


def _check_rl(out):
    assert len(re.findall(r"(?<!rollout )iteration \d+ loss", out)) == 3
    assert len(re.findall(r"rollout iteration \d+: \d+ tensors loaded in [0-9.]+ ms, checked", out)) == 3


def _accelerators() -> int:
    kind = _device.accelerator_type()
    return 0 if kind is None else _device._module(kind).device_count()


@pytest.mark.skipif(_accelerators() >= 2, reason="needs fewer than 2 accelerators (to ask for more than there are)")
@pytest.mark.parametrize("script,args", [("train_fsdp2.py", TINY[2:]),
                                         ("rl_weight_update.py", ["--placement", "separate", *RL_TINY])])
def test_examples_too_few_devices_clear_message(script, args):
    kind = _device.accelerator_type() or "cuda"
    done = _torchrun(script, "--device", kind, *args, check=False)
    assert done.returncode != 0
    assert f"but torch sees {_accelerators()}" in done.stderr and "--device cpu" in done.stderr, done.stderr[-3000:]
    assert "invalid device ordinal" not in done.stderr


@pytest.mark.cuda
def test_examples_rl_weight_update_colocated_on_one_gpu():
    _check_rl(_torchrun("rl_weight_update.py", "--placement", "colocated", *RL_TINY))


@pytest.mark.multi_gpu
def test_examples_rl_weight_update_separate_gpus():
    _check_rl(_torchrun("rl_weight_update.py", "--placement", "separate", *RL_TINY))


@pytest.mark.multi_gpu
def test_examples_train_fsdp2_nccl_offload_and_checkpoint(tmp_path):
    out = _torchrun("train_fsdp2.py", *TINY[2:], "--steps", "3", "--activation-offload", "auto",
                    "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert sorted(_losses(out)) == [0, 1, 2] and "offloaded_mib" in out
    assert os.path.isdir(tmp_path / "ckpt" / "step-2")


def _load_example(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Handle:
    def __init__(self, plan):
        self.plan = plan


def test_examples_train_fsdp2_auto_settles_only_on_a_settled_plan():
    # Before auto mode's first plan the step measures (every layer offloaded) and then probes
    # alternate with steps without offload: none of those is the steady state the summary times.
    train = _load_example("train_fsdp2")
    assert not train.plan_settled(_Handle(None), "auto")
    assert not train.plan_settled(_Handle({"tuning": {"settled": False}}), "auto")
    assert train.plan_settled(_Handle({"tuning": {"settled": True}}), "auto")
    assert train.plan_settled(_Handle(None), "async")
    args = train.parse_args(["--profile-steps", "3,5"])
    assert args.profile_steps == {3, 5}
    assert train.profiled(args, 3, 0) is not None and train.profiled(args, 3, 1) is None
    assert train.profiled(args, 4, 0) is None
    with pytest.raises(SystemExit):
        train.parse_args(["--profile-steps", "x"])
