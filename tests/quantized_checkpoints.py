"""AWQ and GPTQ checkpoints written from float ones, with the formats' own packing (AutoAWQ's
gemm layout, AutoGPTQ's v1 and GPTQModel's v2 zero points), by min-max rounding: the tests'
quantized checkpoints and their float references (tests/model_loader/test_awq_gptq.py), and
the quantization benchmark's AWQ/GPTQ SmolLM2. Independent of jllm's reader."""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_NIBBLE_OF = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds channel [i]


# The online methods (quantization="fp8" / "tpu_int8"): a channel's absmax maps to 448
# (float8_e4m3fn's largest) or 127 (vLLM's tpu_int8).
BOUND = {"tpu_int8": 127.0, "fp8": 448.0}


def reference_codes(w: np.ndarray, scale: np.ndarray, method: str) -> np.ndarray:
    """The online methods' rounding, in numpy."""
    import ml_dtypes

    ratio = w / scale
    if method == "fp8":
        return ratio.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.clip(np.round(ratio), -128, 127)


def online_values(w: np.ndarray, method: str, axis: int = -1) -> np.ndarray:
    """w's values after the online method's per-output-channel quantization, `axis` the
    input axis each channel's absmax runs over: the float reference for quantization=method."""
    absmax = np.abs(w).max(axis=axis, keepdims=True)
    scale = (np.maximum(absmax, 1e-5) / BOUND[method]).astype(np.float32)
    return (reference_codes(w, scale, method) * scale).astype(np.float32)


def quantize(w: np.ndarray, bits: int, group: int):
    """Asymmetric min-max quantization of w [Out, In] per `group` inputs (-1: per channel):
    codes [Out, In], zero points [Out, G] and float16 scales [Out, G]."""
    out, width = w.shape
    group = width if group == -1 else group
    g = w.reshape(out, width // group, group)
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    top = 2**bits - 1
    scale = np.maximum((hi - lo) / top, 1e-6).astype(np.float16)
    s = scale.astype(np.float64)
    zero = np.clip(np.round(-lo / s), 0, top).astype(np.int64)
    q = np.clip(np.round(g / s[..., None]) + zero[..., None], 0, top).astype(np.int64)
    return q.reshape(out, width), zero, scale


def reference(q, zero, scale) -> np.ndarray:
    """(q - z) * s, in float64 then float32."""
    out, width = q.shape
    groups = zero.shape[1]
    g = q.reshape(out, groups, -1) - zero[..., None]
    return (g * scale.astype(np.float64)[..., None]).reshape(out, width).astype(np.float32)


def words(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack the last axis of small ints, 32 / bits to an int32 word, the first lowest."""
    per = 32 // bits
    v = values.reshape(*values.shape[:-1], -1, per)
    packed = np.zeros(v.shape[:-1], np.uint64)
    for i in range(per):
        packed |= (v[..., i].astype(np.uint64) & (2**bits - 1)) << np.uint64(bits * i)
    return packed.astype(np.uint32).view(np.int32)


def awq_tensors(q, zero, scale) -> dict:
    """AutoAWQ gemm: qweight [In, Out/8], qzeros [G, Out/8], scales [G, Out]."""

    def pack(a):  # [rows, Out]: channel 8c + AWQ_NIBBLE_OF[i] goes to nibble i of word c
        rows, out = a.shape
        order = a.reshape(rows, out // 8, 8)[..., AWQ_NIBBLE_OF]
        return words(order.reshape(rows, out), 4)

    return {"qweight": pack(q.T), "qzeros": pack(zero.T), "scales": scale.T.copy()}


def gptq_tensors(q, zero, scale, bits: int, v1: bool) -> dict:
    """GPTQ: qweight [In*bits/32, Out] (inputs packed), qzeros [G, Out*bits/32] (z - 1 in
    v1), scales [G, Out], g_idx [In]."""
    out, width = q.shape
    stored = zero - 1 if v1 else zero
    return {
        "qweight": words(q, bits).T.copy(),
        "qzeros": words(stored.T, bits),
        "scales": scale.T.copy(),
        "g_idx": (np.arange(width) // (width // zero.shape[1])).astype(np.int32),
    }


def quantize_checkpoint(
    src: str, dest: str, config: dict, reference_dest: str | None = None, zero_biases=False
):
    """Write the float safetensors checkpoint `src` to `dest` as an AWQ or GPTQ checkpoint
    (`config` is its quantization_config: quant_method, bits, group_size, checkpoint_format):
    every layer projection quantized by min-max rounding, every other tensor in float16 as
    such checkpoints store them. `reference_dest`: the same values, dequantized here, as a
    float32 checkpoint (the oracle's). `zero_biases`: also a zero `P.bias` for every
    projection, as some AutoGPTQ versions saved even for models without biases."""
    method, bits = config["quant_method"], config["bits"]
    group = config["group_size"]
    v1 = config.get("checkpoint_format", "gptq") == "gptq"
    tensors, values = {}, {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        for name, w in load_file(path).items():
            prefix = name.removesuffix(".weight")
            if name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in PROJECTIONS:
                q, zero, scale = quantize(w.astype(np.float32), bits, group)
                if method == "awq":
                    parts = awq_tensors(q, zero, scale)
                else:
                    parts = gptq_tensors(q, zero, scale, bits, v1)
                tensors.update({f"{prefix}.{k}": v for k, v in parts.items()})
                if zero_biases and f"{prefix}.bias" not in tensors:
                    tensors[f"{prefix}.bias"] = np.zeros(w.shape[0], np.float16)
                values[name] = reference(q, zero, scale)
            else:
                tensors[name] = w.astype(np.float16)
                values[name] = tensors[name].astype(np.float32)
    for folder in filter(None, (dest, reference_dest)):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg_path = os.path.join(dest, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(quantization_config=config, dtype="float16")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(dest, "model.safetensors"))
    if reference_dest:
        save_file(values, os.path.join(reference_dest, "model.safetensors"))
    return dest
