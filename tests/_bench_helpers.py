"""Loading a benchmark section's file in a test, as the runner loads it."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def load_section(monkeypatch, name: str):
    """benchmarks/<name>.py as a module: its folder on sys.path, since the sections import their
    helpers by plain name (`from common import row`) as the runner lets them, and the module in
    sys.modules under `name`, where its dataclasses look their module up."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delitem(sys.modules, "common", raising=False)
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
