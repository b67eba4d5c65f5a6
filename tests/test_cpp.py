"""Runs the C++ unit tests (tests/cpp/, built by CMakeLists.txt and run by ctest),
and checks that the native core stays apart from its Python bindings.

The unit tests test the native core's C++ API directly: the host pool's size
classes, reuse, limit, reserve/trim and threads, and the copy engine's round
trips. Building them compiles the core once more (a few minutes on 2 cores, one
job per core), hence `slow`; run.sh reuses a build whose inputs hash the same, so a
second run on the same machine only runs the tests. They link the core alone, built
without Python's headers.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "cpp", "run.sh")
CSRC = os.path.join(ROOT, "csrc")
CPP_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")
# What only the bindings may include: CPython, pybind11 and torch's Python layer.
PYTHON_INCLUDE = re.compile(
    r'^\s*#\s*include\s*[<"](Python\.h|pybind11/[^>"]*|torch/extension\.h|torch/python\.h|torch/csrc/[^>"]*'
    r'|offload/bindings_registry\.h)[>"]',
    re.MULTILINE,
)


def _sources(folder):
    for dirpath, _, names in os.walk(folder):
        for name in sorted(names):
            if name.endswith(CPP_SUFFIXES):
                yield os.path.join(dirpath, name)


def test_cpp_core_includes_no_python():
    core = os.path.join(CSRC, "core")
    offenders = []
    for path in _sources(core):
        with open(path, encoding="utf-8") as f:
            for match in PYTHON_INCLUDE.finditer(f.read()):
                offenders.append(f"{os.path.relpath(path, ROOT)}: {match.group(0).strip()}")
    assert list(_sources(core)), "csrc/core holds no sources"
    assert not offenders, "csrc/core must compile without Python.h or pybind11 (bindings go to csrc/python):\n" + (
        "\n".join(offenders)
    )


def test_cpp_files_stay_readable():
    longest = {os.path.relpath(path, ROOT): sum(1 for _ in open(path, encoding="utf-8")) for path in _sources(CSRC)}
    too_long = {path: lines for path, lines in longest.items() if lines > 900}
    assert longest, "csrc holds no sources"
    assert not too_long, f"C++ files over 900 lines (split them by concern): {too_long}"


@pytest.mark.slow
def test_cpp_unit_tests_pass():
    missing = [tool for tool in ("cmake", "ninja", "bash") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the C++ unit tests need {' and '.join(missing)} on PATH to configure and build")
    env = dict(os.environ, PYTHON=sys.executable)  # the torch these tests run against
    result = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"tests/cpp/run.sh exited with {result.returncode}:\n{output[-8000:]}"
    assert "100% tests passed" in output, output[-8000:]
