"""What a receiver keeps of each tensor (`WeightReceiver(slices=...)`): a tensor-parallel rank's
slice `(dim, start, stop)` of the full tensor, or the whole tensor."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..core.checks import is_int

Slice = Tuple[int, int, int]  # (dim, start, stop) of the full tensor


def check_slices(fn: str, slices):
    """None, a callable (name, full_shape) -> (dim, start, stop) or None, or a mapping name -> (dim, start, stop)."""
    if slices is None or callable(slices):
        return slices
    if not hasattr(slices, "items"):
        raise TypeError(f"{fn}: slices must be a mapping name -> (dim, start, stop), a callable (name, full_shape) "
                        f"-> (dim, start, stop) or None, or None, got {type(slices).__name__}")
    for name, spec in slices.items():
        check_slice(fn, name, spec)
    return dict(slices)


def check_slice(fn: str, name: str, spec) -> Optional[Slice]:
    if spec is None:
        return None
    if not (isinstance(spec, (tuple, list)) and len(spec) == 3 and all(is_int(v) for v in spec)):
        raise TypeError(f"{fn}: the slice of tensor {name!r} must be (dim, start, stop), three ints, or None for "
                        f"the whole tensor, got {spec!r}")
    dim, start, stop = spec
    if dim < 0 or start < 0 or stop < start:
        raise ValueError(f"{fn}: the slice of tensor {name!r} must have dim >= 0 and 0 <= start <= stop, got "
                         f"(dim={dim}, start={start}, stop={stop})")
    return int(dim), int(start), int(stop)


class Slices:
    """A receiver's slices (checked by `check_slices`), each looked up once per tensor name and full shape."""

    def __init__(self, slices):
        self.slices = slices
        self._wanted: Dict[Tuple[str, Tuple[int, ...]], Optional[Slice]] = {}

    def want(self, fn: str, name: str, shape: Tuple[int, ...]) -> Optional[Slice]:
        """The slice of tensor `name` (of full shape `shape`) to keep, or None for all of it; a slice outside
        the shape is a ValueError naming the tensor."""
        key = (name, shape)
        if key not in self._wanted:
            if self.slices is None:
                spec = None
            elif callable(self.slices):
                spec = check_slice(fn, name, self.slices(name, shape))
            else:
                spec = self.slices.get(name)
            if spec is not None and (spec[0] >= len(shape) or spec[2] > shape[spec[0]]):
                raise ValueError(f"{fn}: the slice of tensor {name!r} (dim={spec[0]}, start={spec[1]}, "
                                 f"stop={spec[2]}) is outside its full shape {list(shape)}")
            self._wanted[key] = spec
        return self._wanted[key]

    def out_shape(self, fn: str, name: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        """The shape a receiver holds of tensor `name`: its slice's, or the full `shape`."""
        spec = self.want(fn, name, shape)
        if spec is None:
            return shape
        dim, start, stop = spec
        return shape[:dim] + (stop - start,) + shape[dim + 1:]
