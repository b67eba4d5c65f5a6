"""Activation offload of a model compiled whole (offload/activation/compiled/, docs/design/compile.md).

The compile tests run inductor on the CPU: the offloaded step's gradients are bitwise those of
the same model compiled without offload, bytes leave for the host pool and come back, and no
graph break is added. The other tests check the pure parts (layout, layer matching, budget
plan) and the errors for what is not served, without inductor.
"""

import copy
import re

import pytest
import torch
from torch import fx, nn
from torch._dynamo.utils import counters

import offload
from offload.activation.compiled import support
from offload.core import _device
from offload.activation.compiled.layer_map import LayerMatcher, normalize_path
from offload.activation.compiled.layout import SPAN_ALIGN, TensorSpec, flatten_specs, group_layout, unflatten_specs
from offload.activation.auto.schedule import COPY_MARGIN, FETCH_MARGIN
from offload.activation.compiled.costs import node_flops
from offload.activation.compiled.plan import SavedBytes, StepCosts, budget_plan, hidden_plan, step_estimate

pytestmark = pytest.mark.skipif(support.partitioner_hook() is not None,
                                reason=f"needs inductor's custom partitioner hook: {support.partitioner_hook()}")

# Models compiled on the CPU hold host memory already: where an accelerator exists, offload
# leaves their saved tensors alone (as the eager engine does), and the cuda tests below cover
# the device.
cpu_model = pytest.mark.skipif(_device.accelerator_type() is not None,
                               reason="a model on the CPU; with an accelerator present the cuda tests cover offload")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Blocks(nn.Module):
    def __init__(self, d=32, n=4):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


class AttentionBlock(nn.Module):
    """A fused q/k/v projection split into three views of one buffer, which attention saves."""

    def __init__(self, d, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, s, d))


class AttentionBlocks(nn.Module):
    def __init__(self, d=32, n=3):
        super().__init__()
        self.layers = nn.ModuleList(AttentionBlock(d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _assert_same_grads(expected, model):
    for (name, p), want in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=0, msg=f"gradient of {name}")


def _blocks_step(model, x):
    model(x).backward()


@pytest.fixture(scope="module")
def blocks_case():
    """A Blocks model, its input and the gradients of that model compiled without offload."""
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(8, 32)
    torch._dynamo.reset()
    reference = copy.deepcopy(model)
    reference.compile()
    _blocks_step(reference, x)
    return model, x, _grads(reference)


def _step_offloads(step, handle, expected, model, groups):
    """`step()` adds no graph break, offloads `groups` groups and leaves the expected gradients."""
    breaks = _graph_breaks()
    step()
    assert _graph_breaks() == breaks
    _check_offloaded(handle, expected, model, groups)
    handle.disable()


def _check_offloaded(handle, expected, model, groups):
    stats = handle.stats()
    assert stats["compiled_steps"] >= 1
    assert stats["d2h_bytes"] > 0 and stats["h2d_bytes"] == stats["d2h_bytes"]
    assert stats["groups_offloaded"] == groups and stats["groups_fetched"] == groups
    _assert_same_grads(expected, model)


@pytest.mark.slow
@cpu_model
def test_compile_blocks_enabled_before_compile(blocks_case):
    base, x, expected = blocks_case
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0)
    model.compile()
    breaks = _graph_breaks()
    for _ in range(2):  # the second step runs the compiled graphs again: counters are per step
        model.zero_grad()
        _blocks_step(model, x)
    assert _graph_breaks() == breaks
    # keep_last=1 and the window's tail (Note [window tail]): two of four layers
    _check_offloaded(handle, expected, model, groups=2)
    assert handle.stats()["compiled_steps"] == 2
    handle.disable()


@pytest.mark.slow
@cpu_model
def test_compile_blocks_enabled_after_compile(blocks_case):
    base, x, expected = blocks_case
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    handle = offload.enable_activation_offload(compiled, min_tensor_bytes=0, mode="async")
    assert handle.layers == ["layers.0", "layers.1", "layers.2", "layers.3"]  # the user's names, not _orig_mod's
    _step_offloads(lambda: _blocks_step(compiled, x), handle, expected, model, groups=2)


