"""Bad input, fuzzed: every public function and constructor of `offload.__all__` either
works or raises TypeError / ValueError / RuntimeError (torch.OutOfMemoryError where the
function documents it) at the call, with a message that starts with the public name
(`offload.pack_buckets: ...`) and names an argument it was given a bad value for.

Arguments are drawn from valid values and from junk: None, bools, negative and zero
sizes, floats (nan, inf), strings (numbers, group and device names such as 'world', '0',
'cuda', 'meta'), meta, sparse, non-contiguous and broadcast tensors, nested containers,
modules, dtypes (int8 too) and devices. The budget of examples is fixed and derandomized, so
CI runs the same examples every time.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import offload
from offload.core import _device
from _workers import gloo_world  # noqa: F401 (fixture)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

EXAMPLES = 100
# No shrinking: a failing example is reported as drawn, as it came.
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])

# A pool with a limit: no example can pin more host memory than this.
POOL_LIMIT = 8 << 20


def _pool():
    return offload.HostPool(limit_bytes=POOL_LIMIT, slab_bytes=1 << 20)


# ------------------------------------------------------------------ values

def _tensor():
    return torch.arange(12, dtype=torch.float32)


def _compute_tensor():
    """A valid source of a copy to host: on the device offload copies from (the accelerator
    where there is one)."""
    return _tensor().to(_device.current_device())


JUNK = {
    "None": lambda: None,
    "True": lambda: True,
    "False": lambda: False,
    "-2**40": lambda: -(2 ** 40),
    "-5": lambda: -5,
    "-1": lambda: -1,
    "0": lambda: 0,
    "1": lambda: 1,
    "3": lambda: 3,
    "1.5": lambda: 1.5,
    "-0.5": lambda: -0.5,
    "nan": lambda: math.nan,
    "inf": lambda: math.inf,
    "''": lambda: "",
    "'x'": lambda: "x",
    "'-1'": lambda: "-1",
    "'meta'": lambda: "meta",
    "'cuda'": lambda: "cuda",
    "'world'": lambda: "world",
    "'0'": lambda: "0",
    "object": lambda: object(),
    "dtype": lambda: torch.float16,
    "int8 dtype": lambda: torch.int8,
    "meta device": lambda: torch.device("meta"),
    "tensor": _tensor,
    "0-dim tensor": lambda: torch.tensor(3.0),
    "empty tensor": lambda: torch.empty(0, 4),
    "int tensor": lambda: torch.arange(5, dtype=torch.int64),
    "meta tensor": lambda: torch.empty(8, device="meta"),
    "sparse tensor": lambda: torch.eye(3).to_sparse(),
    "non-contiguous tensor": lambda: torch.arange(24.0).view(4, 6).t(),
    "broadcast tensor": lambda: torch.arange(3.0).expand(4, 3),
    "bf16 tensor": lambda: torch.ones(6, dtype=torch.bfloat16),
    "[]": lambda: [],
    "{}": lambda: {},
    "[tensor]": lambda: [_tensor()],
    "[tensor, 3]": lambda: [_tensor(), 3],
    "[[tensor]]": lambda: [[_tensor()]],
    "[None]": lambda: [None],
    "[1, 2, 3]": lambda: [1, 2, 3],
    "[meta tensor]": lambda: [torch.empty(4, device="meta")],
    "[sparse tensor]": lambda: [torch.eye(2).to_sparse()],
    "(tensor,)": lambda: (_tensor(),),
    "{'a': tensor}": lambda: {"a": _tensor()},
    "{'a': {'b': tensor}}": lambda: {"a": {"b": _tensor()}},
    "{'a': None}": lambda: {"a": None},
    "{1: tensor}": lambda: {1: _tensor()},
    "[('a', tensor)]": lambda: [("a", _tensor())],
    "[('a', 'b')]": lambda: [("a", "b")],
    "module": lambda: torch.nn.Linear(3, 3),
}


def _arg(valid: dict):
    """(label, value, junk?) for one argument: one of its `valid` values or junk."""
    good = st.sampled_from(sorted(valid)).map(lambda k: (k, valid[k](), False))
    # Junk that shares a label with a valid value ('[tensor]' of host tensors) is left out: on an
    # accelerator the two differ, and the junk one is not a valid argument there.
    bad = st.sampled_from(sorted(set(JUNK) - set(valid))).map(lambda k: (k, JUNK[k](), True))
    return st.one_of(good, good, bad)


def _args(**params):
    """A strategy of {name: (label, value, junk?)}: each argument valid or junk."""
    return st.fixed_dictionaries({name: _arg(valid) for name, valid in params.items()})


# Where a message names an element or a part of an argument rather than the argument itself.
ALIASES = {
    "tensors": ("tensor", "item", "out"),
    "state_dict": ("state_dict", "state dict", "tensor"),
    "entries": ("entries", "metadata", "tensor", "entry"),
    "out": ("out", "destination", "tensor"),
    "data": ("bucket", "data"),
    "size": ("size", "dimension"),
    "module": ("module", "model", "parameter"),
    "model": ("model", "module", "layer"),
    "device": ("device", "accelerator"),
    "keep_dtype": ("keep_dtype",),
}


def _check(fn: str, call, drawn: dict, oom: bool = False):
    """Run `call`; an error must be one of the allowed types, start with `fn` and name a
    junk argument. Returns the call's result, or None where it raised."""
    junk = {name for name, (_, _, is_junk) in drawn.items() if is_junk}
    shown = {name: label for name, (label, _, _) in drawn.items()}
    try:
        return call()
    except torch.OutOfMemoryError as e:
        assert oom, f"{fn} raised OutOfMemoryError, which it does not document, for {shown}: {e}"
        assert str(e).startswith("offload."), f"{fn}: {e}"
        return None
    except (TypeError, ValueError, RuntimeError) as e:
        message = str(e)
        assert message.startswith(fn), f"{fn} raised {type(e).__name__} without its name for {shown}: {message}"
        assert junk, f"{fn} refused valid arguments {shown}: {message}"
        names = set(junk).union(*(ALIASES.get(name, ()) for name in junk))
        assert any(name in message for name in names), (
            f"{fn}'s message names none of the bad arguments {sorted(junk)} for {shown}: {message}")
        return None


