"""Runs the C++ unit tests (tests/cpp/, built by CMakeLists.txt and run by ctest).

They test the native core's C++ API directly: the host pool's size classes, reuse,
limit, reserve/trim and threads, and the copy engine's round trips. Building them
compiles the core once more (a few minutes on 2 cores), hence `slow`.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "cpp", "run.sh")


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