@pytest.mark.slow
@cpu_model
@pytest.mark.parametrize("resident_groups", [1, 2, 3])
def test_compile_window_tail_stays_on_the_device(blocks_case, resident_groups):
    """With the resident window's releases, the last `resident_groups - 1` offloaded layers stay
    on the device (Note [window tail]); the plan and its note say which; gradients bitwise."""
    base, x, expected = blocks_case
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, resident_groups=resident_groups)
    model.compile()
    with torch._inductor.config.patch(force_disable_caches=True):  # partitioned here: the plan's notes
        _blocks_step(model, x)
    copied = 3 - (resident_groups - 1)  # keep_last=1: three of four layers may go
    plan = handle.stats()["compiled_plan"]
    assert plan["offload"] == [i < copied for i in range(4)]
    staying = [f"layers.{i}" for i in range(copied, 3)]
    assert any(note.startswith(", ".join(staying) + " stay on the device") for note in plan["notes"]) == bool(staying)
    _check_offloaded(handle, expected, model, groups=copied)
    handle.disable()


def test_compile_window_tail_only_with_the_windows_releases():
    from offload.activation.compiled.rewrite import RewriteOptions, SavedGroup, window_tail

    groups = [SavedGroup(layer, [], 0) for layer in range(4)]
    options = RewriteOptions(runtime=1, resident_groups=3, min_tensor_bytes=0, device=torch.device("cpu"))
    copied, staying = window_tail(groups, options)
    assert [g.layer for g in copied] == [0, 1] and [g.layer for g in staying] == [2, 3]
    planned = RewriteOptions(1, 3, 0, torch.device("cpu"), release_after={0: 1, 1: 2, 2: None, 3: None})
    assert window_tail(groups, planned) == (groups, [])  # auto mode's plan places every release itself
    assert window_tail(groups[:1], options) == ([], groups[:1])


@pytest.mark.slow
@cpu_model
def test_compile_blocks_budget_recomputes_in_the_compiled_graph(blocks_case):
    """A budget no offload can meet makes the compiler recompute layers: the plan says so, the
    backward graph runs their ops again, and the gradients stay bitwise equal."""
    base, x, expected = blocks_case
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    handle = offload.enable_activation_offload(model, mode="auto", memory_budget_bytes=1, min_tensor_bytes=0)
    model.compile()
    _blocks_step(model, x)
    plan = handle.stats()["compiled_plan"]
    assert any(plan["recompute"])
    _assert_same_grads(expected, model)
    handle.disable()


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    return model, torch.randint(0, 64, (2, 16))


def _llama_step(model, ids):
    model(input_ids=ids, labels=ids).loss.backward()


@pytest.fixture(scope="module")
def llama_case():
    model, ids = _llama()
    torch._dynamo.reset()
    reference = copy.deepcopy(model)
    reference.compile()
    _llama_step(reference, ids)
    return model, ids, _grads(reference)


@pytest.mark.slow
@cpu_model
@pytest.mark.parametrize("when", ["before", "after"])
def test_compile_llama(llama_case, when):
    base, ids, expected = llama_case
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    if when == "before":
        handle = offload.enable_activation_offload(model, min_tensor_bytes=0)
        model.compile()
    else:
        model.compile()
        handle = offload.enable_activation_offload(model, min_tensor_bytes=0)
    _step_offloads(lambda: _llama_step(model, ids), handle, expected, model, groups=1)


def _peak_and_grads(model, x):
    """One step after the first (the compile, if any, and the gradients' allocation): (peak device
    bytes above the idle model, device bytes still held once the step is done, the gradients)."""
    _blocks_step(model, x)
    model.zero_grad(set_to_none=False)
    _device.synchronize()
    idle = _device.memory_allocated()
    _device.reset_peak_memory_stats()
    _blocks_step(model, x)
    _device.synchronize()
    return _device.max_memory_allocated() - idle, _device.memory_allocated() - idle, _grads(model)


