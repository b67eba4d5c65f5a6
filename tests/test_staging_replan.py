"""When a save plans again: a change of structure, layout, shape or container type is seen
(also once later saves run generated code), scalars change without a new plan, and the
address checks catch a tensor moved to another storage or newly tied."""

import collections

import pytest
import torch

import offload
from _staging_helpers import assert_same, snapshot

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_staging_structure_change_replans_only_what_changed(backend, device):
    stager = offload.AsyncStager(ring_size=1)
    a, b, c = torch.randn(100, device=device), torch.randn(50, device=device), torch.randn(10, device=device)
    first = stager.stage({"a": a, "b": b, "c": c}).result()
    a_ptr = first["a"].data_ptr()
    del first
    d = torch.randn(3, 3, device=device)
    second = stager.stage({"a": a, "b": b.view(5, 10), "d": d}).result()  # b changed shape, c gone, d new
    assert_same(second, {"a": a, "b": b.view(5, 10), "d": d})
    assert second["a"].data_ptr() == a_ptr
    record = stager.metrics()[-1]
    assert (record["replanned"], record["buffers_reused"], record["buffers_allocated"]) == (True, 1, 2)
    stager.close()


def test_staging_layout_change_same_shape(backend, device):
    # Same path, shape and dtype, other strides (same storage, then a new one): the
    # buffers made for the old layout are not refilled blindly.
    stager = offload.AsyncStager(ring_size=1)
    base = torch.arange(24, dtype=torch.float32, device=device)
    states = [
        {"w": base.view(4, 6), "small": torch.ones(3, device=device)},
        {"w": base.view(6, 4).t(), "small": torch.ones(3, device=device)},  # same storage, transposed
        {"w": (base + 1).view(6, 4).t().contiguous(), "small": torch.ones(3, device=device)},  # new storage
        {"w": torch.arange(48.0, device=device).view(4, 12)[:, ::2],  # not dense
         "small": torch.ones(3, device=device)},
        {"w": torch.ones(1, 6, device=device).expand(4, 6), "small": torch.ones(3, device=device)},  # broadcast
        {"w": torch.full((4, 1), 3.0, device=device).expand(4, 6), "small": torch.ones(3, device=device)},
    ]
    for state in states:
        for _ in range(2):
            staged = stager.stage(state).result()
            assert_same(staged, snapshot(state))
            del staged
    stager.close()


def test_staging_broadcast_tensor_restaged(backend, device):
    stager = offload.AsyncStager(ring_size=1)
    row = torch.arange(5, dtype=torch.float32, device=device).view(1, 5)
    state = {"b": row.expand(1000, 5), "w": torch.ones(4, device=device)}
    for step in range(3):
        row.fill_(step)
        staged = stager.stage(state).result()
        assert_same(staged, snapshot(state))
        assert staged["b"].shape == (1000, 5)
        del staged
    stager.close()


def test_staging_scalars_change_without_replanning(backend, device):
    stager = offload.AsyncStager()
    w = torch.ones(4, device=device)
    for step in range(3):
        staged = stager.stage({"w": w, "meta": {"step": step, "lr": 0.1 * step}}).result()
        assert staged["meta"] == {"step": step, "lr": 0.1 * step}
        del staged
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False]
    stager.close()


Pair = collections.namedtuple("Pair", "first second")


def test_staging_shape_changes_after_generated_code(backend, device):
    """Saves 2+ of one shape run generated code; every kind of change must still be seen."""
    stager = offload.AsyncStager(ring_size=1)
    w = torch.randn(6, device=device)
    shapes = [
        {"a": w, "l": [1, 2], "p": Pair(w, 3)},
        {"a": w, "l": [1, 2], "p": Pair(w, 4)},
        {"a": w, "l": [1, 2], "p": Pair(w, 5)},  # generated code from here on
        {"b": w, "l": [1, 2], "p": Pair(w, 5)},  # key renamed, same length
        {"b": w, "l": [1, 2, 3], "p": Pair(w, 5)},  # list grew
        {"b": w, "l": [1, torch.ones(2, device=device)], "p": Pair(w, 5)},  # leaf became a tensor
        {"b": w, "l": [1, 2], "p": (w, 5)},  # namedtuple became a tuple
        {"b": w.view(2, 3), "l": [1, 2], "p": (w, 5)},  # same storage, other shape
    ]
    for state in shapes:
        staged = stager.stage(state).result()
        assert_same(staged, snapshot(state))
        assert type(staged["p"]) is type(state["p"])
        del staged
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False, True, True, True, True, True]
    stager.close()


