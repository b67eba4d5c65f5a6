"""The Python half of scripts/_env.sh: packages, the one-line report, and the build.

    python scripts/_setup.py packages --need pytest hypothesis --want transformers
    python scripts/_setup.py build

It runs under the interpreter _env.sh chose (the user's, or .venv's) and changes
only that environment. Every install is skipped when the package is already
importable, so a host without a package registry runs this offline once its
packages are there. torch is never installed here: _env.sh installs it only into
a .venv it has just made.

The build installs offload editable (`pip install --no-build-isolation --no-deps -e .`).
Every build of this checkout records a stamp, build/offload-build-stamp.json: a hash of
what the compiled core depends on (every file under csrc/, setup.py, pyproject.toml, the
environment, torch's version and location, OFFLOAD_BUILD_TARGET and OFFLOAD_DEBUG),
written by setup.py itself, so a user's own `pip install --no-build-isolation -e .` counts
too. A later run whose hash matches the stamp, and whose environment imports this
checkout's offload (and its compiled core, if it had one), skips the build.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = ROOT / "build" / "offload-build-stamp.json"
LOG = ROOT / "build" / "offload-build.log"

# Minimum versions of the build tools; pip's name and the module that shows it is there.
BUILD_TOOLS = {"setuptools": (64,), "wheel": ()}


def say(message: str) -> None:
    print(f"offload setup: {message}", flush=True)


def _version_tuple(text: str) -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def missing(module: str, minimum: tuple = ()) -> bool:
    """Whether `module` cannot be imported here (or is older than `minimum`), without importing it."""
    try:
        if importlib.util.find_spec(module) is None:
            return True
    except (ImportError, ValueError):
        return True
    if not minimum:
        return False
    try:
        from importlib.metadata import version

        return _version_tuple(version(module)) < minimum
    except Exception:
        return False  # importable but without metadata: take it as it is


def pip_install(packages, optional: bool) -> bool:
    """pip install `packages` into this environment; True on success.

    Optional packages get a short network timeout: on a host without a registry their
    absence must cost seconds, not pip's retries.
    """
    command = [sys.executable, "-m", "pip", "install", "--quiet", *packages]
    if optional:
        command[4:4] = ["--retries", "1", "--timeout", "15"]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last = [line for line in (result.stderr or result.stdout).strip().splitlines() if line.strip()]
        packages_said = " ".join(packages)
        reason = last[-1].strip() if last else f"pip exited with {result.returncode}"
        if optional:
            # The time said: on a host without a registry, this try is what each run pays until the
            # package is installed.
            say(f"note: {packages_said} is not installed and could not be installed ({reason}; tried for "
                f"{time.monotonic() - start:.0f} s); the parts that need it are skipped")
        else:
            say(f"error: could not install {packages_said} ({reason})")
        return False
    return True


def ensure_packages(need, want) -> int:
    """Install what is missing; `need` failing is an error, `want` failing a note."""
    required = [f"{name}>={'.'.join(map(str, low))}" if low else name
                for name, low in BUILD_TOOLS.items() if missing(name, low)]
    required += [name for name in need if missing(name)]
    if required:
        say(f"installing {' '.join(required)} into {sys.prefix}")
        if not pip_install(required, optional=False):
            say(f"install them into this environment ({sys.executable} -m pip install {' '.join(required)}) "
                "and run again")
            return 1
    if shutil.which("ninja", path=_path_with_scripts()) is None:
        pip_install(["ninja"], optional=True)  # without it torch compiles one file at a time
    for name in want:
        if missing(name):
            pip_install([name], optional=True)
    return 0


def _path_with_scripts() -> str:
    """PATH with this environment's scripts folder first: pip puts ninja there."""
    return os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])