def _generated_kernels(model, x):
    """The bodies of the kernels inductor generates for one compiled step of `model` (their
    generated names made neutral), and the wrapper code."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model.compile()
    with torch._inductor.config.patch(force_disable_caches=True):
        _, sources = run_and_get_code(lambda: _blocks_step(model, x))
    found = set()
    for source in sources:
        for name, body in re.findall(r"^(\w+) = async_compile\.\w+\(.*?r?'''(.*?)'''", source, re.S | re.M):
            found.add(body.replace(name, "kernel").strip())
    return found, "\n".join(sources)


@cpu_model
@pytest.mark.slow
@pytest.mark.parametrize("blocks", ["mlp", "attention"])
def test_compile_kernels_are_those_of_the_model_compiled_without_offload(blocks):
    """Offload's ops change no kernel of the compiled graphs: each layer's restored tensors
    come in where its backward starts, so inductor fuses as it does without offload, and they
    count as aligned, as the saved tensors they stand for did (on a GPU, either would change
    the order of some sums); views rebuilt on a buffer copied once (q, k, v) read as they did."""
    torch.manual_seed(0)
    base = Blocks(32, 3) if blocks == "mlp" else AttentionBlocks(32, 3)
    x = torch.randn(8, 32) if blocks == "mlp" else torch.randn(2, 16, 32)
    expected, _ = _generated_kernels(copy.deepcopy(base), x)
    model = copy.deepcopy(base)
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0)
    kernels, code = _generated_kernels(model, x)
    assert handle.stats()["groups_fetched"] == 1  # keep_last=1 and the window's tail: one of three layers
    assert kernels == expected
    assert "group_in.default) is assumed to be not aligned" not in code
    handle.disable()


@pytest.fixture
def inductor_deterministic(deterministic, monkeypatch):
    """Inductor's deterministic mode besides the deterministic kernels: without it inductor picks
    among a reduction's configurations by timing them, so two compiles of the same graph may sum
    in different orders."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "deterministic"):
        monkeypatch.setattr(inductor_config, "deterministic", True)


def _device_blocks_compiled_without_offload():
    """The GPU tests' model and input, and its peak and gradients compiled without offload."""
    torch.manual_seed(0)
    with torch.device(_device.current_device()):
        base = Blocks(d=1024, n=6)
        x = torch.randn(8192, 1024)
    reference = copy.deepcopy(base)
    torch._dynamo.reset()
    reference.compile()
    peak, _, grads = _peak_and_grads(reference, x)
    return base, x, peak, grads


@pytest.mark.cuda
@pytest.mark.slow
def test_compile_blocks_on_the_device_bitwise_with_a_lower_peak(inductor_deterministic):
    """On the GPU: compiled whole with async offload, the step's gradients are those of the model compiled
    without it, bit for bit, bytes go to the host and back, no graph break is added, and the activation peak
    falls as far as the same offload takes it in eager (copies on offload's streams, released a window later,
    fetched one group ahead, each restored group let go where backward is done with it), with nothing of the
    step left on the device after it.

    Why the bound is eager's: the host runs ahead of the copies by many groups in a compiled step (nothing
    blocks it), so a restored group the core held until the host saw its copy done kept every group of the
    step on the device at once, a peak close to the model's without offload."""
    base, x, ref_peak, expected = _device_blocks_compiled_without_offload()
    eager = copy.deepcopy(base)
    eager_handle = offload.enable_activation_offload(eager, "async", min_tensor_bytes=1 << 20)
    eager_peak, _, _ = _peak_and_grads(eager, x)
    eager_handle.disable()
    del eager
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=1 << 20)
    model.compile()
    breaks = _graph_breaks()
    peak, held, grads = _peak_and_grads(model, x)
    assert _graph_breaks() == breaks
    for (name, _), a, b in zip(model.named_parameters(), expected, grads):
        assert torch.equal(a, b), f"gradient of {name}"
    stats = handle.stats()
    assert stats["d2h_bytes"] > 0 and stats["h2d_bytes"] == stats["d2h_bytes"]
    assert held == 0, f"{held} bytes of the step still on the device after it"
    # The graphs save what eager saves here (each layer's input and its ReLU's output); a tenth over
    # eager's peak leaves room for inductor's own buffer reuse, not for one more restored group.
    assert peak <= 1.1 * eager_peak and peak < ref_peak, (peak, eager_peak, ref_peak)
    handle.disable()


