"""Finding and reading model checkpoints: Hugging Face safetensors directories, hub ids resolved
through the local Hugging Face cache, GGUF files, and the embedded SmolLM2 default.

    source = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")  # or a path, or None
    config = source.hf_config                   # transformers PretrainedConfig
    for name, array in source.iter_weights():  # HF names, float32 numpy, HF layout
        ...
    tokenizer = source.load_tokenizer()

No torch at run time: safetensors are read by memory map, GGUF files with gguf-py.
"""

from jllm.model_loader.resolve import resolve_model
from jllm.model_loader.source import ModelSource

__all__ = ["ModelSource", "resolve_model"]
