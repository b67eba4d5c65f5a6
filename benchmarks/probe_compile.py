"""Where a model compiled whole with offload computes differently from the same model compiled
without it: a diagnostic, not a bench section.

`python benchmarks/probe_compile.py [--d 1024] [--layers 6] [--rows 8192]` (from a checkout with
offload installed; on a GPU, or on the CPU where inductor writes C++ kernels). It compiles the
bench's block stack twice without offload and once with async offload, all under inductor's
deterministic mode and torch's deterministic algorithms, runs one step of each and prints:

- the parameters whose gradients differ between the two compiles without offload (none: the
  compile itself is reproducible) and between those and the offloaded compile, with the largest
  difference;
- the kernels inductor generated for each compile's graphs, and those that only one side has
  (offload's ops and their arguments aside): a kernel whose body differs is where a value is
  computed in another order.

docs/design/compile.md says how offload places its ops in the compiled graphs.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from typing import Dict, List

import torch
from torch import nn

import offload
from offload.core import _device

# A generated kernel in the wrapper code: `name = async_compile.triton('name', '''source''', ...)` on a
# GPU, `name = async_compile.cpp_pybinding([...], r'''source''')` on the CPU.
_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(.*?r?'''(.*?)'''", re.S | re.M)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Blocks(nn.Module):
    """Residual MLP blocks and a head to a scalar: the GPU compile test's model, written again
    here because a diagnostic run from a checkout does not import the test suite."""

    def __init__(self, d, n):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def _kernels(sources: List[str]) -> Dict[str, str]:
    """Kernel body (its generated name made neutral) -> the name it had, over all `sources`."""
    found = {}
    for source in sources:
        for name, body in _KERNEL.findall(source):
            found[body.replace(name, "kernel").strip()] = name
    return found


def _compiled_step(model, x):
    """One step of `model` compiled whole: (its gradients, the code inductor generated)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model.compile()

    def step():
        model.zero_grad(set_to_none=True)
        model(x).backward()

    step()  # the compile
    _, sources = run_and_get_code(step)
    step_grads = [p.grad.clone() for p in model.parameters()]
    return step_grads, sources


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=1024, help="block width")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=8192, help="rows of the input")
    parser.add_argument("--min-bytes", type=int, default=1 << 20, help="offload's min_tensor_bytes")
    args = parser.parse_args(argv)

    import torch._inductor.config as inductor_config

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = True
    # Each compile generates its code again: a cached graph would hide its kernels.
    inductor_config.force_disable_caches = True

    device = _device.current_device()
    torch.manual_seed(0)
    with torch.device(device):
        base = Blocks(args.d, args.layers)
        x = torch.randn(args.rows, args.d)
    names = [name for name, _ in base.named_parameters()]

    runs = {}
    for label in ("compiled", "compiled again", "compiled with offload"):
        model = copy.deepcopy(base)
        handle = (offload.enable_activation_offload(model, "async", min_tensor_bytes=args.min_bytes)
                  if label.endswith("offload") else None)
        runs[label] = _compiled_step(model, x)
        if handle is not None:
            print(f"{label}: {handle.stats()['d2h_bytes']:,} bytes offloaded in the step")
            handle.disable()

    reference_grads, reference_code = runs["compiled"]
    for label in ("compiled again", "compiled with offload"):
        grads, code = runs[label]
        differ = [(name, (a.double() - b.double()).abs().max().item())
                  for name, a, b in zip(names, reference_grads, grads) if not torch.equal(a, b)]
        print(f"\n{label} against compiled: {len(differ)} of {len(names)} gradients differ")
        for name, most in differ:
            print(f"  {name}: largest difference {most:.3g}")
        ours, theirs = _kernels(code), _kernels(reference_code)
        only_ours = [body for body in ours if body not in theirs]
        only_theirs = [body for body in theirs if body not in ours]
        print(f"  kernels: {len(ours)} here, {len(theirs)} there; {len(only_ours)} only here, "
              f"{len(only_theirs)} only there")
        for side, bodies, table in (("only here", only_ours, ours), ("only there", only_theirs, theirs)):
            for body in bodies:
                print(f"\n  --- {side}: {table[body]}\n{body}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