@pytest.mark.cuda
@pytest.mark.slow
def test_compile_cpu_model_on_an_accelerator_host_left_alone():
    """A model compiled on the CPU of a host with a GPU: its saved tensors are host memory
    already, so the step runs as compiled without offload, copies nothing and raises nothing."""
    torch.manual_seed(0)
    base = Blocks()
    x = torch.randn(8, 32)
    reference = copy.deepcopy(base)
    torch._dynamo.reset()
    reference.compile()
    _blocks_step(reference, x)
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0)
    model.compile()
    _blocks_step(model, x)
    stats = handle.stats()
    assert stats["d2h_bytes"] == 0 and stats["groups_offloaded"] == 0
    _assert_same_grads(_grads(reference), model)
    handle.disable()


@pytest.mark.slow
def test_compile_frozen_model_runs_without_offload():
    """Nothing requires grad: AOTAutograd compiles no backward, so no marker is recorded and the
    compiled forward runs as without offload."""
    model = Blocks(8, 3)
    for p in model.parameters():
        p.requires_grad_(False)
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0)
    torch._dynamo.reset()
    model.compile()
    out = model(torch.randn(2, 8))
    assert out.shape == () and handle.stats()["compiled_steps"] == 0
    handle.disable()


# ---------------------------------------------------------------- what is not served


def test_compile_other_backend_refused_at_enable():
    model = Blocks(8, 2)
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"enable_activation_offload: model is compiled with backend 'aot_eager'.*"
                                           r"inductor backend"):
        offload.enable_activation_offload(compiled)


def test_compile_other_backend_raises_at_first_forward():
    """Enabled before a compile with another backend: nothing can be said at the call, so the
    first compiled forward says it, and names what to do."""
    model = Blocks(8, 2)
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(RuntimeError, match="not rewritten by offload's partitioner.*inductor backend"):
        compiled(torch.randn(2, 8)).backward()
    handle.disable()


def test_compile_without_partitioner_hook_refused(monkeypatch):
    monkeypatch.setattr(support, "partitioner_hook", lambda: "this torch has no custom partitioner hook")
    model = Blocks(8, 2)
    compiled = torch.compile(model)
    with pytest.raises(RuntimeError, match="no custom partitioner hook.*compile its layers"):
        offload.enable_activation_offload(compiled)


@cpu_model
def test_compile_eager_model_unaffected():
    """A handle's binding costs an eager step nothing: the eager engine offloads as before."""
    model = Blocks(256, 3)
    handle = offload.enable_activation_offload(model, min_tensor_bytes=0, min_group_bytes=0)
    model(torch.randn(64, 256)).backward()
    stats = handle.stats()
    assert stats["compiled_steps"] == 0 and stats["compiled_plan"] is None
    assert stats["groups_offloaded"] > 0
    handle.disable()


# ---------------------------------------------------------------- pure parts


def test_compile_layout_aligns_spans():
    specs = [TensorSpec((3, 5), (5, 1), torch.float32), TensorSpec((4, 2), (1, 4), torch.bfloat16),
             TensorSpec((7,), (2,), torch.int8)]
    layout = group_layout(specs)
    assert layout.span_bytes == (60, 16, 13)
    assert layout.offsets == (0, SPAN_ALIGN, 2 * SPAN_ALIGN)
    assert layout.total == 2 * SPAN_ALIGN + 13
    assert unflatten_specs(*flatten_specs(specs)) == specs


@pytest.mark.parametrize("path, want", [
    ("L['self'].model.layers.0", "model.layers.0"),
    ("L['self'].model.layers[0]", "model.layers.0"),
    ("L['self']._modules['model']._modules['layers']._modules['0']", "model.layers.0"),
    ("getattr(L['self'].model.layers, '0')", "model.layers.0"),
    ("L['self']", ""),
])
def test_compile_normalize_path(path, want):
    assert normalize_path(path) == want


