"""The two README commands on a host whose torch is importable only from an activated venv
and where no package registry is reachable: a fresh clone's `bash scripts/test.sh` and
`bash scripts/bench.sh` use that venv's torch, install nothing that is there, make no
.venv, and build once (the second command finds the build current), also when the user
built it first with README's `pip install --no-build-isolation -e .`."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _site_dirs():
    """The folders this interpreter imports installed packages from (torch, pytest, setuptools, ...)."""
    dirs = [str(Path(torch.__file__).resolve().parent.parent)]
    dirs += [p for p in sys.path if p and p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    return list(dict.fromkeys(dirs))


def _copy_checkout(dest: Path) -> None:
    """The working tree's tracked and unignored files into a new git repository: a fresh clone of it."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    git = ["git", "-C", str(dest), "-c", "user.name=offload", "-c", "user.email=offload@localhost"]
    subprocess.run(["git", "init", "-q", str(dest)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "checkout"], check=True)


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory):
    return _user_venv(tmp_path_factory)


def _user_venv(tmp_path_factory):
    """A venv that reaches this interpreter's torch only through a .pth, a fresh clone, no registry."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout of offload")
    base = tmp_path_factory.mktemp("setup")
    venv = base / "venv"
    # Without the system's site-packages: torch is reachable only through the venv itself.
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a venv here: {made.stderr.strip()[-200:]}")
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pth = Path(site) / "user-packages.pth"
    pth.write_text("\n".join(_site_dirs()) + "\n")
    clone = base / "clone"
    clone.mkdir()
    _copy_checkout(clone)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") and k not in ("PYTHONPATH", "PYTHON", "OFFLOAD_FORCE_FALLBACK", "MAX_JOBS",
                                                      "OFFLOAD_TEST_TIMES")}  # the inner tests are not this run's
    env.update(
        # Two test files' worth of tests: worker processes would cost more than they save.
        OFFLOAD_TEST_WORKERS="1",
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        PIP_NO_INDEX="1",  # no registry
        PIP_CONFIG_FILE=os.devnull,  # nor any local wheel folder a pip.conf names
        # One native build per CI run is affordable (scripts/test.sh's own); this one is pure Python.
        OFFLOAD_BUILD_TARGET="none",
    )
    return {"venv": venv, "site": Path(site), "pth": pth, "clone": clone, "env": env}


def _run(setup, command):
    return subprocess.run(["bash", *command], cwd=setup["clone"], env=setup["env"], capture_output=True,
                          text=True, timeout=1800)


REPORT_LINE = re.compile(r"^offload setup: python (\S+), torch (\S+) \((.+)\), device (.+)$", re.M)


def _assert_used_the_venv(setup, output):
    match = REPORT_LINE.search(output)
    assert match, output
    assert Path(match.group(1)).parent == setup["venv"] / "bin"
    assert match.group(2) == torch.__version__
    assert not (setup["clone"] / ".venv").exists()
    # torch still comes from where the .pth points: nothing installed it into the venv.
    assert not (setup["site"] / "torch").exists()
    assert not list(setup["site"].glob("torch-*.dist-info"))
    assert setup["pth"].read_text().splitlines() == _site_dirs()


def test_setup_scripts_use_the_activated_venv_offline(user_venv):
    tests = _run(user_venv, ["scripts/test.sh", "tests/test_package.py", "-k", "info_reports or imports_when"])
    output = tests.stdout + tests.stderr
    assert tests.returncode == 0, output[-4000:]
    _assert_used_the_venv(user_venv, output)
    assert "installing offload without its compiled core" in output
    assert output.count(" passed") == 2  # the native run and the forced-fallback run

    # The second command: the build is current (stamp), so nothing is rebuilt.
    bench = _run(user_venv, ["scripts/bench.sh", "--quick", "--only", "param_offload", "buckets"])
    output = bench.stdout + bench.stderr
    assert bench.returncode == 0, output[-4000:]
    _assert_used_the_venv(user_venv, output)
    assert "nothing to rebuild" in output and "installing offload" not in output
    data = json.loads((user_venv["clone"] / "bench_out" / "results.json").read_text())
    assert data["sections"]["param_offload"]["status"] == "ran"
    buckets = data["sections"]["buckets"]
    assert buckets["status"] == ("ran" if _importable("transformers") else "skipped")
    assert data["meta"]["git"]["commit"] and data["meta"]["quick"] is True
    assert (user_venv["clone"] / "bench_out" / "report.md").exists()


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_setup_scripts_reuse_a_build_made_with_pip(tmp_path_factory):
    # README's Install from a clone, then the main job: the build setup.py recorded is current.
    setup = _user_venv(tmp_path_factory)
    python = setup["venv"] / "bin" / "python"
    # --no-deps: without a registry pip cannot re-resolve torch's own requirements; the build is the same.
    built = subprocess.run([str(python), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."],
                           cwd=setup["clone"], env=setup["env"], capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, (built.stdout + built.stderr)[-4000:]
    stamp = json.loads((setup["clone"] / "build" / "offload-build-stamp.json").read_text())
    assert stamp["native"] is False  # OFFLOAD_BUILD_TARGET=none: the pure-Python install
    bench = _run(setup, ["scripts/bench.sh", "--quick", "--only", "param_offload"])
    output = bench.stdout + bench.stderr
    assert bench.returncode == 0, output[-4000:]
    assert "nothing to rebuild" in output and "installing offload" not in output
