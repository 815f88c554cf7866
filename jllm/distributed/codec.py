"""The step channel's wire format: data only, never code.

A message is msgpack (maps, lists, strings, numbers, bytes, None) with numpy arrays as an
extension type whose payload is [dtype name, shape, raw bytes]; the dtype must be one of a
short list, and the bytes must be exactly the shape's. Decoding builds nothing but those
values, so a peer (or anyone who reaches the socket) cannot make the receiver run code, as
unpickling would (vLLM's multi-node advisory, CVE-2025-30165, was pickle over its channel).
Anything else is a `MalformedMessage`.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np

_ARRAY = 1  # msgpack extension type code of a numpy array
DTYPES = frozenset({"bool", "uint8", "int32", "int64", "float32", "bfloat16", "float16"})


class MalformedMessage(ValueError):
    """A step-channel message that does not decode to the schema's data."""


def _default(obj):
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in DTYPES:
            raise TypeError(f"the step channel does not carry {obj.dtype.name} arrays")
        payload = [obj.dtype.name, list(obj.shape), np.ascontiguousarray(obj).tobytes()]
        return msgpack.ExtType(_ARRAY, msgpack.packb(payload))
    if isinstance(obj, np.integer | np.floating | np.bool_):
        return obj.item()
    raise TypeError(f"the step channel does not carry {type(obj).__name__}")


def _ext_hook(code: int, data: bytes):
    if code != _ARRAY:
        raise MalformedMessage(f"unknown extension type {code}")
    try:
        name, shape, raw = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise MalformedMessage(f"an array that does not decode: {e}") from e
    if name not in DTYPES or not isinstance(shape, list) or not isinstance(raw, bytes):
        raise MalformedMessage(f"an array of dtype {name!r} is not part of the schema")
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise MalformedMessage(f"an array of shape {shape!r}")
    dtype = _dtype(name)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise MalformedMessage(f"an array of shape {shape} with {len(raw)} bytes")
    return np.frombuffer(raw, dtype).reshape(shape).copy()


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def encode(message) -> bytes:
    return msgpack.packb(message, default=_default, use_bin_type=True)


def decode(data: bytes):
    try:
        return msgpack.unpackb(data, raw=False, ext_hook=_ext_hook, strict_map_key=True)
    except MalformedMessage:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise MalformedMessage(f"not a step-channel message: {e}") from e


def expect_array(value, dtype: str, ndim: int, what: str, shape: tuple | None = None):
    """`value` when it is a numpy array of `dtype` with `ndim` axes (and `shape`, where a
    dimension of None takes any size); MalformedMessage naming `what` otherwise."""
    if not isinstance(value, np.ndarray) or value.dtype.name != dtype or value.ndim != ndim:
        raise MalformedMessage(f"step message: {what} is not a {ndim}-d {dtype} array")
    if shape is not None and any(
        s is not None and s != n for s, n in zip(shape, value.shape, strict=True)
    ):
        raise MalformedMessage(f"step message: {what} has shape {value.shape}, not {shape}")
    return value


def expect_ints(value, what: str, length: int | None = None) -> list[int]:
    """`value` when it is a list of integers (of `length`); MalformedMessage otherwise."""
    if (
        not isinstance(value, list)
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        or (length is not None and len(value) != length)
    ):
        raise MalformedMessage(f"step message: {what} is not a list of integers")
    return value


def expect_indexed(value, what: str, lo: int, hi: int) -> tuple[int, object]:
    """(index, payload) of `value` when it is [an integer in [lo, hi), payload] (a write to
    a row or a slot); MalformedMessage naming `what` otherwise."""
    if not isinstance(value, list) or len(value) != 2 or type(value[0]) is not int:
        raise MalformedMessage(f"step message: {what} is not [index, data]")
    if not lo <= value[0] < hi:
        raise MalformedMessage(f"step message: {what} to index {value[0]}")
    return value[0], value[1]


def expect_list(value, what: str) -> list:
    if not isinstance(value, list):
        raise MalformedMessage(f"step message: {what} is not a list")
    return value