def _values(drawn: dict) -> dict:
    return {name: value for name, (_, value, _) in drawn.items()}


# ------------------------------------------------------------------ core

TENSORS = {"[tensor]": lambda: [_tensor()], "[]": lambda: [], "[int tensor, bf16]": lambda: [
    torch.arange(5), torch.ones(3, dtype=torch.bfloat16)]}
SIZES = {"1024": lambda: 1024, "1": lambda: 1, "65536": lambda: 65536}
FLAGS = {"True": lambda: True, "False": lambda: False}
POOLS = {"None": lambda: None, "pool": _pool}


@FUZZ
@given(_args(tensors={"[tensor]": lambda: [_compute_tensor()], "[]": lambda: [],
                     "[int tensor, bf16]": lambda: [t.to(_device.current_device()) for t in TENSORS[
                         "[int tensor, bf16]"]()]}, pool=POOLS, out={"None": lambda: None},
             stream={"None": lambda: None}, require_pinned=FLAGS, small_bytes=SIZES, chunk_bytes=SIZES,
             group_bytes=SIZES, defer=FLAGS, timing=FLAGS, same_sources=FLAGS))
def test_fuzz_copy_to_host(drawn):
    handle = _check("offload.copy_to_host", lambda: offload.copy_to_host(**_values(drawn)), drawn, oom=True)
    if handle is not None:
        handle.wait()


def _pinned(tensors):
    """Host sources a copy to the device takes with require_pinned=True: page-locked where the
    accelerator has page-locked memory (an unpinned source there is rightly refused)."""
    return [t.pin_memory() if _device.pinned_memory_supported() else t for t in tensors]


HOST_SOURCES = {k: (lambda make=make: _pinned(make())) for k, make in TENSORS.items()}


@FUZZ
@given(_args(tensors=HOST_SOURCES, pool=POOLS,
             device={"None": lambda: None, "the compute device": lambda: str(_device.current_device())},
             out={"None": lambda: None}, stream={"None": lambda: None},
             require_pinned=FLAGS, small_bytes=SIZES, chunk_bytes=SIZES, timing=FLAGS))
def test_fuzz_copy_to_device(drawn):
    values = _values(drawn)
    tensors = values.pop("tensors")
    handle = _check("offload.copy_to_device", lambda: offload.copy_to_device(tensors, **values), drawn, oom=True)
    if handle is not None:
        handle.wait()


def _handle():
    return offload.copy_to_host([_compute_tensor(), _compute_tensor()], pool=_pool())


HANDLE_METHODS = {
    "wait_tensor": dict(index={"0": lambda: 0, "1": lambda: 1, "-1": lambda: -1}, stream={"None": lambda: None}),
    "wait_stream": dict(stream={"None": lambda: None}),
    "release_sources": dict(stream={"None": lambda: None}),
}


@pytest.mark.parametrize("method", sorted(HANDLE_METHODS))
def test_fuzz_copy_handle_methods(method):
    handle = _handle()

    @FUZZ
    @given(_args(**HANDLE_METHODS[method]))
    def run(drawn):
        _check(f"offload.CopyHandle.{method}", lambda: getattr(handle, method)(**_values(drawn)), drawn)

    run()
    handle.wait()


@FUZZ
@given(_args(limit_bytes={"None": lambda: None, "'8MiB'": lambda: "8MiB", "4096": lambda: 4096},
             slab_bytes={"None": lambda: None, "65536": lambda: 65536},
             touch_threads={"1": lambda: 1, "4": lambda: 4}))
def test_fuzz_host_pool(drawn):
    values = _values(drawn)
    if values["limit_bytes"] is None:  # no example may grow a pool without a limit
        values["limit_bytes"] = POOL_LIMIT
    _check("offload.HostPool", lambda: offload.HostPool(**values), drawn)


