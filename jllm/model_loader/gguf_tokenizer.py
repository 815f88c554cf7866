"""A transformers fast tokenizer rebuilt from a GGUF file's metadata, without torch.

A GGUF carries its tokenizer as metadata: vocabulary, merges, token types, special token ids,
whether to add BOS, and the chat template. transformers knows how to turn that into a `tokenizers`
backend (`convert_gguf_tokenizer`, which needs no torch), but the entry point that reads the file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) goes through a reader that imports torch. So
we read the metadata with gguf-py, group it the way transformers' reader does, and hand it to the
converter. Tests check encodings, special tokens and the chat template against
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`.
"""

from transformers import PreTrainedTokenizerFast

from jllm.model_loader.gguf_io import GgufFile

_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def gguf_tokenizer(gf: GgufFile) -> PreTrainedTokenizerFast:
    """The tokenizer a GGUF file describes, chat template included."""
    # Imported here: only GGUF models need them. transformers 5.18 moved them to
    # `integrations.gguf`; 5.17's converter (in `ggml`) builds a byte-level BPE vocabulary
    # (SmolLM2's) as a sentencepiece one with byte fallback, which encodes the same but which
    # grammar backends read as other bytes: so not that one.
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        import transformers

        raise ImportError(
            f"{gf.path}: a GGUF file's tokenizer needs transformers>=5.18 (this is "
            f"{transformers.__version__}); upgrade it, or pass tokenizer= a Hugging Face "
            "tokenizer directory or hub id for this model."
        ) from None

    meta = gf.metadata
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(
            f"{gf.path} has no tokenizer in its metadata; pass tokenizer= a Hugging Face "
            "tokenizer directory or hub id for this model."
        )
    groups = {
        group: {
            name: meta[f"tokenizer.{key}"]
            for key, name in keys.items()
            if f"tokenizer.{key}" in meta
        }
        for group, keys in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, init_kwargs = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # sentencepiece files written before the flag existed: llama.cpp adds BOS for them
        init_kwargs.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(key)
        init_kwargs[name] = tokens[token_id] if token_id is not None else None
    backend, extra_kwargs = convert_gguf_tokenizer(gf.architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, name_or_path=gf.path, **init_kwargs, **extra_kwargs
    )
