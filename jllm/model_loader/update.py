"""Weight updates into a running model's parameters: the trainer's push of an RL loop.

A `WeightUpdate` collects tensors under the checkpoint's Hugging Face names (any number of
`add` calls: chunks) and builds the new parameters only at `build`, so a bad tensor (a name
the model does not have, a wrong shape, a non-float dtype) is refused before anything the
engine serves changes. Each tensor takes the loader's road (model_loader/loader.py: renames,
fused tensors split, transposed to our layout, kv heads repeated, quantized where the engine
is fp8 or int8), but a `jax.Array` stays on its devices: its conversion and quantization run
there, and it reaches the parameter's sharding by a device-to-device `jax.device_put`, never
through host memory. Layers of a stacked parameter (and experts of stacked experts) are
written into its rows on the device by one jitted scatter that donates the old array, so an
update never holds a second copy of a whole stack; layers not sent keep their values.

`native` takes the engine's own parameter state (what `LLM.get_weights()` returns, leaves
replaced): each leaf of the same shape and dtype is adopted as it is when it already has the
parameter's sharding (zero copies), else resharded on the devices.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jllm.model_loader.loader import (
    _dotted,
    _expert_weight,
    _host_weight,
    _map_name,
    _split_fused,
    _Target,
    abstract_model,
    as_array,
)
from jllm.models.registry import IGNORED
from jllm.quantization.weights import QuantizedWeight
from sharding import named_sharding, param_axes

logger = logging.getLogger(__name__)


class UpdateTarget:
    """What updates map onto, built once per engine: the abstract model's parameters (their
    metadata says how each is stored) and the architecture's weight maps."""

    def __init__(self, arch, cfg, dtype, mesh, kv_replicas: int, quantization: str | None):
        model = abstract_model(arch, cfg, dtype)
        flat = {
            p: v
            for p, v in nnx.to_flat_state(nnx.split(model)[1])
            if not v.get_metadata().get("kv_scale")
        }
        shardings = {
            p: named_sharding(mesh, param_axes(v), v.shape, _dotted(p)) for p, v in flat.items()
        }
        self.target = _Target(model, flat, shardings, mesh, dtype, quantization, False, kv_replicas)
        self.arch, self.cfg = arch, cfg
        self.layer_weights = arch.layer_weights(cfg)
        self.fused = arch.fused_weights(cfg)


def _check_float(name: str, w) -> None:
    """ValueError unless `w` (numpy, torch or jax) holds floating-point values."""
    dtype = w.dtype
    if type(w).__module__.startswith("torch"):
        floating = w.is_floating_point()
    else:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    if not floating:
        raise ValueError(f"update_weights: {name} is {dtype}, not a floating-point tensor.")


