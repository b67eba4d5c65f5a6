"""The examples run as users run them: `torchrun --nproc-per-node 2`, tiny models; and with plain
`python`, as a user who has not read the docs starts them.

`--device cpu` (gloo) everywhere, whatever accelerators the host has; the runs on
accelerators are marked: one GPU (colocated), two GPUs (NCCL).

The torchruns are independent of one another: where the host has the cores, the module starts
those of its selected tests side by side as it begins (`runs`), and each test checks its own.
"""

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from offload.core import _device

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


# What a launcher sets: the examples start with none of them, as from a user's shell.
_LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def _run(cmd, timeout):
    """The finished process of `cmd`, with this worktree's offload."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    # The worktree's offload, not an installed one: the script's own folder comes first on its path.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _torchrun(script, *args, timeout=240, check=True):
    done = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(ROOT / "examples" / script), *args], timeout)
    if not check:
        return done
    assert done.returncode == 0, f"{script} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def _python(script, *args, timeout=240):
    """`python examples/<script> args`, without torchrun: the finished process."""
    return _run([sys.executable, str(ROOT / "examples" / script), *args], timeout)


def _losses(out):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)", out, re.M)}


TINY = ["--device", "cpu", "--batch", "2", "--seq", "32", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "256",
        "--offload-min-tensor-bytes", "0"]
ALONE = [*TINY, "--steps", "1"]  # without torchrun


def _fsdp2_resume(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    whole = _torchrun("train_fsdp2.py", *TINY, "--steps", "4", "--activation-offload", "async",
                      "--checkpoint-every", "2", "--checkpoint-dir", ckpt)
    step_2_saved = os.path.isdir(os.path.join(ckpt, "step-2"))
    resumed = _torchrun("train_fsdp2.py", *TINY, "--steps", "4", "--activation-offload", "async",
                        "--checkpoint-dir", ckpt, "--resume")
    return whole, step_2_saved, resumed


def test_examples_train_fsdp2_checkpoint_resume_same_loss(runs):
    whole, step_2_saved, resumed = runs()
    first = _losses(whole)
    assert sorted(first) == [0, 1, 2, 3]
    assert "tokens/s" in whole and "offloaded_mib" in whole and "exposed_wait_ms" in whole
    assert re.search(r"^step 3 .* exposed_wait_ms_slowest_rank \d+\.\d\d$", whole, re.M), whole[-2000:]
    # What a slow step's time went to on the host (the CPU keeps no allocator statistics: 0).
    assert re.search(r"^step 3 .* host_ms \d+\.\d alloc_retries 0 device_allocs 0 ", whole, re.M), whole[-2000:]
    assert step_2_saved
    assert "resumed from step 2" in resumed
    second = _losses(resumed)
    assert sorted(second) == [2, 3]
    assert second[2] == first[2] and second[3] == first[3], (first, second)  # the printed repr: every bit


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_examples_rl_weight_update_checks_weights(runs, placement):
    _check_rl(runs())


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
def test_examples_too_few_devices_clear_message(runs, script, args):
    done = runs()
    assert done.returncode != 0
    assert f"but torch sees {_accelerators()}" in done.stderr and "--device cpu" in done.stderr, done.stderr[-3000:]
    assert "invalid device ordinal" not in done.stderr


def test_examples_train_fsdp2_without_torchrun_trains_alone(runs):
    # One process is a world of one: FSDP2 shards over it, so the script runs as it would
    # under torchrun, and says how to start two ranks.
    done = runs()
    assert done.returncode == 0, done.stderr[-3000:]
    command = shlex.join(["torchrun", "--nproc-per-node", "2", str(ROOT / "examples" / "train_fsdp2.py"), *ALONE])
    assert f"train_fsdp2.py: started without torchrun, so one process trains alone; for two ranks: {command}" \
        in done.stderr.splitlines(), done.stderr[-3000:]
    assert sorted(_losses(done.stdout)) == [0] and "\nsummary {" in done.stdout


def test_examples_rl_weight_update_without_torchrun_says_how_to_launch(runs):
    # A trainer and a rollout engine: one process cannot be both, so it stops before any work.
    done = runs()
    command = shlex.join(["torchrun", "--nproc-per-node", "2", str(ROOT / "examples" / "rl_weight_update.py"),
                          "--device", "cpu"])
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == ("rl_weight_update.py: needs two processes (rank 0 trains, rank 1 rolls "
                                            f"out); launch it with: {command}"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not done.stdout


def _help(example, capsys) -> dict:
    """`--help` of an example, by option: its text on one line, whatever the terminal's width."""
    with pytest.raises(SystemExit) as exit_help:
        example.parse_args(["--help"])
    assert exit_help.value.code == 0
    options = re.split(r"\n  (?=-)", capsys.readouterr().out.split("options:\n", 1)[1])
    return {option.split()[0].rstrip(","): " ".join(option.split()) for option in options}


