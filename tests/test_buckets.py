"""Bucket planning, packing and unpacking: round trips bit for bit, casts equal to tensor.to(dtype)."""

import pickle
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import offload
from offload import BucketEntry, BucketPlan
from offload.weights import bucket_planner

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.int8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def _random(shape, dtype, device, gen):
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
        return t.to(dtype).to(device)
    if dtype == torch.bool:
        return (torch.randint(0, 2, shape, generator=gen) == 1).to(device)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=torch.int64).to(
        dtype).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose equality is bitwise (NaN payloads and -0.0 included)."""
    if t.dtype == torch.bool or t.element_size() == 1:
        return t.view(torch.uint8)
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _expected(t, name, dtype, keep):
    castable = t.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    if dtype is None or not castable or any(re.fullmatch(k.replace("*", ".*"), name) for k in keep):
        return t
    return t.to(dtype)


def _round_trip(tensors, bucket_bytes, dtype=None, keep=(), alignment=bucket_planner.DEFAULT_ALIGNMENT):
    """Pack, then unpack both ways; check views and in-place loads against the expected values."""
    buckets = list(offload.pack_buckets(tensors, bucket_bytes, dtype=dtype, keep_dtype=keep, alignment=alignment))
    plan = offload.plan_buckets(tensors, bucket_bytes, dtype=dtype, keep_dtype=keep, alignment=alignment)
    assert [b.entries for b in buckets] == [plan.bucket_entries(i) for i in range(plan.num_buckets)]
    assert [b.data.numel() for b in buckets] == plan.bucket_sizes
    assert all(b.data.numel() <= bucket_bytes for b in buckets)
    # In place: destinations in the bucket dtype, filled chunk by chunk.
    out = {}
    for name, t in tensors.items():
        want = _expected(t, name, dtype, keep)
        out[name] = torch.full_like(want, 7) if want.dtype != torch.bool else torch.zeros_like(want)
    for b in buckets:
        offload.unpack_bucket(b.data, b.entries, out=out)
        for e in b.entries:
            assert e.offset % alignment == 0
    for name, t in tensors.items():
        assert torch.equal(_bits(out[name]), _bits(_expected(t, name, dtype, keep))), name
    # Views: whole tensors come back in their shape; chunks as flat pieces.
    pieces = {}
    for b in buckets:
        for (name, view), e in zip(offload.unpack_bucket(b.data, b.entries), b.entries):
            pieces.setdefault(name, []).append((e.start, view))
    for name, t in tensors.items():
        want = _expected(t, name, dtype, keep)
        flat = torch.cat([v.reshape(-1) for _, v in sorted(pieces[name], key=lambda p: p[0])])
        assert torch.equal(_bits(flat), _bits(want.reshape(-1))), name
    return buckets


def test_buckets_round_trip_every_dtype(backend, device):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}.{str(d)[6:]}": _random((3, 5 + i), d, device, gen) for i, d in enumerate(DTYPES)}
    _round_trip(tensors, 1024)


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_buckets_cast_equals_to(backend, device, target):
    gen = torch.Generator().manual_seed(1)
    tensors = {f"w{i}": _random((37, 11), d, device, gen) for i, d in enumerate(
        [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32])}
    # Values that stress rounding: ties, subnormals, infinities, NaN.
    tensors["special"] = torch.tensor([0.0, -0.0, 1e-40, -1e-45, float("inf"), float("-inf"), float("nan"),
                                       1.00390625, 1.0009765625, 65520.0, 3.4e38], device=device)
    _round_trip(tensors, 4096, dtype=target)


def test_buckets_keep_dtype_patterns(backend, device):
    gen = torch.Generator().manual_seed(2)
    tensors = {
        "layers.0.mlp.gate.weight": _random((4, 8), torch.float32, device, gen),
        "layers.0.mlp.up.weight": _random((4, 8), torch.float32, device, gen),
        "layers.0.router.bias": _random((8,), torch.float32, device, gen),
    }
    buckets = _round_trip(tensors, 1 << 16, dtype=torch.bfloat16, keep=["*.gate.weight"])
    dtypes = {e.name: e.dtype for b in buckets for e in b.entries}
    assert dtypes == {"layers.0.mlp.gate.weight": "float32", "layers.0.mlp.up.weight": "bfloat16",
                      "layers.0.router.bias": "bfloat16"}
    regex = offload.plan_buckets(tensors, 1 << 16, dtype=torch.bfloat16, keep_dtype=[re.compile(r".*router.*")])
    assert {e.name: e.dtype for e in regex.entries}["layers.0.router.bias"] == "float32"


def test_buckets_split_large_tensor(backend, device):
    gen = torch.Generator().manual_seed(3)
    tensors = {"small": _random((10,), torch.float32, device, gen),
               "big": _random((1000, 3), torch.float32, device, gen),  # 12000 bytes over 1024-byte buckets
               "after": _random((5,), torch.float16, device, gen)}
    buckets = _round_trip(tensors, 1024, dtype=torch.bfloat16)
    chunks = [e for b in buckets for e in b.entries if e.name == "big"]
    assert len(chunks) > 5 and [c.chunk for c in chunks] == list(range(len(chunks)))
    assert sum(c.numel for c in chunks) == 3000 and all(c.num_chunks == len(chunks) for c in chunks)
    assert len({c.bucket for c in chunks}) == len(chunks)


def test_buckets_empty_and_many_tiny(backend, device):
    gen = torch.Generator().manual_seed(4)
    tensors = {"empty0": torch.empty(0, device=device), "empty1": torch.empty(3, 0, dtype=torch.bfloat16,
                                                                              device=device)}
    for i in range(2000):
        tensors[f"tiny.{i}"] = _random((1 + i % 3,), torch.float32, device, gen)
    buckets = _round_trip(tensors, 1 << 14, dtype=torch.bfloat16, alignment=16)  # 2000 * 16 bytes
    assert len(buckets) == 2


def test_buckets_iterator_streams_one_bucket_at_a_time(backend, device):
    gen = torch.Generator().manual_seed(5)
    seen = []

    def lazy():
        for i in range(6):
            seen.append(i)
            yield f"t{i}", _random((64,), torch.float32, device, gen)  # 256 bytes each

    it = offload.pack_buckets(lazy(), 512)
    first = next(it)
    assert [e.name for e in first.entries] == ["t0", "t1"] and seen == [0, 1, 2]
    assert len(list(it)) == 2


def test_buckets_metadata_is_plain_data(device):
    tensors = {"a": torch.zeros(10, 3, device=device), "b": torch.zeros(4000, device=device)}
    plan = offload.plan_buckets(tensors, 4096, dtype=torch.bfloat16)
    again = BucketPlan.from_dict(pickle.loads(pickle.dumps(plan.to_dict())))
    assert again == plan
    assert BucketEntry.from_dict(plan.entries[0].to_dict()) == plan.entries[0]
    meta = offload.plan_buckets({"m": torch.empty(1 << 20, device="meta")}, 1 << 16)  # nothing read
    assert sum(e.numel for e in meta.entries) == 1 << 20


def test_buckets_default_size_is_documented_range(device):
    size = bucket_planner.default_bucket_bytes(device)
    if device.type == "cpu":
        assert size == bucket_planner.CPU_DEFAULT_BUCKET_BYTES
    else:
        assert bucket_planner.MIN_DEFAULT_BUCKET_BYTES <= size <= bucket_planner.MAX_DEFAULT_BUCKET_BYTES


# ---------------------------------------------------------------- fuzz

_FUZZ_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float64]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shapes=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=3), min_size=1, max_size=12),
    dtypes=st.lists(st.sampled_from(_FUZZ_DTYPES), min_size=12, max_size=12),
    target=st.sampled_from([None, torch.bfloat16, torch.float32, torch.float16]),
    alignment=st.sampled_from([1, 8, 16, 64, 256]),
    bucket_units=st.integers(1, 40),
)
def test_buckets_fuzz_round_trip(backend, device, shapes, dtypes, target, alignment, bucket_units):
    gen = torch.Generator().manual_seed(len(shapes) * 31 + bucket_units)
    tensors = {f"p{i}": _random(tuple(s), dtypes[i], device, gen) for i, s in enumerate(shapes)}
    bucket_bytes = max(alignment, 8) * bucket_units + (bucket_units % 3) * 8
    _round_trip(tensors, bucket_bytes, dtype=target, alignment=alignment)


# ---------------------------------------------------------------- bad input


def test_buckets_name_twice_raises():
    with pytest.raises(ValueError, match="tensor name 'w' appears twice"):
        offload.plan_buckets([("w", torch.zeros(2)), ("w", torch.zeros(3))], 1024)


def test_buckets_bucket_smaller_than_alignment_raises():
    with pytest.raises(ValueError, match=r"bucket_bytes \(100\) is smaller than one alignment unit \(256"):
        offload.plan_buckets({"a": torch.zeros(2)}, 100)
    with pytest.raises(ValueError, match="alignment must be a power of two"):
        offload.plan_buckets({"a": torch.zeros(2)}, 1024, alignment=24)


def test_buckets_int_arguments_checked():
    with pytest.raises(TypeError, match=r"offload.plan_buckets: bucket_bytes must be an int of at least alignment "
                                        r"\(256 bytes\) or None for the default, got float"):
        offload.plan_buckets({"a": torch.zeros(2)}, 1024.0)
    with pytest.raises(ValueError, match="offload.plan_buckets: alignment must be an int >= 1, got 0"):
        offload.plan_buckets({"a": torch.zeros(2)}, 1024, alignment=0)
    with pytest.raises(TypeError, match="offload.pack_buckets: alignment must be an int >= 1, got str"):
        list(offload.pack_buckets({"a": torch.zeros(2)}, 1024, alignment="256"))


def test_buckets_unsupported_tensors_raise(backend):
    with pytest.raises(ValueError, match="tensor 'nc' is not contiguous"):
        list(offload.pack_buckets({"nc": torch.zeros(4, 6).t()}, 1024))
    with pytest.raises(ValueError, match="tensor 'sp' has layout torch.sparse_coo"):
        list(offload.pack_buckets({"sp": torch.zeros(4, 4).to_sparse()}, 1024))
    with pytest.raises(ValueError, match="tensor 'm' is a meta tensor"):
        list(offload.pack_buckets({"m": torch.empty(4, device="meta")}, 1024))
    with pytest.raises(TypeError, match="tensor 'x' must be a torch.Tensor"):
        list(offload.pack_buckets({"x": [1, 2]}, 1024))
    with pytest.raises(ValueError, match="dtype must be one of"):
        offload.plan_buckets({"a": torch.zeros(2)}, 1024, dtype=torch.int8)


def test_buckets_metadata_mismatch_raises(backend):
    (bucket,) = offload.pack_buckets({"a": torch.arange(10.0), "b": torch.arange(4.0)}, 1024)
    lie = [BucketEntry(**{**bucket.entries[1].to_dict(), "shape": (400,), "numel": 400, "nbytes": 1600})]
    with pytest.raises(ValueError, match="metadata of tensor 'b' .* does not match bucket 0"):
        offload.unpack_bucket(bucket.data, lie)
    with pytest.raises(ValueError, match="tensor 'a' has shape \\[10\\] in the bucket but the destination has"):
        offload.unpack_bucket(bucket.data, bucket.entries, out={"a": torch.zeros(11), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match="tensor 'b' is float32 in the bucket but the destination is float64"):
        offload.unpack_bucket(bucket.data, bucket.entries, out={"a": torch.zeros(10),
                                                                "b": torch.zeros(4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="out has no tensor named 'b'"):
        offload.unpack_bucket(bucket.data, bucket.entries, out={"a": torch.zeros(10)})


def _plan_dict():
    """A plan with a split tensor ('big', 3 chunks), a whole one and an empty one, as plain data."""
    tensors = {"a": torch.arange(10.0), "big": torch.arange(200.0), "e": torch.zeros(0, 3)}
    plan = offload.plan_buckets(tensors, 512)
    assert [e.num_chunks for e in plan.entries if e.name == "big"] == [3, 3, 3]
    return plan.to_dict()


def _edit(data, name, chunk=0, **changes):
    data["entries"] = [dict(e, **changes) if (e["name"], e["chunk"]) == (name, chunk) else e
                       for e in data["entries"]]
    return data


@pytest.mark.parametrize("edit, message", [
    (lambda d: _edit(d, "a", shape=[40]), r"tensor 'a' has shape \[40\] \(40 elements\) but holds elements "
                                          r"\[0, 10\) in its only chunk"),
    (lambda d: _edit(d, "a", nbytes=44), r"tensor 'a' claims 44 bytes for 10 float32 elements \(40 bytes\)"),
    (lambda d: _edit(d, "a", dtype="int32"), r"tensor 'a' says float32 was packed as int32, a cast the packer "
                                             r"never makes"),
    (lambda d: _edit(d, "a", dtype="float33"), r"tensor 'a' has dtype 'float33', which is not a torch dtype name"),
    (lambda d: _edit(d, "a", start=5), r"tensor 'a' has shape \[10\] \(10 elements\) but holds elements "
                                       r"\[5, 15\) in its only chunk"),
    (lambda d: _edit(d, "big", chunk=2, start=195), r"tensor 'big' \(chunk 2\) holds elements \[195, 203\) "
                                                    r"of a tensor of shape \[200\] \(200 elements\)"),
    (lambda d: _edit(d, "big", chunk=1, start=0), r"tensor 'big': chunk 1 starts at element 0; expected chunk 1 at "
                                                  r"element \d+"),
    (lambda d: _edit(d, "big", chunk=2, numel=4, nbytes=16), r"tensor 'big': its 3 chunks hold 196 elements of 200"),
    (lambda d: _edit(d, "big", chunk=2, num_chunks=4),
     r"tensor 'big' has 3 entries that disagree with each other"),
    (lambda d: dict(d, entries=[e for e in d["entries"] if (e["name"], e["chunk"]) != ("big", 2)]),
     r"tensor 'big' has 2 entries that disagree"),
    (lambda d: dict(d, entries=d["entries"] + [d["entries"][0]]), r"tensor 'a' has 2 entries that disagree"),
    (lambda d: _edit(d, "a", bucket=7), r"tensor 'a' is in bucket 7 but the plan has \d buckets"),
    (lambda d: _edit(d, "a", offset=496), r"tensor 'a' claims bytes \[496, 536\) of bucket 0, which holds "
                                          r"\d+ bytes"),
    (lambda d: _edit(d, "a", offset=2), r"tensor 'a' starts at byte 2, not a multiple of the float32 element "
                                        r"size \(4\)"),
    (lambda d: dict(d, bucket_sizes=[600] + d["bucket_sizes"][1:]), r"bucket 0 has size 600; expected an int in "
                                                                    r"\[0, bucket_bytes=512\]"),
    (lambda d: dict(d, alignment=24), r"alignment must be a power of two, got 24"),
])
def test_buckets_plan_validate_names_the_tensor(edit, message):
    offload.BucketPlan.from_dict(_plan_dict()).validate()  # a planner's plan is valid, sent as plain data too
    bad = offload.BucketPlan.from_dict(edit(_plan_dict()))
    with pytest.raises(ValueError, match="offload.BucketPlan.validate: " + message):
        bad.validate()


def test_buckets_unpack_refuses_inconsistent_entries():
    """What a plan claims about one entry is checked before unpacking reads or writes a byte by it."""
    (bucket,) = offload.pack_buckets({"a": torch.arange(10.0), "b": torch.arange(4.0)}, 1024)
    entry = bucket.entries[0].to_dict()
    lies = {
        r"has shape \[40\] \(40 elements\) but holds elements \[0, 10\)": dict(entry, shape=(40,)),
        r"says float32 was packed as int32": dict(entry, dtype="int32"),
        r"has shape \[10\] \(10 elements\) but holds elements \[5, 15\)": dict(entry, start=5),
    }
    for message, lie in lies.items():
        lie = BucketEntry(**lie)
        with pytest.raises(ValueError, match="offload.unpack_bucket: metadata of tensor 'a' " + message):
            offload.unpack_bucket(bucket.data, [lie])
        dst = torch.zeros(lie.shape, dtype=lie.torch_dtype)
        with pytest.raises(ValueError, match="offload.unpack_bucket: metadata of tensor 'a' " + message):
            offload.unpack_bucket(bucket.data, [lie], out=[dst])  # not a partial load without a word
        assert not dst.any()


@pytest.mark.native
def test_buckets_native_checks_spans():
    core = offload.core._backend.core()
    bucket = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not fit a bucket of 64 bytes"):
        core.pack_bucket(bucket, [torch.zeros(32)], [0], [32], [0], [torch.float32])
    with pytest.raises(ValueError, match="cannot cast sources\\[0\\] between Int and Float"):
        core.pack_bucket(bucket, [torch.zeros(4, dtype=torch.int32)], [0], [4], [0], [torch.float32])


class _CoreWithoutThisDevice:
    """A compiled core that has bucket copies, but not for the device at hand (Ascend, CUDA with a CPU-only core)."""

    def __init__(self):
        self.calls = 0

    def _refuse(self, bucket, *args, **kwargs):
        self.calls += 1
        raise RuntimeError(f"offload: bucket copies on {bucket.device} are not built into this core")

    pack_bucket = unpack_bucket = _refuse


def test_buckets_core_used_only_for_devices_it_was_built_for(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    tensors = {"a": _random((33, 5), torch.float32, "cpu", gen), "b": _random((7,), torch.bfloat16, "cpu", gen),
               "i": _random((9,), torch.int32, "cpu", gen)}
    core = _CoreWithoutThisDevice()
    # A private patch: the loaded core is what is faked here; no public seam loads another one.
    monkeypatch.setattr(offload.core._backend, "_core", core)
    monkeypatch.setattr(offload.core._backend, "built_for", lambda device_type: False)  # not built for this device
    buckets = _round_trip(tensors, 256, dtype=torch.float16)  # the pure-PyTorch path, bit for bit
    assert core.calls == 0 and len(buckets) > 1
    monkeypatch.setattr(offload.core._backend, "built_for", lambda device_type: True)  # built for it: the core is used
    with pytest.raises(RuntimeError, match="bucket copies on cpu are not built into this core"):
        list(offload.pack_buckets(tensors, 1024))
    assert core.calls == 1


def test_buckets_built_for_reads_the_build_target(monkeypatch):
    # Private patches: the build's metadata is what is faked here; only a build writes it.
    monkeypatch.setattr(offload.core._backend, "_core", object())
    monkeypatch.setattr(offload.core._backend, "_build_info", {"target": "cpu"})
    assert offload.core._backend.built_for("cpu") and not offload.core._backend.built_for("cuda")
    assert not offload.core._backend.built_for("npu")
    monkeypatch.setattr(offload.core._backend, "_build_info", {"target": "cuda"})
    assert offload.core._backend.built_for("cuda") and offload.core._backend.built_for("cpu")
    monkeypatch.setattr(offload.core._backend, "_core", None)
    assert not offload.core._backend.built_for("cpu")


@pytest.mark.cuda
def test_buckets_cuda_unaligned_sources_and_big_tensor(backend, device):
    """Sources that start off the 16-byte grid (slices) take the head/tail path; many spans take several launches."""
    gen = torch.Generator().manual_seed(6)
    base = _random((1 << 20) + 7, torch.float32, device, gen)
    tensors = {"off1": base[1:1001], "off3": base[3:70001], "big": base[5:(1 << 20) + 5]}
    for i in range(300):  # more spans than one kernel table holds
        tensors[f"s{i}"] = _random((i + 1,), torch.bfloat16, device, gen)
    _round_trip(tensors, 1 << 21, dtype=torch.float16, alignment=16)
    _round_trip(tensors, 1 << 21)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"bucket_bytes": 1}, ValueError, r"offload.pack_buckets: bucket_bytes \(1\) is smaller than one alignment"),
        ({"bucket_bytes": 0}, ValueError, r"offload.pack_buckets: bucket_bytes \(0\) is smaller than one alignment"),
        ({"bucket_bytes": -5}, ValueError, r"offload.pack_buckets: bucket_bytes \(-5\) is smaller than one alignment"),
        ({"bucket_bytes": "1KiB"}, TypeError, "offload.pack_buckets: bucket_bytes must be an int of at least "
                                              "alignment .* got str"),
        ({"alignment": 3}, ValueError, "offload.pack_buckets: alignment must be a power of two"),
        ({"dtype": torch.int8}, ValueError, "offload.pack_buckets: dtype must be one of"),
        ({"keep_dtype": [1]}, TypeError, "offload.pack_buckets: keep_dtype entries must be str"),
    ],
)
def test_buckets_pack_checks_arguments_at_the_call(kwargs, error, message):
    """The error comes from the call itself, not from the first next() of the iterator."""
    args = dict({"bucket_bytes": 1024}, **kwargs)
    with pytest.raises(error, match=message):
        offload.pack_buckets({"a": torch.zeros(2)}, args.pop("bucket_bytes"), **args)


@pytest.mark.parametrize(
    "tensors, error, message",
    [
        ({"x": 3}, TypeError, "offload.pack_buckets: tensor 'x' must be a torch.Tensor, got int"),
        ([("a", torch.zeros(2)), 5], TypeError, "offload.pack_buckets: item 1 must be a \\(name, tensor\\) pair"),
        ({1: torch.zeros(2)}, TypeError, "offload.pack_buckets: tensor names must be str, got int"),
        ([("w", torch.zeros(2)), ("w", torch.zeros(2))], ValueError, "tensor name 'w' appears twice"),
        ({"m": torch.empty(2, device="meta")}, ValueError, "tensor 'm' is a meta tensor"),
        ({"nc": torch.zeros(4, 6).t()}, ValueError, "tensor 'nc' is not contiguous"),
        (torch.zeros(2), TypeError, "offload.pack_buckets: tensors must be a mapping"),
        (5, TypeError, "offload.pack_buckets: tensors must be a mapping or an iterable of \\(name, tensor\\) pairs, "
                       "got int"),
    ],
)
def test_buckets_pack_checks_containers_at_the_call(tensors, error, message):
    with pytest.raises(error, match=message):
        offload.pack_buckets(tensors, 1024)


def test_buckets_pack_checks_an_iterator_as_it_is_consumed():
    """An iterator (a model gathered one tensor at a time) is not drained by the call."""
    consumed = []

    def pairs():
        for name in ("a", "b"):
            consumed.append(name)
            yield name, (torch.zeros(2) if name == "a" else "not a tensor")

    packed = offload.pack_buckets(pairs(), 1024)
    assert consumed == []
    with pytest.raises(TypeError, match="offload.pack_buckets: tensor 'b' must be a torch.Tensor, got str"):
        list(packed)


def test_buckets_arguments_named_when_not_containers():
    with pytest.raises(TypeError, match="offload.pack_buckets: keep_dtype must be a name pattern"):
        offload.pack_buckets({"a": torch.zeros(2)}, 1024, keep_dtype=1.5)
    with pytest.raises(TypeError, match="offload.plan_buckets: tensors must be a mapping or an iterable of "
                                        r"\(name, tensor\) pairs, got float"):
        offload.plan_buckets(-0.5, 1024)
    with pytest.raises(ValueError, match="offload.plan_buckets: device 'nowhere' is not a device torch knows here"):
        offload.plan_buckets({"a": torch.zeros(2)}, device="nowhere")
    with pytest.raises(TypeError, match="offload.default_bucket_bytes: device must be a torch.device"):
        offload.default_bucket_bytes((1,))
    (bucket,) = offload.pack_buckets({"a": torch.arange(4.0)}, 1024)
    with pytest.raises(TypeError, match="offload.unpack_bucket: entries must be a sequence of BucketEntry, got float"):
        offload.unpack_bucket(bucket.data, 1.5)
    with pytest.raises(TypeError, match="offload.unpack_bucket: out must be a mapping name -> tensor or a list"):
        offload.unpack_bucket(bucket.data, bucket.entries, out=2)
