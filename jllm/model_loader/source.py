"""`ModelSource`: a resolved model checkpoint, whatever its format, and how to read it.

The rest of jllm sees one interface for both formats: a transformers config, the checkpoint's
dtype, a stream of `(hf_name, float32 array)` weights in transformers' names and layout, and a
transformers tokenizer. The model code maps Hugging Face names to its own parameters once, and a
GGUF file loads through exactly the same path as a safetensors directory.
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from jllm.config import TOKENIZER_MODES
from jllm.model_loader import locate
from jllm.model_loader.gguf_io import GgufFile
from jllm.model_loader.gguf_tokenizer import gguf_tokenizer
from jllm.model_loader.safetensors_io import checkpoint_files, count_params, iter_safetensors
from jllm.quantization.checkpoints import CheckpointQuantization, iter_quantized


@dataclass
class ModelSource:
    """A model checkpoint found on local disk, from `resolve_model`.

    kind: "hf" (a Hugging Face directory of *.safetensors), "gguf" (one llama.cpp file) or
        "orbax" (a folder `jllm convert` wrote).
    path: the model directory (hf) or the .gguf file.
    hf_config: the transformers config; for GGUF rebuilt from the file's metadata.
    checkpoint_dtype: numpy/jnp dtype name of the stored weights ("bfloat16", "float32", ...);
        "float32" for GGUF, whose weights are dequantized to float32.
    tokenizer: the tokenizer to load, as the user gave it (a path or hub id); None means the
        model's own.
    download_dir: the Hugging Face cache directory to resolve a hub-id tokenizer in.
    checkpoint_quantization: an AWQ/GPTQ/FP8 checkpoint's `quantization_config`, checked.
    """

    kind: Literal["hf", "gguf", "orbax"]
    path: str
    hf_config: PretrainedConfig = field(repr=False)
    checkpoint_dtype: str
    tokenizer: str | None = None
    download_dir: str | None = None
    gguf_file: GgufFile | None = field(default=None, repr=False, compare=False)
    checkpoint_quantization: CheckpointQuantization | None = None
    # A jllm checkpoint's `jllm_checkpoint.json` (model_loader/orbax_io.py), kind "orbax".
    orbax_meta: dict | None = None

    @property
    def weight_files(self) -> list[str]:
        """The files holding the weights: the safetensors shards, or the GGUF file."""
        return [self.path] if self.kind == "gguf" else checkpoint_files(self.path)

    def iter_weights(self, keep_quantized: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        """Yield `(hf_name, array)` for every weight, one tensor in memory at a time.

        Names are transformers' (`model.layers.0.self_attn.q_proj.weight`); arrays are float32 in
        transformers' layout (`[out, in]` for linear weights). `lm_head.weight` is absent when the
        checkpoint ties it to the embedding (`hf_config.tie_word_embeddings`). Arrays may be
        read-only views of a memory-mapped file: copy before writing to them.

        keep_quantized (GGUF only): quantized matrices come as `QuantizedWeight`s instead.
        An AWQ/GPTQ checkpoint's projections always come as `QuantizedWeight`s
        (`P.weight`, from `P.qweight`, `P.qzeros`, `P.scales`, `P.g_idx`), and so do an FP8
        checkpoint's float8 ones (from `P.weight` and its scale).
        """
        if self.kind == "gguf":
            yield from self._gguf().iter_weights(keep_quantized)
        elif self.checkpoint_quantization is not None:
            spec = self.checkpoint_quantization
            tensors = iter_safetensors(self.weight_files, integers=True, fp8=spec.method == "fp8")
            yield from iter_quantized(tensors, self.checkpoint_quantization)
        else:
            yield from iter_safetensors(self.weight_files)

    @property
    def num_params(self) -> int:
        """Number of weight elements in the checkpoint (read from headers, no tensor data)."""
        return self._sizes()[0]

    @property
    def checkpoint_nbytes(self) -> int:
        """Bytes of weight data on disk (quantized size for GGUF)."""
        return self._sizes()[1]

    def load_tokenizer(
        self,
        tokenizer_mode: str = "auto",
        trust_remote_code: bool = False,
        revision: str | None = None,
    ) -> PreTrainedTokenizerBase:
        """The transformers tokenizer for this model, with its chat template.

        tokenizer_mode: "auto" (fast tokenizer) or "slow" (asks transformers for the Python
            tokenizer where one exists; transformers 5 and GGUF files always give a fast one).
        revision: revision of a `tokenizer=` given as a hub id (vLLM's tokenizer_revision).
        """
        if tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer_mode={tokenizer_mode!r} is not supported; "
                f"use one of {sorted(TOKENIZER_MODES)}."
            )
        if self.tokenizer is None:
            kind, path = self.kind, self.path
        else:
            path = locate.local_path(self.tokenizer, revision, self.download_dir)
            kind = "gguf" if path.endswith(".gguf") or _only_gguf(path) else "hf"
        if kind == "gguf":
            if path == self.path:
                return gguf_tokenizer(self._gguf())
            return gguf_tokenizer(GgufFile(locate.classify(path)[1]))
        return AutoTokenizer.from_pretrained(
            path, use_fast=tokenizer_mode != "slow", trust_remote_code=trust_remote_code
        )

    def _gguf(self) -> GgufFile:
        if self.gguf_file is None:
            self.gguf_file = GgufFile(self.path)
        return self.gguf_file

    def _sizes(self) -> tuple[int, int]:
        if self.kind == "gguf":
            return self._gguf().num_params()
        return count_params(self.weight_files)


def _only_gguf(path: str) -> bool:
    """A directory with GGUF files and no Hugging Face tokenizer or config files."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    hf_files = {"config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model"}
    return not hf_files.intersection(names) and any(n.endswith(".gguf") for n in names)