NBYTES = {"0": lambda: 0, "16": lambda: 16, "4096": lambda: 4096}
METHODS = {
    "acquire": dict(nbytes=NBYTES),
    "empty": dict(size={"(2, 3)": lambda: (2, 3), "4": lambda: 4, "[]": lambda: []},
                  dtype={"float32": lambda: torch.float32, "bfloat16": lambda: torch.bfloat16}),
    "block_bytes": dict(nbytes=NBYTES),
    "record_stream": dict(tensor={"tensor": _tensor}, stream={"None": lambda: None}),
    "owns": dict(tensor={"tensor": _tensor}),
    "reserve": dict(nbytes=dict(NBYTES, **{"'4KiB'": lambda: "4KiB"})),
    "begin_reserve": dict(nbytes=NBYTES, largest_block=NBYTES),
    "grow_reserved": dict(nbytes={"0": lambda: 0}),
    "cancel_reserve": dict(nbytes={"0": lambda: 0}),
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_fuzz_host_pool_methods(method):
    pool = _pool()

    @FUZZ
    @given(_args(**METHODS[method]))
    def run(drawn):
        result = _check(f"offload.HostPool.{method}", lambda: getattr(pool, method)(**_values(drawn)), drawn,
                        oom=method in ("acquire", "empty", "reserve", "begin_reserve"))
        if method == "begin_reserve" and result:
            pool.cancel_reserve(result)

    run()


@FUZZ
@given(_args(limit_bytes={"'8MiB'": lambda: "8MiB", "4096": lambda: 4096}))
def test_fuzz_host_pool_limit_setter(drawn):
    pool = _pool()
    _check("offload.HostPool.limit_bytes", lambda: setattr(pool, "limit_bytes", _values(drawn)["limit_bytes"]),
           drawn)


# ------------------------------------------------------------------ buckets

NAMED = {"{'a': tensor}": lambda: {"a": _tensor()}, "[('a', tensor)]": lambda: [("a", _tensor())],
         "{'a', 'b' int}": lambda: {"a": _tensor(), "b": torch.arange(3)}}
BUCKET_BYTES = {"None": lambda: None, "1024": lambda: 1024, "256": lambda: 256}
CASTS = {"None": lambda: None, "bfloat16": lambda: torch.bfloat16}
KEEP = {"()": lambda: (), "'a*'": lambda: "a*"}
ALIGNMENTS = {"256": lambda: 256, "16": lambda: 16}


@FUZZ
@given(_args(tensors=NAMED, bucket_bytes=BUCKET_BYTES, dtype=CASTS, keep_dtype=KEEP, alignment=ALIGNMENTS))
def test_fuzz_pack_buckets(drawn):
    """Checked at the call: a call that returns an iterator over a container packs it."""
    fn = "offload.pack_buckets"
    packed = _check(fn, lambda: offload.pack_buckets(**_values(drawn)), drawn)
    if packed is not None:
        buckets = list(packed)  # no error may surface only here
        assert all(isinstance(b, offload.PackedBucket) for b in buckets)


@FUZZ
@given(_args(tensors=NAMED, bucket_bytes=BUCKET_BYTES, dtype=CASTS, keep_dtype=KEEP, alignment=ALIGNMENTS,
             device={"None": lambda: None, "'cpu'": lambda: "cpu"}))
def test_fuzz_plan_buckets(drawn):
    _check("offload.plan_buckets", lambda: offload.plan_buckets(**_values(drawn)), drawn)


@FUZZ
@given(_args(device={"None": lambda: None, "'cpu'": lambda: "cpu", "cpu device": lambda: torch.device("cpu")}))
def test_fuzz_default_bucket_bytes(drawn):
    _check("offload.default_bucket_bytes", lambda: offload.default_bucket_bytes(**_values(drawn)), drawn)


def _bucket():
    (packed,) = offload.pack_buckets({"a": torch.arange(6.0), "b": torch.arange(4)}, 1024)
    return packed


@FUZZ
@given(_args(data={"bucket": lambda: _bucket().data},
             entries={"entries": lambda: _bucket().entries},
             out={"None": lambda: None, "dict": lambda: {"a": torch.empty(6), "b": torch.empty(4, dtype=torch.int64)}}))
def test_fuzz_unpack_bucket(drawn):
    _check("offload.unpack_bucket", lambda: offload.unpack_bucket(**_values(drawn)), drawn)


def _plan_dict():
    return offload.plan_buckets({"a": torch.arange(6.0), "b": torch.arange(300.0)}, 1024).to_dict()


def _entry_dict():
    return _bucket().entries[0].to_dict()


@FUZZ
@given(_args(data={"plan dict": _plan_dict,
                   "no entries": lambda: dict(_plan_dict(), entries=[], bucket_sizes=[])}))
def test_fuzz_bucket_plan_from_dict(drawn):
    plan = _check("offload.BucketPlan.from_dict", lambda: offload.BucketPlan.from_dict(**_values(drawn)), drawn)
    if plan is not None:
        plan.validate()


@FUZZ
@given(_args(data={"entry dict": _entry_dict, "required keys only": lambda: {
    k: v for k, v in _entry_dict().items() if k in ("name", "dtype", "shape", "bucket", "offset", "nbytes")}}))
def test_fuzz_bucket_entry_from_dict(drawn):
    _check("offload.BucketEntry.from_dict", lambda: offload.BucketEntry.from_dict(**_values(drawn)), drawn)


def _plan_with_odd_value(key, value, entry_key=None):
    data = _plan_dict()
    if entry_key is None:
        data[key] = value
    else:
        data["entries"][0][entry_key] = value
    return data


# Plain data with a key missing, unknown or of the wrong type: each refused by from_dict, naming it.
FROM_DICT = [
    pytest.param(lambda: offload.BucketPlan.from_dict({}), ValueError,
                 r"offload.BucketPlan.from_dict: data lacks key\(s\) 'entries', 'bucket_sizes', 'bucket_bytes', "
                 r"'alignment'; expected keys entries, bucket_sizes, bucket_bytes, alignment", id="plan-empty"),
    pytest.param(lambda: offload.BucketPlan.from_dict(dict(_plan_dict(), extra=1)), ValueError,
                 r"offload.BucketPlan.from_dict: data has unknown key\(s\) 'extra'; expected keys entries",
                 id="plan-unknown-key"),
    pytest.param(lambda: offload.BucketPlan.from_dict([("entries", [])]), TypeError,
                 r"offload.BucketPlan.from_dict: data must be a dict \(as to_dict\(\) makes\), got list",
                 id="plan-not-a-dict"),
    pytest.param(lambda: offload.BucketPlan.from_dict(_plan_with_odd_value("entries", 3)), TypeError,
                 r"offload.BucketPlan.from_dict: data\['entries'\] must be a list, got int", id="plan-entries-int"),
    pytest.param(lambda: offload.BucketPlan.from_dict(_plan_with_odd_value("bucket_bytes", "1KiB")), TypeError,
                 r"offload.BucketPlan.from_dict: data\['bucket_bytes'\] must be an int, got str",
                 id="plan-bucket_bytes-str"),
    pytest.param(lambda: offload.BucketPlan.from_dict(_plan_with_odd_value("entries", None, "shape")), TypeError,
                 r"offload.BucketPlan.from_dict: data\['entries'\]\[0\]\['shape'\] must be a list of ints, "
                 r"got NoneType", id="plan-entry-shape-none"),
    pytest.param(lambda: offload.BucketPlan.from_dict(_plan_with_odd_value("entries", {}, "name")), TypeError,
                 r"offload.BucketPlan.from_dict: data\['entries'\]\[0\]\['name'\] must be a str, got dict",
                 id="plan-entry-name-dict"),
    pytest.param(lambda: offload.BucketEntry.from_dict({}), ValueError,
                 r"offload.BucketEntry.from_dict: data lacks key\(s\) 'name', 'dtype', 'shape', 'bucket', 'offset', "
                 r"'nbytes'; expected keys name, dtype, shape, bucket, offset, nbytes \(and optionally chunk, "
                 r"num_chunks, start, numel, source_dtype\)", id="entry-empty"),
    pytest.param(lambda: offload.BucketEntry.from_dict(dict(_entry_dict(), device="cpu")), ValueError,
                 r"offload.BucketEntry.from_dict: data has unknown key\(s\) 'device'", id="entry-unknown-key"),
    pytest.param(lambda: offload.BucketEntry.from_dict(dict(_entry_dict(), shape=["6"])), TypeError,
                 r"offload.BucketEntry.from_dict: data\['shape'\]\[0\] must be an int, got str '6'",
                 id="entry-shape-str"),
    pytest.param(lambda: offload.BucketEntry.from_dict(dict(_entry_dict(), offset=True)), TypeError,
                 r"offload.BucketEntry.from_dict: data\['offset'\] must be an int, got bool", id="entry-offset-bool"),
    pytest.param(lambda: offload.BucketEntry.from_dict("a"), TypeError,
                 r"offload.BucketEntry.from_dict: data must be a dict", id="entry-not-a-dict"),
]


@pytest.mark.parametrize("call, error, message", FROM_DICT)
def test_fuzz_from_dict_names_the_key(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_fuzz_from_dict_round_trips():
    """What to_dict() makes comes back equal, optional keys left out or not."""
    plan = offload.plan_buckets({"a": torch.arange(6.0), "b": torch.arange(300.0)}, 1024)
    assert offload.BucketPlan.from_dict(plan.to_dict()).validate() == plan
    entry = plan.entries[0]
    required = {k: v for k, v in entry.to_dict().items() if k in ("name", "dtype", "shape", "bucket", "offset",
                                                                   "nbytes")}
    assert offload.BucketEntry.from_dict(entry.to_dict()) == entry
    assert offload.BucketEntry.from_dict(required).shape == entry.shape


# ------------------------------------------------------------------ staging

@FUZZ
@given(_args(ring_size={"1": lambda: 1, "2": lambda: 2}, pool=POOLS,
             limit_bytes={"None": lambda: None, "'1MiB'": lambda: "1MiB", "64": lambda: 64},
             when_busy={"'wait'": lambda: "wait", "'raise'": lambda: "raise"},
             busy_timeout_s={"5.0": lambda: 5.0},
             forward_buffers={"None": lambda: None, "module": lambda: torch.nn.BatchNorm1d(3)}))
def test_fuzz_async_stager(drawn):
    stager = _check("offload.AsyncStager", lambda: offload.AsyncStager(**_values(drawn)), drawn)
    if stager is not None:
        stager.close()


@FUZZ
@given(_args(state_dict={"{'a': tensor}": lambda: {"a": _tensor()},
                         "nested": lambda: {"m": {"w": _tensor(), "n": 3}, "s": "x"}}))
def test_fuzz_async_stager_stage(drawn):
    with offload.AsyncStager(ring_size=1, busy_timeout_s=5.0) as stager:
        staged = _check("offload.AsyncStager.stage", lambda: stager.stage(**_values(drawn)), drawn)
        if staged is not None:
            staged = staged.result() if hasattr(staged, "result") else staged
            assert isinstance(staged, dict)
            del staged


@FUZZ
@given(_args(optimizer={"optimizer": lambda: torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)}))
def test_fuzz_async_stager_protect(drawn):
    with offload.AsyncStager(ring_size=1, busy_timeout_s=5.0) as stager:
        hook = _check("offload.AsyncStager.protect", lambda: stager.protect(**_values(drawn)), drawn)
        if hook is not None:
            hook.remove()


# ------------------------------------------------------------------ activation offload

class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x))


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block(), _Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _model():
    return _Model()