def test_compile_layer_matcher_matches_suffix_and_class():
    matcher = LayerMatcher(["layers.0", "layers.1"], [Block, Block])
    assert matcher.index_of_path("_call.__closure__.1.cell_contents().layers.1", Block) == 1
    assert matcher.index_of_path("model.layers.1", Block) == 1
    assert matcher.index_of_path("model.layers.11", Block) is None
    assert matcher.index_of_path("model.layers.1", nn.Linear) is None  # another module at that path


def test_compile_budget_plan_offloads_earliest_first_then_recomputes():
    saved = SavedBytes([100, 100, 100, 100], other=10)
    keep = [False, False, False, True]
    plan = budget_plan(saved, keep, budget=10 + 100 + 100 + 100, base_bytes=0, resident_groups=1)
    assert plan.offload == [True, False, False, False] and not any(plan.recompute)
    plan = budget_plan(saved, keep, budget=10 + 100, base_bytes=0, resident_groups=1)
    assert plan.offload == [True, True, True, False] and not any(plan.recompute)
    plan = budget_plan(saved, keep, budget=10, base_bytes=0, resident_groups=1)
    assert plan.recompute == [False, False, False, True] and plan.offload == [True, True, True, False]
    plan = budget_plan(saved, keep, budget=10 + 400, base_bytes=0, resident_groups=2)
    assert not any(plan.offload) and not any(plan.recompute)


def _step_costs(nbytes, forward, backward, bus=1e9, rest=(0.0, 0.0)):
    """Costs whose copies take nbytes / bus seconds once the schedule's margins are applied."""
    return StepCosts(nbytes, forward, backward, rest[0], rest[1], d2h_bps=bus * (1 + COPY_MARGIN),
                     h2d_bps=bus * (1 + FETCH_MARGIN))


def test_compile_step_estimate_follows_the_rewrite():
    """Two layers, 1 s forward and 2 s backward each, 1.5 s copies: layer 0 offloaded waits 0.5 s at
    the forward's end (its copy is not done by then, so it is let go there) and 1.5 s where layer 1's
    backward starts (no layer after it to fetch under: fetched as backward starts, it needs layer
    0's output); nothing offloaded waits for nothing."""
    costs = _step_costs([1.5e9, 1.5e9], [1.0, 1.0], [2.0, 2.0])
    none = step_estimate([False, False], costs)
    assert (none.exposed, none.step, none.release_after) == (0.0, 6.0, {})
    one = step_estimate([True, False], costs)
    assert (round(one.exposed, 9), round(one.step, 9), one.release_after) == (2.0, 8.0, {0: None})
    assert one.first_fetch_at is None


def test_compile_step_estimate_lets_groups_go_where_their_copies_are_done():
    """Auto mode's release points: a 1 s copy out of layer 0 (ends at 1 s) is done by layer 1's end (2 s),
    so its group goes there, without a wait; layer 1's (done at 3 s) goes at the last layer's end (3 s).
    The one wait is backward's first: layer 2's backward needs layer 1's group, fetched as it starts."""
    costs = _step_costs([1e9, 1e9, 0], [1.0, 1.0, 1.0], [3.0, 3.0, 3.0])
    estimate = step_estimate([True, True, False], costs)
    assert estimate.release_after == {0: 1, 1: 2} and estimate.exposed == 1.0


def test_compile_step_estimate_fetches_the_first_group_as_late_as_its_copy_allows():
    """Auto mode's first copy back: layer 0's group, needed where layer 1's backward starts, takes 1.5 s
    to come back; layers 3 and 2 (1 s each) are the fewest before that which last as long, so it is
    issued where layer 3's backward starts, not at backward's start (where it would sit on the device
    through the backward's peak), and still arrives in time."""
    costs = _step_costs([1.5e9] + [0] * 5, [1.0] * 6, [1.0] * 6)
    estimate = step_estimate([True] + [False] * 5, costs)
    assert estimate.first_fetch_at == 3
    assert round(estimate.exposed, 9) == 0.0


