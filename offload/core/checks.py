"""Argument checks shared by every public function.

Each check names the public function (`fn`, e.g. "offload.AsyncStager") and the
argument, says what was expected and what arrived, and raises at the call: a wrong
type is a TypeError, a value out of range a ValueError.
"""

from __future__ import annotations

import numbers
import re

import torch

from . import _device

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}


def is_int(value) -> bool:
    """An int that is not a bool (True is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(fn: str, name: str, value, minimum: int = 0, meaning: str = "") -> int:
    """`value` as an int >= `minimum`; `meaning` (optional) says what the argument counts."""
    why = f" ({meaning})" if meaning else ""
    if not is_int(value):
        raise TypeError(f"{fn}: {name} must be an int >= {minimum}{why}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{fn}: {name} must be an int >= {minimum}{why}, got {value!r}")
    return value


def check_bool(fn: str, name: str, value) -> bool:
    """`value` as a flag: True or False (a tensor's truth or a string's is never what was meant)."""
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def storage_bytes_needed(t: torch.Tensor) -> int:
    """The bytes of its storage that a strided tensor reaches: up to its last element's end."""
    if t.numel() == 0:
        return 0
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def check_has_data(fn: str, what: str, t: torch.Tensor) -> None:
    """ValueError where `t`'s storage holds fewer bytes than `t` spans: a parameter parked by
    `offload.offload_params` (its storage freed while it keeps its shape), read as if it held its
    values, would crash or read freed memory (Note [parked reads])."""
    if t.layout != torch.strided or t.is_meta or t.numel() == 0:
        return
    held = t.untyped_storage().nbytes()
    needed = storage_bytes_needed(t)
    if held < needed:
        raise ValueError(
            f"{fn}: {what} has no data: its storage holds {held} bytes but the tensor reaches {needed}. A "
            "parameter parked by offload.offload_params keeps its shape while its values are on the host; "
            "call offload.reload_params(module) first, or read module.state_dict(), which gives the parked "
            "values from the host")


def parse_bytes(value, what: str) -> int:
    """'8GiB', '512M', '1.5e9' or an int -> bytes; `what` names the function and argument."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"{what}: expected a number of bytes (an int, or a string such as '8GiB'), "
                        f"got {type(value).__name__} {value!r}")
    if isinstance(value, int):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"{what}: expected bytes such as 8589934592, '8GiB' or '512MB', got {value!r}")
        number = int(float(match.group(1)) * _UNITS[unit])
    if number < 0:
        raise ValueError(f"{what}: must be >= 0 bytes, got {number}")
    return number


def resolve_device(fn: str, device) -> torch.device:
    """`device` (None: the current accelerator, or cpu; a torch.device, 'cuda:0', an index)
    normalised, or an error naming `fn` and the argument."""
    if device is not None and not isinstance(device, (str, torch.device)) and not is_int(device):
        raise TypeError(f"{fn}: device must be a torch.device, a device string, an index or None, "
                        f"got {type(device).__name__}")
    try:
        resolved = _device.normalize_device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{fn}: device {device!r} is not a device torch knows here ({e})") from None
    if _device.is_accelerator(resolved):
        count = _device.device_count(resolved.type)
        if resolved.index is None or not 0 <= resolved.index < count:
            raise ValueError(f"{fn}: device {device!r} names {resolved}, but torch sees {count} "
                             f"{resolved.type} device(s) here")
    return resolved


def resolve_copy_device(fn: str, device) -> torch.device:
    """`device` as `resolve_device` gives it, refused unless offload copies there: the
    accelerator torch has here, or the cpu (never meta, nor a device of another backend)."""
    resolved = resolve_device(fn, device)
    accelerator = _device.accelerator_type()
    if resolved.type not in ("cpu", accelerator):
        allowed = f"{accelerator} or cpu" if accelerator else "cpu (torch here has no accelerator)"
        raise ValueError(f"{fn}: device {device!r} is not a device offload copies to; expected {allowed}")
    return resolved


def check_stream(fn: str, stream, name: str = "stream") -> None:
    """`stream` is None (the current stream) or a stream of the accelerator (anything a copy can
    be ordered on: it has `wait_event` and `synchronize`)."""
    if stream is not None and not (hasattr(stream, "wait_event") and hasattr(stream, "synchronize")):
        raise TypeError(f"{fn}: {name} must be a stream of the accelerator or None, got {type(stream).__name__}")
