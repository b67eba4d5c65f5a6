"""offload.staging.object_scan and its C twin in the compiled core: the reference sums of the
busy check, the cached tree's type check, a first save's storage bytes and reader views,
and a wide dict's values in the plan's key order, each the same in C and in Python."""

import collections

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.parametrize("impl", ["python", "native"])
def test_staging_object_scans_match_the_python_loops(impl):
    # The busy check's reference sums and the cached tree's type check, in C and in Python.
    from offload.core import _backend
    from offload.staging import object_scan as _object_scan
    if impl == "native":
        core = _backend.core()
        if core is None:
            pytest.skip("needs the compiled core (offload._C)")
        scan = core
    else:
        scan = _object_scan
    # Private names: these loops are the stager's internals, compared here with their C twins.
    refcount_sum, types_equal, storage_bytes = scan._refcount_sum, scan._types_equal, scan._storage_bytes
    objects = [torch.ones(2), torch.zeros(3), object()]
    base = refcount_sum(objects)
    held = objects[1]
    assert refcount_sum(objects) == base + 1
    also = [objects[0], objects[2]]
    assert refcount_sum(objects) == base + 3
    del held, also
    assert refcount_sum(objects) == base
    assert types_equal(objects, [torch.Tensor, torch.Tensor, object])
    assert not types_equal(objects, [torch.Tensor, torch.Tensor, int])
    assert not types_equal(objects, [torch.Tensor, torch.Tensor])  # another length
    assert not types_equal([torch.nn.Parameter(torch.ones(1))], [torch.Tensor])  # a subclass is another type
    assert types_equal([], [])
    # A first save's size: each storage once, at most what its tensors cover.
    big = torch.zeros(1000)  # 4000 bytes
    tied = torch.ones(10, dtype=torch.float64)
    tensors = [big[:100], big[100:150].view(5, 10).t(), tied, tied, torch.empty(0), torch.zeros(3, dtype=torch.int8)]
    assert storage_bytes(tensors) == (400 + 200 + 80 + 3, 400)  # the tied 80 bytes count once: 160 > 80
    assert storage_bytes([big, big[:10]]) == (4000, 4000)  # never more than the storage
    assert storage_bytes([]) == (0, 0)
    # A first save's reader views: each engine tensor's layout over its block's alias storage.
    block = torch.arange(64, dtype=torch.uint8)
    engine = [block[8:16].view(torch.float32), block[16:48].view(torch.int16).view(4, 4).t(), block[:0],
              torch.zeros(2, 0)]
    addresses = scan._storage_addresses(engine)
    assert addresses == [block.data_ptr()] * 2 + [0, 0]  # no elements: no alias needed
    alias = block.clone()  # another storage with the same bytes, standing in for the DLPack alias
    views = scan._views_over(engine, {block.data_ptr(): alias})
    for view, t in zip(views, engine):
        assert (view.dtype, view.shape, view.stride()) == (t.dtype, t.shape, t.stride())
        assert view.numel() == 0 or view.untyped_storage().data_ptr() == alias.data_ptr()
        assert torch.equal(view, t)
    alias.zero_()
    assert not views[0].any() and not views[1].any()  # the alias's bytes, not the block's
    if impl == "native":
        with pytest.raises(ValueError, match="no alias for the storage of tensor 0"):
            scan._views_over(engine, {})
    # A wide dict's values in the plan's key order: its own order, another one, a missing key.
    dict_values = scan._dict_values
    values = [torch.ones(1), 2, "x", None]
    d = {f"layer{i}.weight": v for i, v in enumerate(values)}
    keys = tuple(d)
    got = dict_values(d, keys)
    assert len(got) == 4 and all(a is b for a, b in zip(got, values))
    assert dict_values(d, tuple("".join(k) for k in keys)) == got  # equal keys, other objects
    reordered = collections.OrderedDict(d)
    reordered.move_to_end("layer0.weight")  # its iteration order is not its dict order
    assert all(a is b for a, b in zip(dict_values(reordered, keys), values))
    assert all(a is b for a, b in zip(dict_values(dict(reversed(d.items())), keys), values))
    with pytest.raises(KeyError, match="layer9.weight"):
        dict_values(d, keys[:3] + ("layer9.weight",))
    assert dict_values({}, ()) == []
