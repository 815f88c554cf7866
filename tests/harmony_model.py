"""A tiny gpt-oss that speaks harmony, for the server's harmony tests.

o200k_base's ranks (tests/data/o200k_base.tiktoken.xz, the file harmony checks by sha256)
become the model's tokenizer with gpt-oss's special tokens (transformers' tiktoken
converter), so harmony renders and parses the tiny model's ids as a real gpt-oss's; the
server derives the vocabulary file back from this tokenizer (no network). `ForceScript`
makes a request's output follow a script of token ids (`vllm_xargs={"script": [...]}`), so
the random model emits harmony channels through the real sampling path.
"""

from __future__ import annotations

import base64
import lzma
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jllm.logits_process import LogitsProcessor

DATA = Path(__file__).parent / "data" / "o200k_base.tiktoken.xz"
PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
NAMED = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
}
VOCAB = 201088
EOS = [200002, 199999, 200012]  # gpt-oss's generation_config: <|return|>, <|endoftext|>, <|call|>
MAX_SCRIPT = 64


def specials() -> list[str]:
    return [NAMED.get(i, f"<|reserved_{i}|>") for i in range(199998, VOCAB)]


def o200k_ranks() -> dict[bytes, int]:
    ranks = {}
    for line in lzma.decompress(DATA.read_bytes()).splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def save_tokenizer(path: Path) -> None:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):  # the ranks read here: no tiktoken package
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url):
            return o200k_ranks()

    converted = Converter(pattern=PATTERN, extra_special_tokens=specials()).converted()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=converted,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.save_pretrained(path)


def save_harmony_gpt_oss(root: Path) -> str:
    """A tiny random gpt-oss with o200k's vocabulary and gpt-oss's stop tokens."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=199998,
        eos_token_id=EOS,
        pad_token_id=199999,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    path = root / "harmony_gpt_oss"
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(path)
    save_tokenizer(path)
    return str(path)


class ForceScript(LogitsProcessor):
    """A request's output follows `extra_args["script"]` (token ids): the token at output
    index i is script[i]; past its end nothing is forced."""

    state_shape = (MAX_SCRIPT,)
    state_dtype = np.int32
    uses_output_index = True

    def row_state(self, params):
        script = (params.extra_args or {}).get("script")
        if script is None:
            return None
        if len(script) > MAX_SCRIPT:
            raise ValueError(f"a script holds at most {MAX_SCRIPT} tokens")
        state = np.full(MAX_SCRIPT, -1, np.int32)
        state[: len(script)] = script
        return state

    def apply(self, logits, state, active, output_index=None):
        index = jnp.minimum(output_index, MAX_SCRIPT - 1)
        target = jnp.take_along_axis(state, index[:, None], axis=1)  # [R, 1]
        forced = active[:, None] & (target >= 0) & (output_index[:, None] < MAX_SCRIPT)
        vocab = jnp.arange(logits.shape[-1])[None, :]
        return jnp.where(forced & (vocab != target), -jnp.inf, logits)
