"""Weight updates into a running model's parameters: the trainer's push of an RL loop.

A `WeightUpdate` collects tensors under the checkpoint's Hugging Face names (any number of
`add` calls: chunks) and builds the new parameters only at `build`, so a bad tensor (a name
the model does not have, a wrong shape, a non-float dtype) is refused before anything the
engine serves changes. Each tensor takes the loader's road (model_loader/loader.py: renames,
fused tensors split, transposed to our layout, kv heads repeated, quantized where the engine
is fp8 or int8), but a `jax.Array` stays on its devices: its conversion and quantization run
there, and it reaches the parameter's sharding device to device, never through host
memory. Each layer of a stacked parameter (each expert of stacked experts) is written into
its row in place by a jitted program that donates the old array, so an update never holds a
second copy of a whole stack; layers not sent keep their values.

`native` takes the engine's own parameter state (what `LLM.get_weights()` returns, leaves
replaced): each leaf of the same shape and dtype is adopted as it is when it already has the
parameter's sharding (zero copies), else resharded on the devices. An adopted leaf stays
the trainer's: the engine borrows it (runner/weight_sync.py), so nothing here donates it;
a later row write copies it first.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

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
    _Target,
    abstract_model,
    as_array,
    checkpoint_tensors,
)


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
        # The conversions read the parameters' metadata only: the live arrays' shardings are
        # what new values take (`WeightUpdate.build`), none are computed here.
        self.target = _Target(model, flat, {}, mesh, dtype, quantization, False, kv_replicas)
        self.arch, self.cfg = arch, cfg
        self.layer_weights = arch.layer_weights(cfg)
        self.checked: set = set()  # (recipe, shape, dtype) of tensors already checked


def _check_float(name: str, w) -> None:
    """ValueError unless `w` (numpy, torch or jax) holds floating-point values."""
    dtype = w.dtype
    if type(w).__module__.startswith("torch"):
        floating = w.is_floating_point()
    else:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    if not floating:
        raise ValueError(f"update_weights: {name} is {dtype}, not a floating-point tensor.")


def _convert(target: UpdateTarget, recipe: tuple, w):
    """One tensor in our layout: `recipe` = (a name for messages, parameter path, whether
    it is a row of a layer stack, whether of stacked experts, kind), as mapped."""
    name, path, layered, expert, kind = recipe
    if expert:
        return _expert_weight(target.target, name, w, path, kind)
    return _host_weight(target.target, name, w, path, 0 if layered else None, kind)


class WeightUpdate:
    """One update session's tensors, checked as they arrive, converted and placed by
    `build`: one jitted program per parameter and row shape (conversion and the in-place
    write of a row), cached across updates of the same shapes."""

    def __init__(self, target: UpdateTarget):
        self.target = target
        # path -> {row index: (tensor as given, its recipe)}: () for a whole parameter,
        # (layer,) or (layer, expert) for rows of a stacked one.
        self.raw: dict[tuple, dict[tuple, tuple]] = {}
        self.native: dict[tuple, jax.Array] = {}
        self.count = 0

    def add(self, weights) -> None:
        """Check and keep `weights`: (name, tensor) pairs or a mapping, at the checkpoint's
        names; ValueError naming the first tensor the model cannot take. The chunk takes the
        loader's road as one stream (`checkpoint_tensors`: renames, the family's regrouping,
        fused tensors split, drafting layers and ignored names skipped), so a family whose
        regrouping reads several tensors together sees what the chunk holds of them."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        t = self.target
        given = [None]  # the name of the tensor the stream read last, for messages

        def read():
            for name, w in items:
                if not isinstance(name, str):
                    raise ValueError(
                        f"update_weights: a tensor name must be a string, got {name!r}."
                    )
                given[0] = name
                self.count += 1
                yield name, as_array(w)

        for name, w in checkpoint_tensors(t.target, t.arch, t.cfg, read()):
            label = name if name == given[0] else f"{name} (of {given[0]})"
            _check_float(label, w)
            self._add_one(label, name, w)
        self._refuse_kv_scales()

    def _refuse_kv_scales(self) -> None:
        """A float8 KV cache's scales are fixed when the engine starts (its compiled steps
        read them as they were loaded): an update cannot change them."""
        scales = self.target.target.checkpoint_scales
        if scales:
            layers = sorted({layer for layer, _ in scales})
            scales.clear()
            raise ValueError(
                f"update_weights: KV-cache scales (layers {layers}) cannot be updated: the "
                "float8 KV cache keeps the scales it was started with."
            )

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
        index: tuple = ()
        if layer is not None:
            if not 0 <= layer < tt.flat[path].shape[0]:
                raise ValueError(f"update_weights: {given}: the model has no such layer.")
            index = (layer,)
        if expert is not None:
            if not 0 <= expert < tt.flat[path].shape[1]:
                raise ValueError(f"update_weights: {given}: the model has no expert {expert}.")
            index = (layer, expert)
        # What converts it, the same for every layer's (so one program serves them all).
        recipe = (_dotted(path), path, layer is not None, expert is not None, kind)
        # The conversion traced on the shape alone (nothing computed yet): a tensor that
        # does not map onto the parameter fails here. Once per recipe and shape.
        try:
            key = (recipe, tuple(w.shape), jnp.dtype(w.dtype))
            if key not in t.checked:
                abstract = jax.ShapeDtypeStruct(w.shape, w.dtype)
                jax.eval_shape(partial(_convert, t, recipe), abstract)
                t.checked.add(key)
        except (TypeError, ValueError) as e:
            shape = tt.flat[path].shape[len(index) :]
            raise ValueError(
                f"update_weights: {given} has shape {tuple(w.shape)}, which does not map "
                f"onto {_dotted(path)} ({tuple(shape)} per row): {e}"
            ) from None
        self.raw.setdefault(path, {})[index] = (w, recipe)

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
                if isinstance(a, jax.Array) and a.is_deleted():
                    raise ValueError(
                        f"update_weights: {name} is a deleted array (donated, or the "
                        "engine's own from get_weights() before a sleep or an update)."
                    )
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise ValueError(
                        f"update_weights: {name} is {a.dtype}{list(a.shape)}, the engine's "
                        f"is {b.dtype}{list(b.shape)}."
                    )
            self.native[path] = value
            self.count += 1

    def paths(self) -> set:
        return set(self.raw) | set(self.native)

    def build(self, current: dict, borrowed: frozenset = frozenset()) -> dict:
        """The new value of every parameter this session touched, on its sharding. `current`:
        path -> the engine's value now (whose shardings the new values take; the rows of a
        stacked parameter not sent are kept from it). The old arrays of written rows are
        donated, but for the `borrowed` paths' (a trainer's arrays, adopted by a native
        update), which are copied first: the caller installs every returned value."""
        out = dict(self.native)  # placed below, like the rest
        for path, rows in self.raw.items():
            old = current[path]
            shardings = tuple(a.sharding for a in jax.tree.leaves(old))
            mesh = shardings[0].mesh
            raws = [_on_mesh(w, mesh) for w, _ in rows.values()]
            recipes = tuple(recipe for _, recipe in rows.values())
            if list(rows) == [()]:  # a whole parameter
                out[path] = _assemble_whole(
                    raws[0], target=self.target, recipe=recipes[0], shardings=shardings
                )
                continue
            # Row by row into the old array, donated: one pass over the new weights.
            new = jax.tree.map(jnp.copy, old) if path in borrowed else old
            for (index, (_, recipe)), raw in zip(rows.items(), raws, strict=True):
                new = _write_row(
                    new,
                    raw,
                    np.asarray(index, np.int32),
                    target=self.target,
                    recipe=recipe,
                    shardings=shardings,
                )
            out[path] = new
        # Each on the parameter's own sharding object: a leaf already there comes back as
        # it is (a native leaf adopted with no copy; a program's output that names an
        # equivalent sharding, P() for P("model", None) on one device, moves nothing).
        return {
            path: jax.tree.map(lambda n, o: jax.device_put(n, o.sharding), value, current[path])
            for path, value in out.items()
        }