def test_compile_hidden_plan_offloads_the_earliest_layers_that_hide():
    """Copies of 1 s under layers of 1 s forward and 3 s backward: the first layers' copies hide under
    the layers after them, the last ones' would be waited for at the forward's end."""
    costs = _step_costs([1e9] * 6, [1.0] * 6, [3.0] * 6)
    plan = hidden_plan([True] * 5 + [False], costs)
    chosen = [i for i, on in enumerate(plan.offload) if on]
    assert chosen and chosen == list(range(len(chosen))) and len(chosen) < 5
    estimate = step_estimate(plan.offload, costs)
    assert estimate.exposed <= 0.01 * estimate.step and plan.release_after == estimate.release_after
    more = list(plan.offload)
    more[len(chosen)] = True
    estimate = step_estimate(more, costs)
    assert estimate.exposed > 0.01 * estimate.step  # one layer more would not hide
    assert not any(hidden_plan([True] * 6, _step_costs([1e12] * 6, [1.0] * 6, [1.0] * 6)).offload)
    assert not any(plan.recompute) and "estimated" in plan.notes[0]


def _three_layer_forward(saves_outputs: bool = False):
    """A forward graph of three mm + relu layers that returns for backward each layer's product
    (read only in its layer), or with `saves_outputs` each layer's output (read by the next):
    (the graph, its mm and relu nodes in order, each of those nodes' layer)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def three_layers(x, w):
        m0 = torch.mm(x, w)
        a0 = torch.relu(m0)
        m1 = torch.mm(a0, w)
        a1 = torch.relu(m1)
        m2 = torch.mm(a1, w)
        a2 = torch.relu(m2)
        return (a2.sum(), a0, a1, a2) if saves_outputs else (a2.sum(), m0, m1, m2)

    gm = make_fx(three_layers, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
    computed = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.ops.aten.mm.default,
                                                                                    torch.ops.aten.relu.default)]
    return gm, computed, {node: i // 2 for i, node in enumerate(computed)}  # mm, relu per layer


def test_compile_rewrite_releases_after_the_planned_layers_output():
    """With auto mode's release points, a group is let go right after the output of the layer the plan
    names, that output its anchor (a data edge), and a group planned for the forward's end just before
    the graph's output."""
    from offload.activation.compiled import ops
    from offload.activation.compiled.rewrite import RewriteOptions, choose_groups, rewrite_forward

    gm, computed, layers = _three_layer_forward()
    options = RewriteOptions(runtime=0, resident_groups=2, min_tensor_bytes=0, device=torch.device("cpu"),
                             release_after={0: 1, 1: None})
    groups = choose_groups(gm, 1, layers, [True, True, False], options)
    hosts = rewrite_forward(gm, 1, groups, layers, options)
    nodes = list(gm.graph.nodes)
    releases = [n for n in nodes if n.target is ops.group_release]
    assert [r.args[0] for r in releases] == hosts
    relu_1 = computed[3]
    assert releases[0].args[2] is relu_1 and nodes.index(releases[0]) == nodes.index(relu_1) + 1
    assert releases[1].args[2] is None and nodes.index(releases[1]) == len(nodes) - 2  # just before the output


def test_compile_rewrite_window_release_at_the_staying_layers_end():
    """With the resident window (2) and the last group staying on the device (Note [window tail]),
    the group before it is let go where the staying layer ends (its output the anchor), not at the
    forward's end, and the staying layer's tensor is still saved as it is."""
    from offload.activation.compiled import ops
    from offload.activation.compiled.rewrite import RewriteOptions, choose_groups, rewrite_forward, window_tail

    gm, computed, layers = _three_layer_forward()
    options = RewriteOptions(runtime=0, resident_groups=2, min_tensor_bytes=0, device=torch.device("cpu"))
    groups, staying = window_tail(choose_groups(gm, 1, layers, [True, True, False], options), options)
    assert [g.layer for g in groups] == [0] and [g.layer for g in staying] == [1]
    hosts = rewrite_forward(gm, 1, groups, layers, options, staying)
    nodes = list(gm.graph.nodes)
    [release] = [n for n in nodes if n.target is ops.group_release]
    relu_1 = computed[3]
    assert release.args[0] is hosts[0] and release.args[2] is relu_1
    assert nodes.index(release) == nodes.index(relu_1) + 1
    assert computed[2] in gm.graph.output_node().args[0]  # layer 1's saved tensor stays a saved output