MODES = {"'async'": lambda: "async", "'sync'": lambda: "sync"}
COUNTS = {"0": lambda: 0, "1": lambda: 1, "2": lambda: 2}
GROUPS = {"1": lambda: 1, "2": lambda: 2}


@FUZZ
@given(_args(model={"model": _model}, mode=MODES, layers={"None": lambda: None},
             min_tensor_bytes={"0": lambda: 0, "1024": lambda: 1024},
             min_group_bytes={"None": lambda: None, "0": lambda: 0, "4096": lambda: 4096}, resident_groups=GROUPS,
             memory_budget_bytes={"None": lambda: None},
             keep_first=COUNTS, keep_last=COUNTS, pool=POOLS, timing=FLAGS, nvtx=FLAGS,
             verbose={"False": lambda: False}))
def test_fuzz_enable_activation_offload(drawn):
    values = _values(drawn)
    model = values.pop("model")
    handle = _check("offload.enable_activation_offload",
                    lambda: offload.enable_activation_offload(model, **values), drawn)
    if handle is not None:
        handle.disable()


@FUZZ
@given(_args(model={"model": _model}, memory_budget_bytes={"None": lambda: None, "'1GiB'": lambda: "1GiB",
                                                           "65536": lambda: 65536},
             keep_last=COUNTS, verbose={"False": lambda: False}, process_group={"None": lambda: None}))
