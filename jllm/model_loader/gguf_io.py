"""Reading GGUF files (llama.cpp's format) as Hugging Face named float32 numpy arrays.

Every tensor is dequantized on load with gguf-py's numpy kernels (Q4_0/Q4_1/Q8_0/K-quants/F16/...),
renamed from llama.cpp's names to transformers' and left in transformers' layout. Three things in a
GGUF differ from the Hugging Face checkpoint it was converted from, and all are undone here:

- Names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on. A few
  names mean different modules in different families: Gemma's `ffn_norm` is the norm before its
  MLP (`pre_feedforward_layernorm`), Llama's the norm after attention; Phi-3's `attn_qkv` and
  `ffn_up` hold its fused `qkv_proj` and `gate_up_proj` (gate rows first), which the model
  loader splits by rows as it splits the safetensors checkpoint's.
- Row order of the query and key projections, for the `llama` architecture only. transformers
  rotates the two halves of each head (`rotate_half`: dimension i pairs with i + H/2); llama.cpp's
  llama kernel rotates adjacent pairs (2i with 2i + 1). Its converter therefore reorders the rows
  of each head of q_proj and k_proj, including their biases, from
  `[x_0 .. x_{H/2-1}, y_0 .. y_{H/2-1}]` to `[x_0, y_0, x_1, y_1, ...]`. We read each head's rows
  as `[H/2, 2]` and transpose to `[2, H/2]` to get the halves back. Qwen2/Qwen3, Gemma and Phi-3
  use the half-rotation layout in llama.cpp too, so their rows are stored unchanged.
- Gemma's RMSNorm weights. Gemma scales by `1 + w` and stores `w`; llama.cpp's norm scales by
  `w`, so its converter adds 1 to every `*norm.weight` (the layers' four, the q/k norms of
  Gemma 3, the final norm). We subtract it again, as transformers' own GGUF reader does. The
  addition was made in the checkpoint's dtype (bfloat16 for most Gemma releases), so what comes
  back is the weight llama.cpp runs with, within bfloat16's rounding of `1 + w`.

The metadata is read once, with `gguf.GGUFReader` (a memory map: tensor data is only touched when
it is dequantized).
"""

import re
from collections.abc import Iterator

import gguf
import jax
import numpy as np
from gguf.quants import dequantize

from jllm.models import registry
from jllm.models.architecture import GgufFamily
from jllm.quantization.formats import GGUF_KEPT, gguf_weight
from jllm.quantization.mxfp4 import ggml_mxfp4_weight
from jllm.quantization.weights import QuantizedWeight

# llama.cpp tensor names -> transformers module names, as llama names them; a family names
# where its architecture differs (models/architecture.py:GgufFamily, in its family file).
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# A layer tensor: its part and suffix (none for a few, e.g. Qwen3-Next's `ssm_a`).
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")

# Tensors that carry configuration rather than weights: read by `gguf_config`, never yielded.
# rope_freqs: Llama 3.1's rope scaling; rope_factors_*: Phi-3's LongRoPE factors.
CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