def test_compile_saved_layer_output_goes_with_the_layer_that_reads_it():
    """Note [group by reader]: a layer's output saved for the next layer's backward is in the next
    layer's group (in the one that made it, it would bring that group back a layer early); the
    last layer's output, read by no later layer, stays in its own, and a tensor read by a layer
    that is not offloaded is not copied."""
    from offload.activation.compiled.rewrite import RewriteOptions, choose_groups

    gm, computed, layers = _three_layer_forward(saves_outputs=True)
    relu_0, relu_1, relu_2 = computed[1], computed[3], computed[5]
    options = RewriteOptions(runtime=0, resident_groups=2, min_tensor_bytes=0, device=torch.device("cpu"))
    groups = choose_groups(gm, 1, layers, [True, True, True], options)
    assert {g.layer: list(g.saved) for g in groups} == {1: [relu_0], 2: [relu_1, relu_2]}
    groups = choose_groups(gm, 1, layers, [True, True, False], options)
    assert {g.layer: list(g.saved) for g in groups} == {1: [relu_0]}


def test_compile_group_in_without_its_copy_back_says_why():
    """A backward graph that asks for a group nobody fetched (run again for one forward, or traced
    again by compiled autograd) gets an error that says so, not a bare KeyError."""
    from offload.activation.compiled.transport import GroupTransport

    transport = GroupTransport(None, timing=False)
    with pytest.raises(RuntimeError, match=r"copy back was never issued \(serial 7\): each group comes back once"):
        transport.group_in(7, [])


def test_compile_node_flops_counts_matmuls_only():
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(lambda a, b: torch.relu(torch.mm(a, b)), tracing_mode="fake")(torch.randn(4, 8),
                                                                                  torch.randn(8, 16)).graph
    flops = {n.target.overloadpacket: node_flops(n) for n in graph.nodes if n.op == "call_function"}
    assert flops == {torch.ops.aten.mm: 2 * 4 * 8 * 16, torch.ops.aten.relu: 0}


@pytest.mark.slow
@cpu_model
def test_compile_auto_on_the_host_offloads_nothing_and_says_why(blocks_case):
    """On the host a copy is synchronous, so auto mode's plan for a compiled model hides none: the
    graph is still served (its plan reported), nothing moves, the gradients are bitwise."""
    base, x, expected = blocks_case
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    handle = offload.enable_activation_offload(model, mode="auto", min_tensor_bytes=0)
    model.compile()
    breaks = _graph_breaks()
    with torch._inductor.config.patch(force_disable_caches=True):  # the notes come from the partition itself
        _blocks_step(model, x)
    assert _graph_breaks() == breaks
    stats = handle.stats()
    assert stats["compiled_steps"] == 1 and stats["d2h_bytes"] == 0
    assert not any(stats["compiled_plan"]["offload"]) and "synchronous" in stats["compiled_plan"]["notes"][0]
    _assert_same_grads(expected, model)
    handle.disable()


@pytest.mark.cuda
@pytest.mark.slow
def test_compile_auto_on_the_device_plans_from_the_graph_and_stays_bitwise(inductor_deterministic):
    """On the GPU, auto mode's plan for a model compiled whole comes from the graphs' estimated compute
    and the measured bus (its note says what it estimated), offloads only a prefix of the layers
    (earliest first), and the gradients are those of the model compiled without offload."""
    base, x, _, expected = _device_blocks_compiled_without_offload()
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    handle = offload.enable_activation_offload(model, "auto", min_tensor_bytes=1 << 20)
    model.compile()
    with torch._inductor.config.patch(force_disable_caches=True):  # the notes come from the partition itself
        _, held, grads = _peak_and_grads(model, x)
    for (name, _), a, b in zip(model.named_parameters(), expected, grads):
        assert torch.equal(a, b), f"gradient of {name}"
    plan = handle.stats()["compiled_plan"]
    chosen = [i for i, on in enumerate(plan["offload"]) if on]
    assert chosen == list(range(len(chosen))) and not plan["offload"][-1]  # a prefix; keep_last stays
    assert plan["notes"] and plan["notes"][0].startswith("estimated:")
    assert held == 0
    handle.disable()


