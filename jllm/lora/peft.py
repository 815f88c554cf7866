"""A PEFT LoRA adapter folder read on the host and converted to the engine's layout.

PEFT saves `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, `use_rslora`, ...) and
`adapter_model.safetensors` with, per targeted projection of layer i,
`base_model.model.model.layers.{i}.{module}.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r]. The delta of a projection is `scaling * B @ A` with `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with rsLoRA), so here each module becomes, stacked over the layers,
A [L, *in, R] and B [L, R, *out] in the base weight's own axes (`Linear`'s), ranks padded
with zeros to the engine's `max_lora_rank` R and the scaling folded into B. A folder is
checked against the base model before anything reaches the device: the rank, the target
modules, each tensor's shape (an adapter for another base fails there), and what jllm does
not implement (DoRA, trained biases, `modules_to_save`) is refused by name. Only safetensors
are read: a pickled `adapter_model.bin` is refused, never unpickled.

The adapter's identity for the prefix cache is a digest of its files' bytes, so a block
computed under one adapter is never a hit for another, the base model, or the same name
reloaded with other weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

_TENSOR = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight"
)


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """A projection an adapter may target: its path in a decoder layer and its weight's axes
    (`Linear`'s layout: `contract` input axes, then the output axes)."""

    path: tuple[str, ...]  # e.g. ("self_attn", "q_proj")
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    kv_replicas: int = 1  # output heads repeated (k/v under tensor parallelism)

    @property
    def name(self) -> str:
        return self.path[-1]


@dataclasses.dataclass
class LoraAdapter:
    """An adapter in the engine's layout: per module name (A [L, *in, R], B [L, R, *out]),
    float32, the scaling folded into B; modules it does not target are absent (zero)."""

    name: str
    int_id: int
    path: str
    digest: bytes
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    request: object = None  # the LoRARequest it was loaded for (outputs name it)


def _config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter path {str(folder)!r} is not a directory.")
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {str(folder)!r} has no adapter_config.json.")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {str(folder)!r}: adapter_config.json: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {str(folder)!r}: adapter_config.json is not an object.")
    return config


def _check_config(config: dict, where: str, max_rank: int) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not a LoRA adapter.")
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save")):
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported by jllm's LoRA.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: trained biases (bias={config['bias']!r}) are not supported.")
    if config.get("alpha_pattern"):
        raise ValueError(f"{where}: per-module lora_alpha (alpha_pattern) is not supported.")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: adapter_config.json has no positive integer rank r.")
    ranks = [r, *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise ValueError(
            f"{where}: LoRA rank {max(ranks)} is greater than max_lora_rank {max_rank}."
        )


def _digest(folder: Path, files: list[Path]) -> bytes:
    h = hashlib.sha256(b"jllm-lora-v1")
    for path in files:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.digest()


def load_peft_adapter(
    name: str,
    int_id: int,
    path: str,
    targets: dict[str, LoraTarget],
    num_layers: int,
    max_rank: int,
    rows=None,
) -> LoraAdapter:
    """Read and check the PEFT folder `path` against the base model's `targets` (module name
    -> LoraTarget); `rows` (models/lora.adapter_rows) moves a module's path and B rows to the
    model's layout. Raises ValueError saying what is wrong."""
    folder = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    config = _config(folder)
    _check_config(config, where, max_rank)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        bin_only = (folder / "adapter_model.bin").is_file()
        why = " (adapter_model.bin is a pickle, which jllm never loads)" if bin_only else ""
        raise ValueError(f"{where} has no adapter_model.safetensors{why}.")
    declared = config.get("target_modules")
    if isinstance(declared, (list, tuple)):
        unknown = sorted({str(m).split(".")[-1] for m in declared} - set(targets))
        if unknown:
            raise ValueError(
                f"{where}: target modules {unknown} are not in this model's LoRA targets "
                f"({sorted(targets)})."
            )
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors' own errors: a truncated or foreign file
        raise ValueError(f"{where}: adapter_model.safetensors cannot be read: {e}") from None
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _TENSOR.fullmatch(key)
        if m is None:
            raise ValueError(f"{where}: tensor {key} has no place in this model's LoRA targets.")
        layer = int(m.group(1))
        if layer >= num_layers:
            raise ValueError(
                f"{where}: tensor {key} is for layer {layer} of a {num_layers}-layer model."
            )
        found.setdefault((layer, m.group(2)), {})[m.group(3)] = value
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for (layer, given), ab in found.items():
        path = given
        if rows is not None and "B" in ab:  # the family's names and row order (Llama 4)
            moved = rows(layer, given, ab["B"])
            path, ab = ("", ab) if moved is None else (moved[0], {**ab, "B": moved[1]})
        module = path.split(".")[-1]
        if module not in targets or targets[module].path != tuple(path.split(".")):
            key = f"base_model.model.model.layers.{layer}.{given}"
            raise ValueError(f"{where}: tensor {key} has no place in this model's LoRA targets.")
        parts[(layer, module)] = ab
    alpha = float(config.get("lora_alpha", config["r"]))
    rslora = bool(config.get("use_rslora", False))
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for (layer, module), ab in sorted(parts.items()):
        t = targets[module]
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} lacks its lora_A or lora_B.")
        a, b = ab["A"].astype(np.float32), ab["B"].astype(np.float32)
        n_in, n_out = math.prod(t.in_shape), math.prod(t.out_shape) // t.kv_replicas
        r = a.shape[0]
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise ValueError(
                f"{where}: layer {layer} {module} has lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)}; this base model needs [r, {n_in}] and [{n_out}, r] "
                "(an adapter for another model?)."
            )
        scaling = alpha / (math.sqrt(r) if rslora else r)
        bt = (b.T * scaling).reshape(r, t.out_shape[0] // t.kv_replicas, *t.out_shape[1:])
        if t.kv_replicas > 1:  # each kv head repeated as the base weight's are
            bt = np.repeat(bt, t.kv_replicas, axis=1)
        if module not in weights:
            weights[module] = (
                np.zeros((num_layers, *t.in_shape, max_rank), np.float32),
                np.zeros((num_layers, max_rank, *t.out_shape), np.float32),
            )
        big_a, big_b = weights[module]
        big_a[layer, ..., :r] = a.T.reshape(*t.in_shape, r)
        big_b[layer, :r] = bt
    if not weights:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights.")
    digest = _digest(folder, [folder / "adapter_config.json", weights_path])
    return LoraAdapter(name, int_id, str(path), digest, weights)
