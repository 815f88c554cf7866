"""Build a model abstractly and put each checkpoint weight straight onto its sharding.

The model is created with `nnx.eval_shape` (no memory), then every Hugging Face tensor is
converted to our layout on the host and placed with `jax.device_put` on the sharding its
logical axes map to; nothing is materialised twice on a device.

With `quantization=` a projection's weight becomes a `QuantizedWeight` [Out, In] (transformers'
own row layout) instead: quantized on the host as it is read ("fp8", "tpu_int8"), or kept as
the GGUF file stores it ("gguf"); each of its arrays is placed on the sharding of the axes it
carries (the output axis, then the input axis).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.model_loader import orbax_io
from jllm.model_loader.kv_scales import checkpoint_scale, scale_tensor
from jllm.models.architecture import Architecture
from jllm.models.registry import IGNORED
from jllm.quantization import ONLINE_METHODS
from jllm.quantization.formats import (
    ONLINE_KINDS,
    quantize_channels,
    quantize_online,
    stack_layers,
)
from jllm.quantization.mxfp4 import MXFP4_GROUP
from jllm.quantization.weights import QuantizedWeight
from sharding import named_sharding, param_axes

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Weights with a kv-head axis (repeated when there are fewer kv heads than devices).
_KV_PROJ = ("k_proj", "v_proj")


def _convert(w: np.ndarray, kind: str | None, shape: tuple[int, ...]) -> np.ndarray:
    if kind == "qkv":  # [N*H, D] -> [D, N, H]
        return w.T.reshape(shape)
    if kind == "o":  # [D, N*H] -> [N, H, D]
        return w.T.reshape(shape)
    if kind in ("bias", "heads"):  # [N*H, ...] -> [N, H, ...]
        return w.reshape(shape)
    if kind == "t":
        return w.T
    if kind == "patch":  # a Conv2d (Conv3d) of stride = kernel [E, C, (t,) p, p] -> [C*t*p*p, E]
        return w.reshape(w.shape[0], -1).T
    return w


def _split_fused(name: str, w, fused: dict):
    """[(name, tensor)]: a fused layer tensor (`Architecture.fused_weights`) split by rows
    (the output axis, also a QuantizedWeight's) into its parts, or the tensor as it is."""
    m = _LAYER.fullmatch(name)
    parts = fused.get(m.group(2)) if m else None
    if parts is None:
        return [(name, w)]
    rows = sum(n for _, n in parts)
    if w.shape[0] != rows:
        raise ValueError(f"Checkpoint tensor {name} has {w.shape[0]} rows, expected {rows}.")
    out, start = [], 0
    for part, n in parts:
        piece = jax.tree.map(lambda a, s=start, n=n: a[s : s + n], w)
        out.append((f"model.layers.{m.group(1)}.{part}", piece))
        start += n
    return out


_EXPERT = re.compile(r"(.+)\.experts\.(\d+)\.(.+)")
# A vision-language model's encoder and projector (models/vision.py) sit at transformers'
# names (after `Architecture.rename`); the encoder's layers are stacked.
_VISION = ("vision_tower.", "multi_modal_projector.", "visual.")
_VISION_LAYER = re.compile(r"(vision_tower\.encoder\.layers|visual\.blocks)\.(\d+)\.(.+)")


def _map_name(name: str, layer_weights: dict, top_weights: dict, layer_slot):
    """-> (our parameter path, index in its layer stack or None, conversion kind, expert
    index or None), or None when the architecture does not name the tensor. layer_slot: the
    model's (checkpoint layer -> (stacked module path, index)). A layer weight's entry is a
    layout, or (our name, layout) where our name differs; one expert's tensor
    (`...experts.7.w1.weight`) is named with `*` for its index and goes to its place in the
    stacked experts."""
    if name.startswith(_VISION):  # converted by the parameter's own form (`_host_weight`)
        v = _VISION_LAYER.fullmatch(name)
        if v:
            return (
                (*v.group(1).split("."), *v.group(3).split(".")),
                int(v.group(2)),
                "vision",
                None,
            )
        return tuple(name.split(".")), None, "vision", None
    m = _LAYER.fullmatch(name)
    if m:
        local, expert = m.group(2), None
        e = _EXPERT.fullmatch(local)
        if local not in layer_weights and e:
            local, expert = f"{e.group(1)}.experts.*.{e.group(3)}", int(e.group(2))
        if local not in layer_weights:
            return None
        entry = layer_weights[local]
        ours, kind = entry if isinstance(entry, tuple) else (local, entry)
        prefix, index = layer_slot(int(m.group(1)))
        return (*prefix, *ours.split(".")), index, kind, expert
    if name not in top_weights:
        return None
    path, kind = top_weights[name]
    return path, None, kind, None


def _place(host: np.ndarray, sharding) -> jax.Array:
    """Host array -> device array on `sharding`, each device receiving only its own shard
    (and, with several processes, each process filling only its own devices)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _quantized_axes(var) -> tuple:
    """Logical axes of a QuantizedWeight's arrays: (["layers",] output axis, input axis). A
    Linear's float weight is [in..., out...] with `contract` input axes; the embedding table
    [vocab, embed] is already [Out, In]."""
    meta = var.get_metadata()
    axes, contract = tuple(meta["logical_axes"]), meta.get("contract")
    if meta.get("stacked_experts"):  # [E, In, Out] -> [E, Out, In]
        return ("layers", axes[0], axes[2], axes[1])
    pair = axes if contract is None else (axes[contract], axes[0])
    return ("layers", *pair) if len(axes) < len(var.shape) else pair


def _quantized_in_out(var, layered: bool) -> tuple[int, int]:
    """(Out, In) of the float parameter `var` viewed as a QuantizedWeight."""
    shape = var.shape[1:] if layered else var.shape
    meta = var.get_metadata()
    contract = meta.get("contract")
    if contract is None:  # the embedding table [V, D]
        return shape[0], int(np.prod(shape[1:]))
    return int(np.prod(shape[contract:])), int(np.prod(shape[:contract]))


def _dotted(path) -> str:
    """A parameter's path as the loader names it in messages ("layers.attn.q.kernel")."""
    return ".".join(map(str, path))


def _place_quantized(w: QuantizedWeight, mesh, axes, name: str) -> QuantizedWeight:
    """The codes split as the float weight would be; the scales and offsets likewise where
    their group count divides the devices, else replicated."""

    def put(a, scales: bool):
        return _place(a, named_sharding(mesh, axes, a.shape, name, replicate_uneven=scales))

    offset = None if w.offset is None else put(w.offset, True)
    return dataclasses.replace(
        w, codes=put(w.codes, False), scale=put(w.scale, True), offset=offset
    )


def _stack(weights: list, name: str) -> np.ndarray | QuantizedWeight:
    quantized = sum(isinstance(w, QuantizedWeight) for w in weights)
    if 0 < quantized < len(weights):
        raise ValueError(
            f"{name} is quantized in {quantized} of {len(weights)} layers; jllm needs every "
            "layer's weight in one form (all quantized or none)."
        )
    if quantized:
        return stack_layers(weights)
    return np.stack(weights)


def _repeat_rows(w: QuantizedWeight, kv_replicas: int, heads: int) -> QuantizedWeight:
    """Repeat each kv head's rows (a QuantizedWeight's output channels) kv_replicas times."""

    def repeat(a):
        per_head = a.reshape(heads, -1, a.shape[-1])
        return per_head.repeat(kv_replicas, axis=0).reshape(-1, a.shape[-1])

    return jax.tree.map(repeat, w)


def _dummy(key, shape, dtype, norm: bool, sharding) -> jax.Array:
    """A random weight N(0, 0.02) (ones for a norm), drawn on its devices: an 8B model's
    weights take seconds there, minutes drawn on the host."""

    def draw(key):
        if norm:
            return jnp.ones(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(draw, out_shardings=sharding)(key)


def abstract_model(arch: Architecture, cfg, dtype):
    return nnx.eval_shape(lambda: arch.module(cfg, dtype, nnx.Rngs(0)))


def _dummy_packed(key, var, spec, mesh) -> QuantizedWeight:
    """Random codes in an AWQ/GPTQ checkpoint's form (`spec`: bits and group size), with
    scales that give weights of about N(0, 0.02)'s spread, drawn on the devices: a stacked
    layer weight as `checkpoints.iter_quantized` would give it."""
    out, width = _quantized_in_out(var, True)
    group = width if spec.group_size == -1 else spec.group_size
    if width % group:
        raise ValueError(f"group_size {group} does not divide a weight's {width} inputs.")
    layers, groups = var.shape[0], width // group
    axes = _quantized_axes(var)
    four_bit = spec.bits == 4 and width % 32 == 0
    codes_shape = (layers, out, width // 2 if four_bit else width)
    levels = 1 << spec.bits
    step = 0.02 * np.sqrt(12.0) / levels  # uniform codes: the spread of N(0, 0.02)
    scale_shape = (layers, out, groups)
    shardings = (
        named_sharding(mesh, axes, codes_shape, "a dummy weight's codes"),
        named_sharding(mesh, axes, scale_shape, replicate_uneven=True),
        named_sharding(mesh, axes, scale_shape, replicate_uneven=True),
    )

    def draw(key):
        if four_bit:
            codes = jax.random.bits(key, codes_shape, jnp.uint8)
        else:
            high = levels // 2 if spec.bits == 8 else levels
            low = -levels // 2 if spec.bits == 8 else 0
            codes = jax.random.randint(key, codes_shape, low, high, jnp.int8)
        scale = jnp.full(scale_shape, step, jnp.float32)
        centre = 0.0 if spec.bits == 8 else (levels - 1) / 2
        return codes, scale, jnp.full(scale_shape, -centre * step, jnp.float32)

    codes, scale, offset = jax.jit(draw, out_shardings=shardings)(key)
    if four_bit:
        return QuantizedWeight(codes, scale, offset, "uint4", pack=32)
    return QuantizedWeight(codes, scale, offset, "int8")


def _dummy_mxfp4(key, var, mesh) -> QuantizedWeight:
    """Random MXFP4 experts [L, E, Out, In] (uniform codes, every block's scale 2^-7: weights
    of about N(0, 0.02)'s spread), drawn on the devices."""
    layers, experts, width, out = var.shape  # our [L, E, In, Out]
    axes = _quantized_axes(var)
    codes_shape = (layers, experts, out, width // 2)
    scale_shape = (layers, experts, out, width // MXFP4_GROUP)
    shardings = (
        named_sharding(mesh, axes, codes_shape, "a dummy weight's codes"),
        named_sharding(mesh, axes, scale_shape, replicate_uneven=True),
    )

    def draw(key):
        codes = jax.random.bits(key, codes_shape, jnp.uint8)
        return codes, jnp.full(scale_shape, 127 - 7, jnp.uint8)

    codes, scale = jax.jit(draw, out_shardings=shardings)(key)
    return QuantizedWeight(codes, scale, None, "mxfp4")


def _dummy_quantized(key, var, method: str, mesh, layered: bool, group: int | None = None):
    """Random N(0, 0.02) weights quantized per output channel, drawn and quantized on the
    devices; with `group`, each channel's scale repeated for every `group` inputs (a dummy
    FP8 checkpoint's blocks)."""
    out, width = _quantized_in_out(var, layered)
    shape = (var.shape[0], out, width) if layered else (out, width)
    if var.get_metadata().get("stacked_experts"):  # [L, E, In, Out] -> [L, E, Out, In]
        shape = (*var.shape[:2], var.shape[3], var.shape[2])
    axes = _quantized_axes(var)
    codes_sharding = named_sharding(mesh, axes, shape, "a dummy weight's codes")
    if group is not None and shape[-1] % group:
        raise ValueError(
            f"weight_block_size {group} does not divide a weight's {shape[-1]} inputs."
        )
    scale_shape = (*shape[:-1], 1 if group is None else shape[-1] // group)
    scale_sharding = named_sharding(mesh, axes, scale_shape, replicate_uneven=True)

    def draw(key):
        codes, scale = quantize_channels(0.02 * jax.random.normal(key, shape, jnp.float32), method)
        return codes, jnp.broadcast_to(scale, scale_shape)

    codes, scale = jax.jit(draw, out_shardings=(codes_sharding, scale_sharding))(key)
    return QuantizedWeight(codes, scale, None, ONLINE_KINDS[method])


@dataclasses.dataclass
class _Target:
    """What a load fills: the abstract model's flat parameters and their shardings, and how
    its weights are to be stored."""

    model: object  # the abstract model (its `layer_slot` places checkpoint layers)
    flat: dict  # path -> abstract parameter
    shardings: dict  # path -> NamedSharding
    mesh: object
    dtype: object
    quantization: str | None
    # A quantized checkpoint's method ("awq", "gptq", "fp8", "mxfp4"), else None.
    packed_checkpoint: str | None
    kv_replicas: int
    # The checkpoint's KV-cache scales as read: (layer, "k" | "v") -> factor.
    checkpoint_scales: dict = dataclasses.field(default_factory=dict)

    def online(self, path) -> bool:  # quantized on load ("fp8", "tpu_int8")
        if self.packed_checkpoint:  # an FP8 checkpoint: stored float8, the rest as it is
            return False
        meta = self.meta(path)
        if meta.get("vision"):  # an image encoder's weights stay in the model's dtype
            return False
        quantized = "contract" in meta or meta.get("stacked_experts", False)
        return self.quantization in ONLINE_METHODS and quantized

    def packed(self, path) -> bool:  # a quantized checkpoint's projections (never lm_head)
        meta = self.meta(path)
        experts = meta.get("stacked_experts", False)
        if self.packed_checkpoint == "mxfp4":  # only the experts are
            return experts
        fp8_experts = self.quantization == "fp8" and experts
        return (
            bool(self.packed_checkpoint)
            and _in_layers(path)
            and ("contract" in meta or fp8_experts)
        )

    def meta(self, path) -> dict:
        return self.flat[path].get_metadata()


def _in_layers(path) -> bool:
    """A stacked layer module's weight (the decoder's `layers` or `blocks`)."""
    return path[0] in ("layers", "blocks")


def load_model(
    arch: Architecture,
    cfg,
    source,
    dtype,
    mesh,
    load_format: str = "auto",
    seed: int = 0,
    kv_replicas: int = 1,
    quantization: str | None = None,
    kv_scales: dict[int, float] | None = None,
):
    """Returns (graphdef, state) with every parameter on its target sharding.

    `cfg.num_kv_heads` is the model's count times `kv_replicas`: with fewer kv heads than
    devices each checkpoint kv head is repeated (sharding.kv_head_replicas), so that query
    head h still reads kv head h // (num_heads // num_kv_heads).

    `quantization`: a method resolved by `jllm.quantization.resolve_quantization`; "gguf"
    places the QuantizedWeights the source yields, the online methods quantize every Linear
    weight (parameters with a `contract` axis count), never the embedding.

    A model with KV-cache scales (`cfg.kv_scales`) gets each layer's from the checkpoint's
    scale tensors, else 1.0, and `kv_scales` ({layer: factor}, quantization_param_path's)
    over both its k and v scales; the weight paths (checkpoint, dummy, orbax) never see them."""
    start = time.perf_counter()
    model = abstract_model(arch, cfg, dtype)
    graphdef, abstract_state = nnx.split(model)
    flat = dict(nnx.to_flat_state(abstract_state))
    scale_vars = {p: v for p, v in flat.items() if v.get_metadata().get("kv_scale")}
    shardings = {
        path: named_sharding(mesh, param_axes(var), var.shape, _dotted(path))
        for path, var in flat.items()
    }
    target = _Target(
        model,
        {p: v for p, v in flat.items() if p not in scale_vars},
        shardings,
        mesh,
        dtype,
        quantization,
        getattr(getattr(source, "checkpoint_quantization", None), "method", None),
        kv_replicas,
    )
    if load_format == "dummy":
        values = _dummy_values(target, source, seed)
    elif source.kind == "orbax":  # `jllm convert`'s checkpoint, read shard by shard
        meta = source.orbax_meta
        orbax_io.check(meta, source.path, architecture=arch.name, kv_replicas=kv_replicas)

        def quantized_sharding(path, shape):  # codes, or scales that may not divide
            axes = _quantized_axes(flat[path])
            return named_sharding(mesh, axes, shape, replicate_uneven=True)

        values = orbax_io.restore(
            source.path, meta, target.flat, target.shardings, quantized_sharding
        )
    else:
        values = _checkpoint_values(target, arch, cfg, source)
    if scale_vars:
        given = {(i, part): f for i, f in (kv_scales or {}).items() for part in ("k", "v")}
        values |= _kv_scale_values(
            model, scale_vars, shardings, {**target.checkpoint_scales, **given}
        )
    for path, var in flat.items():
        var.set_value(values[path])
    state = nnx.from_flat_state(flat)
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(values))
    quantized = sum(isinstance(v, QuantizedWeight) for v in values.values())
    logger.info(
        "Loading weights took %.2f seconds; %.3f GiB as stored (%s%s).",
        time.perf_counter() - start,
        nbytes / 2**30,
        jnp.dtype(dtype).name,
        f"; {quantized} weight tensors {quantization}" if quantized else "",
    )
    return graphdef, state


def _dummy_values(t: _Target, source, seed: int) -> dict:
    """Random weights for every parameter, drawn on its devices (`load_format="dummy"`)."""
    flat, mesh, dtype, shardings = t.flat, t.mesh, t.dtype, t.shardings
    quantization = t.quantization
    values: dict[tuple, jax.Array | QuantizedWeight] = {}
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(flat.items()):
        norm = len(path) > 1 and "norm" in path[-2]
        layered = _in_layers(path)
        if t.packed(path):
            spec, k = source.checkpoint_quantization, jax.random.fold_in(key, i)
            if spec.method == "fp8":  # float8 codes, a scale per block of inputs
                group = None if spec.block is None else spec.block[1]
                values[path] = _dummy_quantized(k, var, "fp8", mesh, layered, group)
            elif spec.method == "mxfp4":
                values[path] = _dummy_mxfp4(k, var, mesh)
            else:
                values[path] = _dummy_packed(k, var, spec, mesh)
            continue
        if t.online(path):
            values[path] = _dummy_quantized(
                jax.random.fold_in(key, i), var, quantization, mesh, layered
            )
            continue
        values[path] = _dummy(jax.random.fold_in(key, i), var.shape, dtype, norm, shardings[path])
    return values


def _checkpoint_values(t: _Target, arch: Architecture, cfg, source) -> dict:
    """Every checkpoint tensor converted to our layout (or quantized) and placed; layer
    weights stacked per stacked module as their layers arrive."""
    flat, mesh, shardings, packed_checkpoint = t.flat, t.mesh, t.shardings, t.packed_checkpoint
    values: dict[tuple, jax.Array | QuantizedWeight] = {}
    layered: dict[tuple, dict[int, np.ndarray]] = {}
    experts: dict[tuple, dict[int, np.ndarray]] = {}  # (path, layer) -> expert -> weight
    layer_weights = arch.layer_weights(cfg)
    weights = source.iter_weights(keep_quantized=t.quantization == "gguf")
    for name, w in checkpoint_tensors(t, arch, cfg, weights):
        mapped = _map_name(name, layer_weights, arch.top_weights, t.model.layer_slot)
        extra_bias = name.endswith(".bias") and packed_checkpoint
        if extra_bias and (mapped is None or mapped[0] not in flat):
            # AutoGPTQ saved a (zero) bias for every projection, also in models without
            # biases; vLLM skips such extra biases of GPTQ checkpoints, and so do we.
            continue
        if mapped is None:
            raise ValueError(
                f"Checkpoint tensor {name} is not used by jllm's {arch.name} with this "
                "config; refusing to load the model without it."
            )
        path, layer, kind, expert = mapped
        if path not in flat:
            if path == ("lm_head", "weight") and cfg.tie_word_embeddings:
                continue
            raise ValueError(f"Checkpoint tensor {name} has no place in the model.")
        var = flat[path]
        if expert is not None:  # stacked on the expert axis once the layer has them all
            num_experts = var.shape[1]
            if expert >= num_experts:
                raise ValueError(f"Checkpoint tensor {name}: the model has {num_experts} experts.")
            host = _expert_weight(t, name, w, path, kind)
            got = experts.setdefault((path, layer), {})
            got[expert] = host
            if len(got) < num_experts:
                continue
            host = _stack([got[i] for i in range(num_experts)], name)
            del experts[(path, layer)]
        else:
            host = _host_weight(t, name, w, path, layer, kind)
        if layer is None:
            values[path] = _put(host, var, shardings[path], mesh, _dotted(path))
        else:
            rows = layered.setdefault(path, {})
            rows[layer] = host
            count = var.shape[0]  # the layers of this stack
            padding = t.model.stack_padding(path)  # the empty slots of pipeline stages
            if len(rows) == count - len(padding):
                for row, source in padding.items():
                    rows[row] = rows[source]
                stacked = _stack([rows[i] for i in range(count)], _dotted(path))
                values[path] = _put(stacked, var, shardings[path], mesh, _dotted(path))
                del layered[path]
    for (path, _), got in experts.items():
        absent = sorted(set(range(flat[path].shape[1])) - set(got))
        raise ValueError(f"The checkpoint lacks experts {absent} of {_dotted(path)} in a layer.")
    missing = [".".join(map(str, p)) for p in flat if p not in values]
    if missing:
        raise ValueError(f"The checkpoint lacks weights for: {', '.join(missing[:8])}.")
    return values


def _expert_weight(t: _Target, name: str, w, path, kind):
    """One expert's tensor in our layout ([In, Out], or transformers' [Out, In] quantized
    per output channel) for its place in the stacked experts [L, E, ...]."""
    var = t.flat[path]
    if isinstance(w, QuantizedWeight):  # stored quantized (an FP8 checkpoint's)
        expected, host = (var.shape[3], var.shape[2]), w
    elif t.online(path):
        expected = var.shape[3], var.shape[2]
        host = quantize_weight(w, t.quantization)
    else:
        expected = var.shape[2:]
        host = _convert(as_array(w), kind, expected).astype(t.dtype)
    if tuple(host.shape) != tuple(expected):
        raise ValueError(f"Checkpoint tensor {name} has shape {tuple(w.shape)}.")
    return host


def checkpoint_tensors(t: _Target, arch: Architecture, cfg, weights):
    """A checkpoint's (name, tensor) stream as the weight maps name it: renamed, regrouped
    (`Architecture.regroup`), KV-cache scales taken out (`_without_kv_scales`), fused
    tensors split, and without what the model does not use (ignored names, drafting
    layers). The loader's road, and a weight update's (model_loader/update.py)."""
    fused = arch.fused_weights(cfg)
    weights = arch.regroup(_renamed(arch, weights), cfg)
    # Layers past the decoder's that a config declares for drafting (DeepSeek-V3's MTP
    # layers, `num_nextn_predict_layers`): not part of the model that generates.
    drafting = range(cfg.num_layers, cfg.num_layers + getattr(cfg, "draft_layers", 0))
    for name, w in _fused_parts(_without_kv_scales(weights, t), fused):
        if IGNORED.fullmatch(name):
            continue
        layer_name = _LAYER.fullmatch(name)
        if layer_name is not None and int(layer_name.group(1)) in drafting:
            continue
        yield name, w


def _renamed(arch: Architecture, weights):
    """The checkpoint's tensors under the names the maps use (`Architecture.rename`: a
    vision-language model's language model at the text family's names), without those it
    marks unused."""
    for name, w in weights:
        name = arch.rename(name)
        if name is not None:
            yield name, w


def _without_kv_scales(weights, t: _Target):
    """The checkpoint's tensors but its KV-cache scales (model_loader/kv_scales.py), which
    go to `t.checkpoint_scales` for a model that has scales and are dropped for one that has
    none (a cache that is not float8, where vLLM ignores them too)."""
    ignored, layers = 0, t.model.cfg.num_layers
    for name, w in weights:
        found = scale_tensor(name)
        if found is None:
            yield name, w
            continue
        if not t.model.cfg.kv_scales:
            ignored += 1
            continue
        layer, parts = found
        if layer >= layers:
            raise ValueError(f"Checkpoint tensor {name}: the model has {layers} layers.")
        factor = checkpoint_scale(name, w)
        for part in parts:
            t.checkpoint_scales[layer, part] = factor
    if ignored:
        logger.info(
            "Ignoring the checkpoint's %d KV-cache scales: the cache is not float8.", ignored
        )


def _kv_scale_values(model, scale_vars: dict, shardings: dict, scales: dict) -> dict:
    """Every stacked attention's k_scale and v_scale [L] placed: 1.0 but where `scales`
    ((layer, "k" | "v") -> factor) gives a layer's."""
    stacks = {path: np.ones(var.shape, np.float32) for path, var in scale_vars.items()}
    for (layer, part), factor in scales.items():
        prefix, index = model.layer_slot(layer)
        stacks[(*prefix, "self_attn", f"{part}_scale")][index] = factor
    return {path: _place(host, shardings[path]) for path, host in stacks.items()}


def _fused_parts(weights, fused: dict):
    for name, w in weights:
        yield from _split_fused(name, w, fused)


def _host_weight(t: _Target, name: str, w, path, layer, kind):
    """One checkpoint tensor in our layout on the host (a QuantizedWeight when stored or
    quantized so), its kv heads repeated where there are fewer than devices."""
    var = t.flat[path]
    shape = var.shape[1:] if layer is not None else var.shape
    if kind == "vision":  # transformers' nn.Linear [out, in], Conv2d, or as it is
        linear = "contract" in t.meta(path)
        kind = "patch" if np.ndim(w) >= 4 else ("t" if linear else None)
    kv_replicas = t.kv_replicas
    replicate = kv_replicas > 1 and len(path) > 1 and path[-2] in _KV_PROJ
    if replicate:  # kv-head axis is the one before head_dim
        shape = (*shape[:-2], shape[-2] // kv_replicas, shape[-1])
    if isinstance(w, QuantizedWeight) or t.online(path):
        if not isinstance(w, QuantizedWeight):  # transformers' [out, in] as it is
            w = quantize_weight(w, t.quantization)
        out, width = _quantized_in_out(var, layer is not None)
        out //= kv_replicas if replicate else 1
        if w.shape != (out, width):
            raise ValueError(
                f"Checkpoint tensor {name} has shape {w.shape}, expected {(out, width)}."
            )
        host = _repeat_rows(w, kv_replicas, shape[-2]) if replicate else w
    else:
        host = _convert(as_array(w), kind, shape)
        if host.shape != shape:
            raise ValueError(
                f"Checkpoint tensor {name} has shape {w.shape}, expected one that maps to {shape}."
            )
        if replicate:
            host = host.repeat(kv_replicas, axis=-2)
        # The model's dtype, but for what the module keeps in float32 whatever it is
        # (attention sinks, a router's correction bias).
        host = host.astype(var.dtype if var.dtype == np.float32 else t.dtype)
    return host


def as_array(w):
    """A tensor as an array: a `jax.Array` as it is (where it is), a torch tensor or
    anything else array-like as numpy (torch's bfloat16 through its bits)."""
    if isinstance(w, jax.Array):
        return w
    if type(w).__module__.startswith("torch"):
        w = w.detach().cpu()
        if str(w.dtype) == "torch.bfloat16":
            import ml_dtypes
            import torch

            return w.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return w.numpy()
    return np.asarray(w)


def quantize_weight(w, method: str) -> QuantizedWeight:
    """A float weight [Out, In] quantized per output channel (`quantize_online`); a
    `jax.Array` on its own devices."""
    w = as_array(w)
    if not isinstance(w, jax.Array):
        return quantize_online(np.asarray(w, np.float32), method)
    codes, scale = jax.jit(quantize_channels, static_argnums=1)(w.astype(jnp.float32), method)
    return QuantizedWeight(codes, scale, None, ONLINE_KINDS[method])


def _put(host, var, sharding, mesh, name: str):
    if isinstance(host, QuantizedWeight):
        return _place_quantized(host, mesh, _quantized_axes(var), name)
    return _place(host, sharding)