def test_compile_views_of_one_buffer_are_copied_once():
    """Note [views of one buffer]: q, k and v saved as three views of the fused projection's output
    make one member of the group, the buffer, and each comes back through the same view ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from offload.activation.compiled.rewrite import RewriteOptions, choose_groups

    def layer(x, w):
        q, k, v = torch.mm(x, w).view(8, 3, 4).permute(1, 0, 2)
        return (q * k * v).sum(), q, k, v

    gm = make_fx(layer, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 12))
    layers = {n: 0 for n in gm.graph.nodes if n.op == "call_function"}
    options = RewriteOptions(runtime=0, resident_groups=2, min_tensor_bytes=0, device=torch.device("cpu"))
    (group,) = choose_groups(gm, 1, layers, [True], options)
    assert [n.target for n in group.nodes] == [torch.ops.aten.mm.default]
    assert group.nbytes == 8 * 12 * 4  # the buffer once, not three spans of nearly all of it
    assert [r.member for r in group.saved.values()] == [0, 0, 0]
    import operator

    # make_fx records `q, k, v = t` as `unbind` and a `getitem` each (dynamo as a `select` each)
    assert [[n.target for n in r.chain] for r in group.saved.values()] == [
        [torch.ops.aten.view.default, torch.ops.aten.permute.default, torch.ops.aten.unbind.int, operator.getitem]] * 3


@pytest.mark.slow
@cpu_model
def test_compile_attention_views_bitwise_and_copied_once():
    """A model whose layers save three views of one buffer (q, k, v) compiled whole with offload:
    the gradients are bitwise those of the model compiled without offload, and each layer's
    buffer crosses the bus once (the bytes equal the groups' own byte counts: no view copied apart)."""
    torch.manual_seed(0)
    base = AttentionBlocks()
    x = torch.randn(2, 16, 32)
    reference = copy.deepcopy(base)
    torch._dynamo.reset()
    reference.compile()
    reference(x).backward()
    expected = _grads(reference)
    model = copy.deepcopy(base)
    torch._dynamo.reset()
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0)
    model.compile()
    breaks = _graph_breaks()
    model(x).backward()
    assert _graph_breaks() == breaks
    stats = handle.stats()
    qkv_bytes = 2 * 16 * 3 * 32 * 4
    # One offloaded layer (keep_last=1 and the window's tail), its q/k/v buffer once beside its
    # other saved tensors: three views copied apart would move about three times that buffer.
    assert stats["groups_offloaded"] == 1 and stats["d2h_bytes"] < 3 * qkv_bytes
    _assert_same_grads(expected, model)
    handle.disable()


def test_compile_first_fetch_point_is_where_the_planned_layers_backward_starts():
    """The first copy back stands before the first node of the planned layer's backward (one the
    gradients reach), if that comes before the group's arrival; else at backward's first node."""
    from offload.activation.compiled.rewrite import _first_fetch_point, _layer_starts

    graph = fx.Graph()
    tangent = graph.placeholder("tangents_1")
    weight_t = graph.call_function(torch.ops.aten.t.default, (graph.placeholder("w"),))  # reached by no gradient
    layer2 = graph.call_function(torch.ops.aten.mul.Tensor, (tangent, 2.0))
    layer1 = graph.call_function(torch.ops.aten.mul.Tensor, (layer2, 3.0))
    layer0 = graph.call_function(torch.ops.aten.mm.default, (layer1, weight_t))
    graph.output((layer0,))
    layers = {weight_t: 2, layer2: 2, layer1: 1, layer0: 0}
    starts, order = _layer_starts(graph, layers), {n: i for i, n in enumerate(graph.nodes)}

    def point(layer, arrival):
        return _first_fetch_point(graph, starts, order, layer, arrival)

    assert point(2, arrival=layer0) is layer2  # not the transpose, placed earlier
    assert point(1, arrival=layer0) is layer1
    assert point(1, arrival=layer2) is weight_t  # after its arrival: backward's start
    assert point(None, arrival=layer0) is weight_t