class WeightUpdate:
    """One update session's tensors, converted as they arrive and applied by `build`."""

    def __init__(self, target: UpdateTarget):
        self.target = target
        # path -> new value (a whole parameter), or path -> {row index: value} (rows of a
        # stacked parameter: (layer,) or (layer, expert)).
        self.whole: dict[tuple, object] = {}
        self.rows: dict[tuple, dict[tuple, object]] = {}
        self.native: dict[tuple, jax.Array] = {}
        self.count = 0

    def add(self, weights) -> None:
        """Convert and keep `weights`: (name, tensor) pairs or a mapping, at the checkpoint's
        names; ValueError naming the first tensor the model cannot take."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        t = self.target
        for name, w in items:
            if not isinstance(name, str):
                raise ValueError(f"update_weights: a tensor name must be a string, got {name!r}.")
            renamed = t.arch.rename(name)
            if renamed is None or IGNORED.fullmatch(renamed):
                continue
            _check_float(name, w)
            for part, piece in _split_fused(renamed, as_array(w), t.fused):
                self._add_one(name, part, piece)
            self.count += 1

    def _add_one(self, given: str, name: str, w) -> None:
        t, tt = self.target, self.target.target
        try:
            mapped = _map_name(name, t.layer_weights, t.arch.top_weights, tt.model.layer_slot)
        except IndexError:  # a layer past the model's
            mapped = None
        if mapped is None:
            raise ValueError(f"update_weights: {given} is not a weight of this model.")
        path, layer, kind, expert = mapped
        if path not in tt.flat:
            if path == ("lm_head", "weight") and t.cfg.tie_word_embeddings:
                return  # tied: the embedding is the head
            raise ValueError(f"update_weights: {given} has no place in this model.")
        if layer is None and expert is None:
            self.whole[path] = _host_weight(tt, given, w, path, None, kind)
            return
        if not 0 <= layer < tt.flat[path].shape[0]:
            raise ValueError(f"update_weights: {given}: the model has no such layer.")
        if expert is not None:
            if not 0 <= expert < tt.flat[path].shape[1]:
                raise ValueError(f"update_weights: {given}: the model has no expert {expert}.")
            value, index = _expert_weight(tt, given, w, path, kind), (layer, expert)
        else:
            value, index = _host_weight(tt, given, w, path, layer, kind), (layer,)
        self.rows.setdefault(path, {})[index] = value

    def add_native(self, state, current: dict) -> None:
        """The engine's own parameter state (`get_weights()`'s, leaves replaced): every leaf
        must match the current parameter's shape and dtype."""
        flat = state if isinstance(state, dict) else dict(nnx.to_flat_state(state))
        for path, var in flat.items():
            value = var.get_value() if isinstance(var, nnx.Variable) else var
            name = _dotted(path)
            if path not in current:
                raise ValueError(f"update_weights: {name} is not a parameter of this engine.")
            old = current[path]
            for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(old), strict=True):
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise ValueError(
                        f"update_weights: {name} is {a.dtype}{list(a.shape)}, the engine's "
                        f"is {b.dtype}{list(b.shape)}."
                    )
            self.native[path] = value
            self.count += 1

    def paths(self) -> set:
        return set(self.whole) | set(self.rows) | set(self.native)

    def build(self, current: dict) -> dict:
        """The new value of every parameter this session touched, on its sharding. `current`:
        path -> the engine's value now (whose shardings the new values take; the rows of a
        stacked parameter not sent are kept from it). The old arrays of written rows are
        donated: the caller installs every returned value."""
        out = {}
        for path, value in self.native.items():
            out[path] = jax.tree.map(_to_sharding, value, current[path])
        for path, value in self.whole.items():
            out[path] = _place_like(value, current[path])
        for path, rows in self.rows.items():
            out[path] = _write_rows(current[path], rows)
        return out


def _to_sharding(new: jax.Array, old: jax.Array) -> jax.Array:
    if isinstance(new, jax.Array) and new.sharding == old.sharding:
        return new  # adopted as it is: zero copies
    return _place_like(new, old)


def _place_like(value, old):
    """`value` (numpy or a jax.Array anywhere; a QuantizedWeight of them) on `old`'s
    shardings."""
    if isinstance(value, QuantizedWeight):
        return jax.tree.map(_place_like, value, old)
    if isinstance(value, jax.Array):
        return jax.device_put(value.astype(old.dtype), old.sharding)
    host = np.asarray(value, old.dtype)
    return jax.make_array_from_callback(host.shape, old.sharding, lambda i: host[i])


def _value_sharding(old: jax.Array, lead: int) -> NamedSharding:
    """`old`'s sharding without its first `lead` axes: the layout of one row's value."""
    spec = tuple(old.sharding.spec) + (None,) * (old.ndim - len(old.sharding.spec))
    return NamedSharding(old.sharding.mesh, PartitionSpec(*spec[lead:]))


@jax.jit(donate_argnums=0)
def _scatter(old, index, values):
    """`old` with `values[i]` at row `index[i]` (a layer, or a (layer, expert) pair)."""
    return old.at[tuple(index.T)].set(jnp.stack(values))


def _write_rows(old, rows: dict):
    """`old` [L, ...] (or [L, E, ...]; a QuantizedWeight of such arrays) with the rows in
    `rows` ({(layer[, expert]): value}) written on its devices; the old arrays donated."""
    if isinstance(old, QuantizedWeight):
        return jax.tree.map(
            lambda o, *vals: _write_array(o, dict(zip(rows, vals, strict=True))),
            old,
            *rows.values(),
        )
    return _write_array(old, rows)


def _write_array(old: jax.Array, rows: dict) -> jax.Array:
    index = np.asarray(list(rows), np.int32)  # [k, 1 or 2]
    sharding = _value_sharding(old, index.shape[1])
    values = [
        _place_like(v, jax.ShapeDtypeStruct(v.shape, old.dtype, sharding=sharding))
        for v in rows.values()
    ]
    index = jax.device_put(index, NamedSharding(sharding.mesh, PartitionSpec()))
    return _scatter(old, index, values)