Wide = collections.namedtuple("Wide", [f"f{i}" for i in range(9)])


def test_staging_wide_containers_after_generated_code(backend, device):
    """Containers of many leaves are taken apart by key slices; every change must still be seen."""
    stager = offload.AsyncStager(ring_size=1)

    def state(names, extra=()):
        layer = {n: (torch.full((3,), float(i), device=device) if i % 3 else i) for i, n in enumerate(names)}
        return {
            "model": layer,
            "list": [torch.full((2,), float(i), device=device) for i in range(10)] + list(extra),
            "tuple": tuple(range(12)),
            "wide": Wide(*[torch.ones(1, device=device) * i for i in range(9)]),
        }

    names = [f"layer{i}.weight" for i in range(20)]
    reordered = dict(reversed(list(state(names)["model"].items())))
    shapes = [
        state(names),
        state(names),
        state(names),  # generated code from here on
        {**state(names), "model": reordered},  # same keys, other order: values found by key
        state(names[:-1] + ["renamed"]),  # a key renamed, same length
        state(names, extra=[7]),  # a wide list grew
        {**state(names), "model": {**state(names)["model"], names[3]: 3}},  # a tensor became an int
        {**state(names), "wide": tuple(state(names)["wide"])},  # namedtuple became a tuple
    ]
    for s in shapes:
        staged = stager.stage(s).result()
        assert_same(staged, snapshot(s))
        assert type(staged["wide"]) is type(s["wide"]) and type(staged["tuple"]) is tuple
        del staged
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False, False, True, True, True, True]
    stager.close()


def test_staging_pointer_check_sees_moved_and_newly_tied_tensors(backend, device):
    # The steady-state check of data pointers (one call of torch's helper where it
    # has one, a map otherwise) must see a tensor moved to another storage, and a
    # save must then keep tensors that became tied tied in the staged dict.
    tensors = [torch.randn(8, device=device) for _ in range(20)]
    ptrs = [t.data_ptr() for t in tensors]
    indices = list(range(len(tensors)))
    same = offload.staging.plan.same_data_ptrs
    assert same(tensors, ptrs, indices)
    assert not same(tensors[:-1], ptrs, indices[:-1])
    moved = tensors[:7] + [tensors[7].clone()] + tensors[8:]
    assert not same(moved, ptrs, indices)
    stager = offload.AsyncStager(ring_size=1)
    a, b = torch.full((4,), 1.0, device=device), torch.full((4,), 2.0, device=device)
    wide = {f"w{i}": torch.full((2,), float(i), device=device) for i in range(10)}
    for state in [{"a": a, "b": b, "wide": wide}] * 3 + [{"a": a, "b": a, "wide": wide}]:
        staged = stager.stage(state).result()
        assert_same(staged, snapshot(state))
        assert (staged["a"] is staged["b"]) == (state["a"] is state["b"])
        del staged
    assert [r["replanned"] for r in stager.metrics()] == [True, False, False, True]
    stager.close()


def test_staging_steady_saves_leave_the_address_check_to_the_copies(backend, device, monkeypatch):
    """Saves into a set bound to the plan compare no address in Python: the refills do
    (copy_to_host's same_sources). A moved tensor is caught by them and the save is redone
    with every tensor checked; the save after it is steady again."""
    from offload.staging import stager as staging

    checked_here, same_sources = [], []
    real_same, real_copy = staging.same_data_ptrs, staging.copy_to_host

    def spy_same(tensors, ptrs, indices):
        checked_here.append((save, len(indices)))
        return real_same(tensors, ptrs, indices)

    def spy_copy(*args, **kwargs):
        same_sources.append((save, kwargs.get("same_sources", False)))
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(staging, "same_data_ptrs", spy_same)
    monkeypatch.setattr(staging, "copy_to_host", spy_copy)
    stager = offload.AsyncStager(ring_size=1)
    state = {f"w{i}": torch.randn(64, device=device) for i in range(50)}
    for save in range(6):
        if save == 3:
            state["w7"] = state["w7"].clone()  # same shape and dtype, another storage
        state["w3"].add_(1)
        staged = stager.stage(state).result()
        assert_same(staged, snapshot(state))
        del staged
    stager.close()
    assert [s for s, _ in checked_here] == [3]  # only the redone save compares every address here
    assert {s for s, flag in same_sources if flag} == {1, 2, 3, 4, 5}  # save 3: its first try
    assert [flag for s, flag in same_sources if s == 3] == [True, False]
    assert [r["buffers_allocated"] for r in stager.metrics()] == [50, 0, 0, 0, 0, 0]