def test_fuzz_enable_activation_offload_auto(drawn):
    """mode='auto', the one mode that takes a memory budget."""
    values = _values(drawn)
    model = values.pop("model")
    handle = _check("offload.enable_activation_offload",
                    lambda: offload.enable_activation_offload(model, "auto", **values), drawn)
    if handle is not None:
        handle.disable()


@FUZZ
@given(_args(mode=MODES, min_tensor_bytes={"0": lambda: 0, "1024": lambda: 1024},
             resident_groups=GROUPS, pool=POOLS,
             params={"()": lambda: (), "parameters": lambda: _model().parameters(), "[tensor]": lambda: [_tensor()]},
             timing=FLAGS, nvtx=FLAGS, engine={"None": lambda: None}))
def test_fuzz_activation_offload(drawn):
    """Checked at the call: a context the call returns must also enter."""
    fn = "offload.activation_offload"
    context = _check(fn, lambda: offload.activation_offload(**_values(drawn)), drawn)
    if context is not None:
        with context:
            pass


@FUZZ
@given(_args(name={"None": lambda: None, "'block'": lambda: "block"}, offload=FLAGS))
def test_fuzz_activation_offload_boundary(drawn):
    with offload.activation_offload(min_tensor_bytes=0) as context:
        _check("offload.activation_offload.boundary", lambda: context.boundary(**_values(drawn)), drawn)


# ------------------------------------------------------------------ parameter offload, weight sync

@FUZZ
@given(_args(module={"model": _model}, grads=FLAGS, optimizer={"None": lambda: None}, pool=POOLS,
             chunk_bytes={"4096": lambda: 4096, "1024": lambda: 1024}))
def test_fuzz_offload_params(drawn):
    values = _values(drawn)
    module = values.pop("module")
    result = _check("offload.offload_params", lambda: offload.offload_params(module, **values), drawn, oom=True)
    if result is not None:
        offload.reload_params(module)


@FUZZ
@given(_args(module={"model": _model}, chunk_bytes={"4096": lambda: 4096}))
def test_fuzz_reload_params(drawn):
    values = _values(drawn)
    module = values.pop("module")
    if isinstance(module, torch.nn.Module) and not drawn["module"][2]:
        offload.offload_params(module)
    _check("offload.reload_params", lambda: offload.reload_params(module, **values), drawn, oom=True)


@FUZZ
@given(_args(module={"model": _model}))
def test_fuzz_params_offloaded(drawn):
    _check("offload.params_offloaded", lambda: offload.params_offloaded(**_values(drawn)), drawn)


def _no_process_group():
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@pytest.mark.skipif(not _no_process_group(), reason="needs a process without a process group")
@FUZZ
@given(_args(group={"None": lambda: None}, src={"0": lambda: 0}, ranks={"None": lambda: None},
             backend={"None": lambda: None}, bucket_bytes=BUCKET_BYTES, dtype=CASTS, keep_dtype=KEEP,
             alignment=ALIGNMENTS, mode={"'device'": lambda: "device", "'host_cache'": lambda: "host_cache"},
             keep_versions={"2": lambda: 2}, pool=POOLS, reserve_sms={"32": lambda: 32},
             transport={"'nccl'": lambda: "nccl"}, channel={"None": lambda: None},
             timeout_s={"None": lambda: None, "5.0": lambda: 5.0}))
def test_fuzz_weight_sender(drawn):
    _check_needs_process_group("offload.WeightSender", offload.WeightSender, drawn)


@pytest.mark.skipif(not _no_process_group(), reason="needs a process without a process group")
@FUZZ
@given(_args(group={"None": lambda: None}, src={"0": lambda: 0}, ranks={"None": lambda: None},
             backend={"None": lambda: None}, reserve_sms={"32": lambda: 32},
             transport={"'nccl'": lambda: "nccl"}, channel={"None": lambda: None},
             timeout_s={"None": lambda: None, "5.0": lambda: 5.0}))
def test_fuzz_weight_receiver(drawn):
    _check_needs_process_group("offload.WeightReceiver", offload.WeightReceiver, drawn)


def _check_needs_process_group(fn, cls, drawn):
    """Without a process group no sender or receiver can be made: every call raises, naming a
    bad argument (those checked before torch.distributed is asked: all but the ones a group
    decides, such as whether src is in it), else saying that torch.distributed is not initialized."""
    junk = {name for name, (_, _, is_junk) in drawn.items() if is_junk}
    with pytest.raises((TypeError, ValueError, RuntimeError)) as info:
        cls(**_values(drawn))
    message = str(info.value)
    assert message.startswith(fn), message
    if "torch.distributed is not initialized" not in message:
        assert junk, f"{fn} refused valid arguments: {message}"
        assert any(name in message for name in junk), f"{fn}'s message names none of {sorted(junk)}: {message}"