def _on_mesh(w, mesh):
    """A given tensor where the engine's program can read it: numpy as it is (copied in by
    the call); a jax.Array on other devices than the mesh's, replicated onto the mesh's
    (device to device)."""
    if not isinstance(w, jax.Array) or w.sharding.device_set <= set(mesh.devices.flat):
        return w
    return jax.device_put(w, NamedSharding(mesh, PartitionSpec()))


def _constrain(tree, shardings: tuple):
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef,
        [jax.lax.with_sharding_constraint(a, s) for a, s in zip(leaves, shardings, strict=True)],
    )


@partial(jax.jit, static_argnames=("target", "recipe", "shardings"))
def _assemble_whole(raw, *, target, recipe, shardings):
    """A whole parameter converted from its one tensor, on its sharding."""
    return _constrain(_convert(target, recipe, raw), shardings)


@partial(jax.jit, static_argnames=("target", "recipe", "shardings"), donate_argnums=0)
def _write_row(old, raw, index, *, target, recipe, shardings):
    """`old` [L, ...] (or [L, E, ...]; a QuantizedWeight of such arrays) with the raw
    tensor converted into row `index` ([layer] or [layer, expert]), in place."""
    value = _convert(target, recipe, raw)

    def put(o, v):
        lead = index.shape[0]
        start = (*index, *([0] * (o.ndim - lead)))
        return jax.lax.dynamic_update_slice(o, v.astype(o.dtype)[(None,) * lead], start)

    return _constrain(jax.tree.map(put, old, value), shardings)