class GgufFile:
    """One GGUF file: its metadata as plain Python values and its tensors, read lazily."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except (ValueError, OSError) as e:
            raise ValueError(f"{path} could not be read as a GGUF file: {e}") from e
        self.metadata = {key: field.contents() for key, field in self.reader.fields.items()}
        self.architecture: str = self.metadata.get("general.architecture", "")
        family = registry.gguf_family(self.architecture)
        if family is None:
            raise ValueError(
                f"{path} is a GGUF file of architecture {self.architecture!r}; jllm loads GGUF "
                f"files of architectures {sorted(registry.GGUF_ARCHITECTURES)}. Use the "
                "model's Hugging Face safetensors checkpoint instead."
            )
        self.family: GgufFamily = family
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._layer_names = {**_PER_LAYER, **family.layer_names}

    def arch_key(self, name: str, default=None):
        """Architecture-scoped metadata: `arch_key("block_count")` reads `llama.block_count`."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def tensor(self, name: str) -> np.ndarray:
        """One tensor by its GGUF name, dequantized to float32 in numpy (row-major) order."""
        t = self.tensors[name]
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    def hf_name(self, gguf_name: str) -> str:
        """The transformers name of a GGUF tensor; ValueError for one we do not know."""
        stem, _, suffix = gguf_name.rpartition(".")
        if stem in _TOP_LEVEL:
            return f"{_TOP_LEVEL[stem]}.{suffix}"
        match = _LAYER_NAME.fullmatch(gguf_name)
        if match and match.group(2) in self._layer_names:
            layer, part, suffix = match.groups()
            name = f"model.layers.{layer}.{self._layer_names[part]}"
            return name if suffix is None else f"{name}.{suffix}"
        raise ValueError(
            f"{self.path} holds a tensor {gguf_name!r} that jllm does not know how to load for "
            f"architecture {self.architecture!r}."
        )

    def weight_names(self) -> list[str]:
        """GGUF names of the tensors `iter_weights` yields, in file order."""
        return [name for name in self.tensors if name not in CONFIG_TENSORS]

    def iter_weights(self, keep_quantized: bool = False) -> Iterator[tuple[str, object]]:
        """Yield `(hf_name, float32 array)` in transformers' layout ([out, in] for linears).

        keep_quantized: yield the matrices of the types `formats.GGUF_KEPT` lists as
        `QuantizedWeight`s (numpy arrays, rows are output channels) instead of dequantizing
        them (quantization="gguf"); see `_kept_tensors` for which."""
        weights = self._iter_weights(keep_quantized)
        regroup = self.family.regroup
        yield from weights if regroup is None else regroup(weights, self)

    def _iter_weights(self, keep_quantized: bool) -> Iterator[tuple[str, object]]:
        permute, plus_one = self.family.permuted, self.family.norm_plus_one
        num_heads = self.arch_key("attention.head_count")
        num_kv_heads = self.arch_key("attention.head_count_kv", num_heads)
        kept = self._kept_tensors() if keep_quantized else set()
        for gguf_name in self.weight_names():
            hf_name = self.hf_name(gguf_name)
            t = self.tensors[gguf_name]
            if gguf_name in kept:
                array = gguf_weight(np.asarray(t.data), t.tensor_type.name)
            elif t.tensor_type.name == "MXFP4":  # gpt-oss's experts: an mxfp4 checkpoint's
                array = ggml_mxfp4_weight(np.asarray(t.data), gguf_name)
            else:
                array = self.tensor(gguf_name)
            if permute and ".attn_q." in gguf_name:
                array = unpermute_rope_rows(array, num_heads)
            elif permute and ".attn_k." in gguf_name:
                array = unpermute_rope_rows(array, num_kv_heads)
            elif plus_one and hf_name.endswith("norm.weight"):
                array = array - np.float32(1.0)
            yield hf_name, array

    def _kept_tensors(self) -> set[str]:
        """The matrices kept quantized: those of a kept type, where every layer's tensor of
        the same part (`ffn_down`, ...) is of a kept type too. The layers of a part are
        stacked into one array, and llama.cpp's mixes (Q4_K_M stores some layers' ffn_down
        as Q6_K, Q5_K_M some as Q5_K) must give them one form: a part with any layer of a
        type not kept is dequantized in every layer."""
        parts: dict[str, list[str]] = {}
        for name in self.weight_names():
            match = _LAYER_NAME.fullmatch(name)
            parts.setdefault(match.group(2) if match else name, []).append(name)
        kept = set()
        for part, names in parts.items():
            if part in self.family.float_parts:
                continue
            tensors = [self.tensors[n] for n in names]
            if all(t.tensor_type.name in GGUF_KEPT and len(t.shape) == 2 for t in tensors):
                kept.update(names)
        return kept

    @property
    def mxfp4(self) -> bool:
        """Whether tensors are MXFP4 (gpt-oss's experts): the file loads as an mxfp4
        checkpoint, those tensors kept in 4 bits."""
        return any(t.tensor_type.name == "MXFP4" for t in self.tensors.values())

    def checkpoint_dtype(self) -> str:
        """The precision the weight matrices are stored in: "float32" when they are all F32,
        "bfloat16" when any is BF16, else "float16" (F16, and the quantized types, whose block
        scales are float16)."""
        kinds = {
            self.tensors[n].tensor_type.name
            for n in self.weight_names()
            if len(self.tensors[n].shape) > 1
        }
        if kinds <= {"F32"}:
            return "float32"
        return "bfloat16" if "BF16" in kinds else "float16"

    def num_params(self) -> tuple[int, int]:
        """`(number of elements, bytes of tensor data on disk)` of the yielded tensors."""
        names = self.weight_names()
        params = sum(int(self.tensors[n].n_elements) for n in names)
        nbytes = sum(int(self.tensors[n].n_bytes) for n in names)
        return params, nbytes


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows: per head, `[H/2, 2]` rows back to `[2, H/2]`.

    `weight` is `[num_heads * H, ...]` (a projection weight `[N*H, D]` or its bias `[N*H]`).
    """
    if isinstance(weight, QuantizedWeight):  # rows are output channels in every array
        return jax.tree.map(lambda a: unpermute_rope_rows(a, num_heads), weight)
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(
            f"Cannot undo the rope row order of a tensor with {rows} rows for {num_heads} heads: "
            "the GGUF file's head counts do not match its tensors."
        )
    half = rows // num_heads // 2
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # [N, H/2, 2, ...]
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(weight.shape)  # [N*H, ...]