def _world_group():
    import torch.distributed as dist

    return dist.group.WORLD


SYNC_GROUP = {"None": lambda: None, "the world group": _world_group}


@FUZZ
@given(_args(group=SYNC_GROUP, src={"0": lambda: 0}, ranks={"None": lambda: None},
             bucket_bytes=BUCKET_BYTES, dtype=CASTS, keep_dtype=KEEP,
             alignment=ALIGNMENTS, mode={"'device'": lambda: "device", "'host_cache'": lambda: "host_cache"},
             keep_versions={"2": lambda: 2}, pool=POOLS, reserve_sms={"32": lambda: 32},
             transport={"'nccl'": lambda: "nccl"}, channel={"None": lambda: None},
             timeout_s={"None": lambda: None, "5.0": lambda: 5.0}))
def test_fuzz_weight_sender_in_a_group(gloo_world, drawn):  # noqa: F811 (fixture)
    """In a one-rank gloo world: a sender is made from valid arguments, and every bad one is named
    at construction (the group's too: whether src is one of its ranks)."""
    _check("offload.WeightSender", lambda: offload.WeightSender(**_values(drawn)), drawn)


@FUZZ
@given(_args(group=SYNC_GROUP, src={"0": lambda: 0}, ranks={"None": lambda: None},
             reserve_sms={"32": lambda: 32}, transport={"'nccl'": lambda: "nccl"},
             channel={"None": lambda: None}, timeout_s={"None": lambda: None, "5.0": lambda: 5.0}))
def test_fuzz_weight_receiver_in_a_group(gloo_world, drawn):  # noqa: F811 (fixture)
    _check("offload.WeightReceiver", lambda: offload.WeightReceiver(**_values(drawn)), drawn)


def test_fuzz_weight_sync_ranks_in_a_group(gloo_world):  # noqa: F811 (fixture)
    """`ranks` builds a group (collective: not drawn 100 times); outside the world it is named."""
    assert offload.WeightReceiver(ranks=[0]).src == 0
    with pytest.raises(ValueError, match=r"offload.WeightReceiver: ranks must be ranks of the world \(0 to 0\), got 3"):
        offload.WeightReceiver(ranks=[0, 3])
    with pytest.raises(ValueError, match="offload.WeightSender: pass either group or ranks, not both"):
        offload.WeightSender(_world_group(), ranks=[0])


def _offloaded_model():
    model = _model()
    offload.offload_params(model)
    return model


# Bad arguments the fuzzer found refused late, or with another function's message or
# none: each is refused at the call, by its own function, naming the argument.
KNOWN = [
    pytest.param("offload.enable_activation_offload", "timing",
                 lambda: offload.enable_activation_offload(_model(), timing=torch.ones(3), verbose=False),
                 id="enable_activation_offload-timing"),
    pytest.param("offload.enable_activation_offload", "layers",
                 lambda: offload.enable_activation_offload(_model(), layers=3, verbose=False),
                 id="enable_activation_offload-layers"),
    pytest.param("offload.activation_offload", "timing",
                 lambda: offload.activation_offload(timing=torch.ones(3)),
                 id="activation_offload-timing"),
    pytest.param("offload.activation_offload", "engine", lambda: offload.activation_offload(engine=3),
                 id="activation_offload-engine"),
    pytest.param("offload.activation_offload", "params", lambda: offload.activation_offload(params=3),
                 id="activation_offload-params"),
    pytest.param("offload.offload_params", "optimizer",
                 lambda: offload.offload_params(_model(), optimizer=torch.ones(2)), id="offload_params-optimizer"),
    pytest.param("offload.offload_params", "grads", lambda: offload.offload_params(_model(), grads=torch.ones(2)),
                 id="offload_params-grads"),
    pytest.param("offload.offload_params", "pool", lambda: offload.offload_params(_model(), pool=3),
                 id="offload_params-pool"),
    pytest.param("offload.offload_params", "chunk_bytes",
                 lambda: offload.offload_params(_model(), chunk_bytes=""),
                 id="offload_params-chunk_bytes"),
    pytest.param("offload.reload_params", "chunk_bytes",
                 lambda: offload.reload_params(_offloaded_model(), chunk_bytes=""),
                 id="reload_params-chunk_bytes"),
]


@pytest.mark.parametrize("fn, argument, call", KNOWN)
def test_fuzz_found_bad_arguments_raise_at_the_call(fn, argument, call):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    assert str(info.value).startswith(fn) and argument in str(info.value)


_NO_CUDA = pytest.mark.skipif(_device.accelerator_type() == "cuda",
                              reason="needs a torch without CUDA (CPU-only, or Ascend)")


def _enabled_twice():
    model = _model()
    handle = offload.enable_activation_offload(model, verbose=False)
    try:
        offload.enable_activation_offload(model, verbose=False)
    finally:
        handle.disable()


def _handle_of_model():
    return offload.enable_activation_offload(_model(), verbose=False)