def _device_module():
    """offload/core/_device.py loaded on its own: it needs only torch, so the device is known before the build."""
    spec = importlib.util.spec_from_file_location("_offload_setup_device", ROOT / "offload" / "core" / "_device.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report() -> None:
    """The one line: which interpreter, torch and device this run uses."""
    import torch

    device = _device_module()
    kind = device.accelerator_type()
    where = "cpu only, no accelerator visible" if kind is None else f"{kind}: {device.device_name()}"
    say(f"python {sys.executable}, torch {torch.__version__} ({Path(torch.__file__).parent.parent}), device {where}")


def _from_setup_py(name: str, namespace: dict):
    """A function of setup.py, read from it (setup.py builds when imported), so that the two cannot drift."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            exec(compile(ast.Module(body=[node], type_ignores=[]), "setup.py", "exec"), namespace)
            return namespace[name]
    return None


def default_max_jobs() -> int:
    """setup.py's rule for parallel compile jobs."""
    rule = _from_setup_py("default_max_jobs", {"os": os})
    return int(rule()) if rule is not None else max(1, (os.cpu_count() or 1) // 2)


def stamp() -> dict:
    """setup.py's build stamp of this checkout, as its build would write it now."""
    import torch

    return _from_setup_py("build_stamp", {"os": os, "sys": sys, "torch": torch})(str(ROOT))


def installed_core() -> dict:
    """What this environment imports as offload, asked from outside the checkout (no shadowing by the cwd)."""
    code = (
        "import json, offload\n"
        "from offload.core import _backend\n"
        "print(json.dumps({'file': offload.__file__, 'native': _backend.native_available(),\n"
        "                  'why_not': _backend.why_not(), 'mismatch': _backend.torch_mismatch()}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_FORCE_FALLBACK"}
    with tempfile.TemporaryDirectory() as folder:
        result = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["import offload failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def up_to_date(current: dict) -> bool:
    try:
        recorded = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return False
    if recorded.get("hash") != current["hash"]:
        return False
    state = installed_core()
    if "error" in state:
        return False
    if Path(state["file"]).resolve().parent != ROOT / "offload":
        # A non-editable install: its core is in site-packages, while the commands, run from this
        # clone, import the clone's offload/ (the current folder comes first on sys.path).
        say(f"offload is installed at {Path(state['file']).parent} (not editable); the commands run from this "
            "clone, which imports its own offload/: building it editable")
        return False
    if recorded.get("native") and not state["native"]:
        return False  # the core was built once and no longer loads (removed, or torch changed under it)
    return state.get("mismatch") is None


def _expected_minutes(target_hint: str, jobs: int) -> str:
    """A rough duration: each translation unit against torch's headers takes about a minute of one core."""
    cpp = len(list((ROOT / "csrc").rglob("*.cpp")))
    cu = len(list((ROOT / "csrc").rglob("*.cu"))) if target_hint == "cuda" else 0
    minutes = (cpp * 0.75 + cu * 1.5) / max(1, jobs) + 0.5
    return f"about {max(1, round(minutes))} min"


def _target_hint() -> str:
    asked = os.environ.get("OFFLOAD_BUILD_TARGET", "auto").strip().lower()
    if asked != "auto":
        return asked
    import torch

    return "cuda" if torch.version.cuda and (os.environ.get("CUDA_HOME") or shutil.which("nvcc")) else "cpu"


def build() -> int:
    checked = time.monotonic()
    current = stamp()
    if up_to_date(current):
        say(f"offload is built and installed for this torch; sources unchanged, nothing to rebuild (checked in "
            f"{time.monotonic() - checked:.0f} s)")
        return 0
    jobs = int(os.environ.get("MAX_JOBS") or default_max_jobs())
    target = _target_hint()
    if target == "none":
        say("installing offload without its compiled core (OFFLOAD_BUILD_TARGET=none)")
    else:
        say(f"compiling offload's native core ({target}) with {jobs} parallel jobs (MAX_JOBS), "
            f"{_expected_minutes(target, jobs)} on this host; later runs skip this while csrc/, setup.py "
            "and torch stay the same")
    env = dict(os.environ, MAX_JOBS=str(jobs), PATH=_path_with_scripts())
    env.pop("OFFLOAD_FORCE_FALLBACK", None)
    LOG.parent.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "-e", str(ROOT)]
    start, said = time.monotonic(), set()
    with open(LOG, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1)
        for line in process.stdout:
            log.write(line)
            shown = line.strip()
            # setup.py's own lines (the target it chose and why) and ninja's [done/total] progress.
            if shown.startswith("offload:") and shown not in said:  # pip runs setup.py more than once
                said.add(shown)
                print(f"  {shown}", flush=True)
            elif re.match(r"^\[\d+/\d+\]", shown):
                step = shown.split()[0]
                source = re.search(r"(\S+\.(?:cpp|cu))\b", shown)
                print(f"  {step} {Path(source.group(1)).name if source else 'linking'} "
                      f"({time.monotonic() - start:.0f} s)", flush=True)
        code = process.wait()
    if code != 0:
        with open(LOG) as log:
            tail = log.readlines()[-40:]
        sys.stdout.write("".join(tail))
        say(f"error: the build failed (exit {code}); the full log is {LOG}")
        return 1
    state = installed_core()
    if "error" in state:
        say(f"error: offload does not import after the build: {state['error']} (log: {LOG})")
        return 1
    STAMP.write_text(json.dumps({**current, "native": state["native"]}, indent=2))
    core = "native core" if state["native"] else f"pure PyTorch path ({state['why_not']})"
    say(f"built in {time.monotonic() - start:.0f} s; offload uses its {core}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    packages = sub.add_parser("packages", help="install what is missing and print the one-line report")
    packages.add_argument("--need", nargs="*", default=[], help="packages the command cannot run without")
    packages.add_argument("--want", nargs="*", default=[], help="packages whose absence only skips some parts")
    sub.add_parser("build", help="build and install offload editable unless the stamp says it is current")
    args = parser.parse_args(argv)
    if args.command == "packages":
        report()
        return ensure_packages(args.need, args.want)
    return build()


if __name__ == "__main__":
    sys.exit(main())
