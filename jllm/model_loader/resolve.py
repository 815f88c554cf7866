"""`resolve_model`: from the user's `model=` argument to a `ModelSource` ready to load.

Everything that can be wrong with a model argument is found here, before any weight is read:
a path that does not exist, a hub id that is not cached, a directory without safetensors, a
checkpoint quantized in a format jllm does not read.
"""

import os

from transformers import AutoConfig, PretrainedConfig

from jllm.model_loader import locate, orbax_io
from jllm.model_loader.gguf_config import gguf_hf_config
from jllm.model_loader.gguf_io import GgufFile
from jllm.model_loader.safetensors_io import checkpoint_files, dtype_name, read_header
from jllm.model_loader.source import ModelSource
from jllm.quantization.checkpoints import parse_config


def resolve_model(
    model: str | None,
    *,
    revision: str | None = None,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    download_dir: str | None = None,
    load_format: str = "auto",
) -> ModelSource:
    """Find a model on local disk and read its config.

    model: None for the embedded SmolLM2-135M-Instruct GGUF; a Hugging Face model directory
        (config.json + *.safetensors); a .gguf file; or a hub id (`org/name`) already in the
        local Hugging Face cache (`HF_HUB_CACHE`, or `download_dir`). Nothing is downloaded.
    revision: branch, tag or commit of a hub id (default: main).
    tokenizer: load the tokenizer from this path or hub id instead of the model's own.
    trust_remote_code: allow a model directory's custom config code.
    download_dir: the Hugging Face cache directory to look hub ids up in.
    load_format: "dummy" (random weights) needs only the directory's config.json, as in vLLM.
    """
    path = (
        locate.default_model_path()
        if model is None
        else locate.local_path(model, revision, download_dir)
    )
    kind, path = locate.classify(path)
    common = {"tokenizer": tokenizer, "download_dir": download_dir}
    if kind == "hf" and orbax_io.is_checkpoint(path):  # `jllm convert`'s output
        meta = orbax_io.read_meta(path)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        return ModelSource("orbax", path, config, meta["dtype"], orbax_meta=meta, **common)
    if kind == "gguf":
        gf = GgufFile(path)
        config = gguf_hf_config(gf)
        quantized = parse_config({"quant_method": "mxfp4"}, path) if gf.mxfp4 else None
        return ModelSource(
            "gguf",
            path,
            config,
            gf.checkpoint_dtype(),
            gguf_file=gf,
            checkpoint_quantization=quantized,
            **common,
        )

    files = checkpoint_files(path)
    if not files and load_format != "dummy":
        found = ", ".join(sorted(os.listdir(path)))
        raise ValueError(
            f"{path} has no *.safetensors weights (it holds: {found}). jllm loads only "
            "safetensors checkpoints; convert the weights to safetensors (for example "
            "`model.save_pretrained(dir, safe_serialization=True)` in transformers)."
        )
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    quantized = None
    if getattr(config, "quantization_config", None):  # AWQ / GPTQ, or a clear refusal
        quantized = parse_config(config.quantization_config, path)
    dtype = _checkpoint_dtype(config, files)
    return ModelSource("hf", path, config, dtype, checkpoint_quantization=quantized, **common)


def _checkpoint_dtype(config: PretrainedConfig, files: list[str]) -> str:
    """The config's dtype ("bfloat16"), else the dtype of the first floating tensor stored."""
    dtype = getattr(config, "dtype", None)
    if dtype is not None and str(dtype) != "auto":
        return str(dtype).removeprefix("torch.")
    for path in files:
        for entry in read_header(path):
            if entry.dtype.startswith(("F", "BF")):
                return dtype_name(entry.dtype)
    return "float32"