# Bad arguments reported failing with another error (AttributeError, AssertionError, KeyError, a
# comparison's TypeError) or accepted and refused later by another function: each raises the
# documented type at the call, naming the public function, the argument and the rule.
FOUND = [
    pytest.param(lambda: offload.copy_to_host([1, 2, 3]), TypeError,
                 r"^offload.copy_to_host: tensors\[0\] must be a torch.Tensor, got int", id="copy_to_host-ints"),
    pytest.param(lambda: offload.copy_to_host([_compute_tensor(), "x"]), TypeError,
                 r"^offload.copy_to_host: tensors\[1\] must be a torch.Tensor, got str", id="copy_to_host-str"),
    pytest.param(lambda: offload.copy_to_device([_tensor()], "cuda"), ValueError,
                 r"^offload.copy_to_device: device 'cuda' is not a device torch knows here \(torch here has no cuda "
                 r"device", id="copy_to_device-cuda", marks=_NO_CUDA),
    pytest.param(lambda: offload.default_bucket_bytes("cuda"), ValueError,
                 r"^offload.default_bucket_bytes: device 'cuda' is not a device torch knows here \(torch here has no "
                 r"cuda device", id="default_bucket_bytes-cuda", marks=_NO_CUDA),
    pytest.param(lambda: offload.copy_to_device([_tensor()], "meta"), ValueError,
                 r"^offload.copy_to_device: device 'meta' is not a device offload copies to; expected ",
                 id="copy_to_device-meta"),
    pytest.param(lambda: _handle().wait_tensor("a"), TypeError,
                 r"^offload.CopyHandle.wait_tensor: index must be an int, got str 'a'", id="wait_tensor-str"),
    pytest.param(lambda: _handle().wait_tensor(2), IndexError,
                 r"^offload.CopyHandle.wait_tensor: index 2 is out of range for a handle of 2 tensors; expected an "
                 r"int in \[-2, 2\)", id="wait_tensor-out-of-range-index-error"),
    pytest.param(lambda: _handle().wait_tensor(-3), ValueError,
                 r"^offload.CopyHandle.wait_tensor: index -3 is out of range",
                 id="wait_tensor-out-of-range-value-error"),
    pytest.param(lambda: _handle().wait_stream(3), TypeError,
                 r"^offload.CopyHandle.wait_stream: stream must be a stream of the accelerator or None, got int",
                 id="wait_stream-int"),
    pytest.param(lambda: _handle().release_sources("x"), TypeError,
                 r"^offload.CopyHandle.release_sources: stream must be a stream", id="release_sources-str"),
    pytest.param(lambda: offload.WeightReceiver(group="world"), TypeError,
                 r"^offload.WeightReceiver: group must be a torch.distributed process group .* or None for the "
                 r"world, got str 'world'", id="receiver-group-str"),
    pytest.param(lambda: offload.WeightReceiver(src="0"), TypeError,
                 r"^offload.WeightReceiver: src must be an int >= 0 \(the global rank of the sender\), got str '0'",
                 id="receiver-src-str"),
    pytest.param(lambda: offload.WeightReceiver(ranks="01"), TypeError,
                 r"^offload.WeightReceiver: ranks must be a list of global ranks", id="receiver-ranks-str"),
    pytest.param(lambda: offload.WeightSender(dtype=torch.int8), ValueError,
                 r"^offload.WeightSender: dtype must be one of float64, float32, float16, bfloat16 or None, got "
                 r"torch.int8", id="sender-dtype-int8"),
    pytest.param(lambda: offload.WeightSender(bucket_bytes=-1), ValueError,
                 r"^offload.WeightSender: bucket_bytes \(-1\) is smaller than one alignment unit \(256 bytes\)",
                 id="sender-bucket_bytes-negative"),
    pytest.param(lambda: offload.WeightSender(bucket_bytes="1GiB"), TypeError,
                 r"^offload.WeightSender: bucket_bytes must be an int of at least alignment \(256 bytes\) or None "
                 r"for the default, got str", id="sender-bucket_bytes-str"),
    pytest.param(lambda: offload.WeightSender(pool=3), TypeError,
                 r"^offload.WeightSender: pool must be an offload.HostPool or None, got int", id="sender-pool"),
    pytest.param(lambda: offload.WeightSender(keep_dtype=3), TypeError, r"^offload.WeightSender: keep_dtype must be",
                 id="sender-keep_dtype"),
    pytest.param(lambda: offload.WeightSender(transport="ipc", reserve_sms=-1), ValueError,
                 r"^offload.WeightSender: reserve_sms must be an int >= 0, got -1", id="sender-ipc-reserve_sms"),
    pytest.param(lambda: offload.HostPool(slab_bytes=-5), ValueError,
                 r"^offload.HostPool: slab_bytes must be > 0 bytes \(how much the pool grows by at a time\), got -5$",
                 id="pool-slab-negative"),
    pytest.param(lambda: offload.HostPool(slab_bytes=0), ValueError,
                 r"^offload.HostPool: slab_bytes must be > 0 bytes \(how much the pool grows by at a time\), got 0$",
                 id="pool-slab-zero"),
    pytest.param(lambda: offload.HostPool(limit_bytes=-5), ValueError,
                 r"^offload.HostPool: limit_bytes \(bytes, 0 for no limit\): must be >= 0 bytes, got -5",
                 id="pool-limit-negative"),
    pytest.param(lambda: setattr(_pool(), "limit_bytes", "lots"), ValueError,
                 r"^offload.HostPool.limit_bytes \(bytes, 0 for no limit\): expected bytes", id="pool-limit-setter"),
    pytest.param(lambda: _pool().record_stream(_tensor(), "x"), TypeError,
                 r"^offload.HostPool.record_stream: stream must be a stream", id="pool-record_stream"),
    pytest.param(lambda: offload.AsyncStager(limit_bytes=-1), ValueError,
                 r"^offload.AsyncStager: limit_bytes \(bytes; None or 0: no limit but the pool's\): must be >= 0",
                 id="stager-limit-negative"),
    pytest.param(lambda: offload.AsyncStager(ring_size=1).wait_stream(3), TypeError,
                 r"^offload.AsyncStager.wait_stream: stream must be a stream", id="stager-wait_stream"),
    pytest.param(lambda: offload.plan_buckets({"a": _tensor()}, 1024).bucket_entries("0"), TypeError,
                 r"^offload.BucketPlan.bucket_entries: index must be an int >= 0, got str", id="bucket_entries-str"),
    pytest.param(_enabled_twice, RuntimeError,
                 r"^offload.enable_activation_offload: model \(_Model\) already has activation offload enabled; "
                 r"call .disable\(\) on the handle", id="enable_activation_offload-twice"),
    pytest.param(lambda: _handle_of_model().set_offloaded(3), TypeError,
                 r"^offload.ActivationOffload.set_offloaded: mask must be a list of True/False, one per layer \(3\), "
                 r"got int", id="set_offloaded-int"),
    pytest.param(lambda: _handle_of_model().set_recomputed([True, "no", False]), TypeError,
                 r"^offload.ActivationOffload.set_recomputed: mask\[1\] must be True or False, got str",
                 id="set_recomputed-str"),
    pytest.param(lambda: _handle_of_model().set_offloaded([True]), ValueError,
                 r"^offload.ActivationOffload.set_offloaded: mask must have one entry per layer \(3\), got 1",
                 id="set_offloaded-short"),
    pytest.param(lambda: _handle_of_model().set_layers_wrapped("yes"), TypeError,
                 r"^offload.ActivationOffload.set_layers_wrapped: on must be True or False", id="set_layers_wrapped"),
]