def test_examples_help_shows_the_defaults(capsys):
    train = _load_example("train_fsdp2")
    options = _help(train, capsys)
    assert all(text.endswith(")") and "(default: " in text for flag, text in options.items() if flag != "-h"), options
    assert options["--device"].endswith("(default: auto)")
    assert options["--steps"].endswith("(default: 20)")
    assert options["--hidden"].endswith("(default: 1024; 512 on the CPU)"), options["--hidden"]
    assert options["--seq"].endswith("(default: 1024; 256 on the CPU)"), options["--seq"]
    # The device's defaults are the ones the run takes; what the command line gives stands.
    on_cpu, on_gpu = train.parse_args(["--device", "cpu"]), train.parse_args(["--device", "cuda"])
    assert (on_cpu.hidden, on_cpu.layers, on_cpu.seq, on_cpu.steps) == (512, 4, 256, 20)
    assert (on_gpu.hidden, on_gpu.layers, on_gpu.seq, on_gpu.steps) == (1024, 8, 1024, 20)
    assert train.parse_args(["--device", "cpu", "--hidden", "64"]).hidden == 64

    options = _help(_load_example("rl_weight_update"), capsys)
    assert all(text.endswith(")") and "(default: " in text for flag, text in options.items() if flag != "-h"), options
    assert options["--placement"].endswith("(default: colocated; separate with --trainer-ranks)")
    rl = _load_example("rl_weight_update")
    assert rl.parse_args([]).placement == "colocated"
    assert rl.parse_args(["--trainer-ranks", "2"]).placement == "separate"
    assert rl.parse_args(["--trainer-ranks", "2", "--placement", "colocated"]).placement == "colocated"
    assert options["--iterations"].endswith("(default: 3)")
    assert options["--bucket-mib"].endswith("(default: None, offload's own)")


@pytest.mark.cuda
def test_examples_rl_weight_update_colocated_on_one_gpu(runs):
    _check_rl(runs())


@pytest.mark.multi_gpu
def test_examples_rl_weight_update_separate_gpus(runs):
    _check_rl(runs())


def _fsdp2_nccl(tmp_path):
    out = _torchrun("train_fsdp2.py", *TINY[2:], "--steps", "3", "--activation-offload", "auto",
                    "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "ckpt"))
    return out, os.path.isdir(tmp_path / "ckpt" / "step-2")


@pytest.mark.multi_gpu
def test_examples_train_fsdp2_nccl_offload_and_checkpoint(runs):
    out, step_2_saved = runs()
    assert sorted(_losses(out)) == [0, 1, 2] and "offloaded_mib" in out
    assert step_2_saved


def _rl_on_cpu(placement):
    return lambda tmp: _torchrun("rl_weight_update.py", "--device", "cpu", "--placement", placement, *RL_TINY)


def _too_few(script, args):
    return lambda tmp: _torchrun(script, "--device", _device.accelerator_type() or "cuda", *args, check=False)


# What each test runs, by its name: a function of a fresh folder, returning what the test checks.
RUNS = {
    "test_examples_train_fsdp2_checkpoint_resume_same_loss": _fsdp2_resume,
    "test_examples_rl_weight_update_checks_weights[colocated]": _rl_on_cpu("colocated"),
    "test_examples_rl_weight_update_checks_weights[separate]": _rl_on_cpu("separate"),
    "test_examples_too_few_devices_clear_message[train_fsdp2.py-args0]": _too_few("train_fsdp2.py", TINY[2:]),
    "test_examples_too_few_devices_clear_message[rl_weight_update.py-args1]":
        _too_few("rl_weight_update.py", ["--placement", "separate", *RL_TINY]),
    "test_examples_rl_weight_update_colocated_on_one_gpu":
        lambda tmp: _torchrun("rl_weight_update.py", "--placement", "colocated", *RL_TINY),
    "test_examples_rl_weight_update_separate_gpus":
        lambda tmp: _torchrun("rl_weight_update.py", "--placement", "separate", *RL_TINY),
    "test_examples_train_fsdp2_nccl_offload_and_checkpoint": _fsdp2_nccl,
    "test_examples_train_fsdp2_without_torchrun_trains_alone": lambda tmp: _python("train_fsdp2.py", *ALONE),
    "test_examples_rl_weight_update_without_torchrun_says_how_to_launch":
        lambda tmp: _python("rl_weight_update.py", "--device", "cpu"),
}
# A torchrun of two ranks keeps about three cores busy (its agent, two ranks).
PARALLEL = max(1, (os.cpu_count() or 1) // 4)


def _will_run(item) -> bool:
    """Not skipped by a marker (conftest's, or a skipif whose condition is a value)."""
    return item.get_closest_marker("skip") is None and not any(
        m.args and m.args[0] is True for m in item.iter_markers("skipif"))


class _Runs:
    def __init__(self, futures, tmp_path_factory):
        self.futures, self.tmp_path_factory = futures, tmp_path_factory

    def result(self, name):
        """What the run of test `name` returned (its exception, if it raised)."""
        future = self.futures.get(name)
        if future is None:  # not started with the module: run it here
            return RUNS[name](self.tmp_path_factory.mktemp("run"))
        return future.result()


@pytest.fixture(scope="module")
def _started(request, tmp_path_factory):
    names = [item.name for item in request.session.items
             if item.module is request.module and item.name in RUNS and _will_run(item)]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        # Submitted in the tests' order: with one worker they run one at a time, as the tests come.
        futures = {name: pool.submit(RUNS[name], tmp_path_factory.mktemp("run")) for name in names}
        yield _Runs(futures, tmp_path_factory)
        for future in futures.values():
            future.cancel()


@pytest.fixture
def runs(_started, request):
    """This test's run: `runs()` waits for it and returns what it returned."""
    return lambda: _started.result(request.node.name)


def _load_example(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: dataclasses look their module up there
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
    assert args.profile_steps == {3, 5} and args.offload_keep_last == 1
    assert train.profiled(args, 3, 0) is not None and train.profiled(args, 3, 1) is None
    assert train.profiled(args, 4, 0) is None
    with pytest.raises(SystemExit):
        train.parse_args(["--profile-steps", "x"])