@pytest.mark.parametrize("call, error, message", FOUND)
def test_fuzz_found_cases_raise_the_documented_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_fuzz_enable_twice_names_a_layer_another_handle_offloads():
    """A model whose layer another handle offloads (a model nested in this one) is refused, naming the layer."""
    outer = torch.nn.Sequential(_model())
    inner = offload.enable_activation_offload(outer[0], verbose=False)
    try:
        with pytest.raises(RuntimeError, match=r"^offload.enable_activation_offload: layer '0.layers.0' \(_Block\) of "
                                               r"model \(Sequential\) already has activation offload enabled by "
                                               r"another handle"):
            offload.enable_activation_offload(outer, layers=["0.layers.0", "0.layers.1"], verbose=False)
    finally:
        inner.disable()
    offload.enable_activation_offload(outer, layers=["0.layers.0", "0.layers.1"], verbose=False).disable()


SYNC_CASES = [
    pytest.param(lambda: offload.WeightReceiver(group="world"), TypeError,
                 r"^offload.WeightReceiver: group must be a torch.distributed process group", id="receiver-group-str"),
    pytest.param(lambda: offload.WeightReceiver(src=3), ValueError,
                 r"^offload.WeightReceiver: src must be a rank of the group, got src=3 for ranks \[0\]",
                 id="receiver-src-outside"),
    pytest.param(lambda: offload.WeightSender(dtype=torch.int8), ValueError,
                 r"^offload.WeightSender: dtype must be one of float64, float32, float16, bfloat16 or None",
                 id="sender-dtype-int8"),
    pytest.param(lambda: offload.WeightSender(alignment=1 << 30), ValueError,
                 r"^offload.WeightSender: bucket_bytes \(\d+\) is smaller than one alignment unit \(1073741824 bytes\)",
                 id="sender-alignment-past-the-default"),
    pytest.param(lambda: offload.WeightSender().send(_model(), version="1"), TypeError,
                 r"^offload.WeightSender.send: version must be an int >= 0 \(a version tag, or None\), got str",
                 id="send-version-str"),
    pytest.param(lambda: offload.WeightSender(mode="host_cache").snapshot(_model(), version=-1), ValueError,
                 r"^offload.WeightSender.snapshot: version must be an int >= 0", id="snapshot-version-negative"),
    pytest.param(lambda: offload.WeightSender(mode="host_cache").wait_snapshot(stream=3), TypeError,
                 r"^offload.WeightSender.wait_snapshot: stream must be a stream", id="wait_snapshot-stream"),
    pytest.param(lambda: offload.WeightSender(mode="host_cache").snapshot_ms(1.5), TypeError,
                 r"^offload.WeightSender.snapshot_ms: version must be an int >= 0", id="snapshot_ms-version-float"),
    pytest.param(lambda: offload.WeightReceiver().receive(copy="yes"), TypeError,
                 r"^offload.WeightReceiver.receive: copy must be True or False", id="receive-copy"),
    pytest.param(lambda: offload.WeightReceiver().load({}, strict=None), TypeError,
                 r"^offload.WeightReceiver.load: strict must be True or False", id="load-strict"),
]


@pytest.mark.parametrize("call, error, message", SYNC_CASES)
def test_fuzz_found_cases_in_a_group_raise_the_documented_error(gloo_world, call, error, message):  # noqa: F811
    with pytest.raises(error, match=message):
        call()


def test_fuzz_covers_every_public_callable():
    """A new public function or class gets a fuzz test here (or is listed as plain data)."""
    plain_data = {"PackedBucket", "ActivationOffload", "__version__", "native_available", "default_host_pool"}
    fuzzed = {
        "BucketEntry", "BucketPlan", "CopyHandle",  # from_dict; the handle's methods
        "AsyncStager", "HostPool", "WeightReceiver", "WeightSender", "activation_offload", "copy_to_device",
        "copy_to_host", "default_bucket_bytes", "enable_activation_offload", "offload_params", "pack_buckets",
        "params_offloaded", "plan_buckets", "reload_params", "unpack_bucket",
    }
    assert set(offload.__all__) == plain_data | fuzzed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(offload.native_available(), bool)
        assert isinstance(offload.default_host_pool(), offload.HostPool)
