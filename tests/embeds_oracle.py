"""The prompt-embeddings tests' oracle: embedding rows near a tiny model's table rows, and
transformers generating from them (`inputs_embeds`)."""

from __future__ import annotations

import base64
import io

import torch


def embeds_of(model, ids: list[int], noise: float = 0.05, seed: int = 0) -> torch.Tensor:
    """The table rows of `ids`, moved off them by `noise` (rows no token has)."""
    table = model.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(seed)
    rows = table[torch.tensor(ids)]
    return rows + noise * rows.std() * torch.randn(rows.shape, generator=g)


def hf_from_embeds(model, embeds: torch.Tensor, n: int, **kwargs):
    """transformers' greedy tokens after `embeds`, and each one's logprob teacher-forced."""
    with torch.no_grad():
        tokens = model.generate(
            inputs_embeds=embeds[None], max_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs
        )[0].tolist()
        table = model.get_input_embeddings()
        full = torch.cat([embeds, table(torch.tensor(tokens))])[None]
        logits = model(inputs_embeds=full).logits[0, len(embeds) - 1 : -1]
    lps = torch.log_softmax(logits.float(), -1)
    return tokens, [lps[i, t].item() for i, t in enumerate(tokens)]


def payload(embeds: torch.Tensor) -> str:
    """vLLM's wire form: base64 of the tensor's torch.save file."""
    buf = io.BytesIO()
    torch.save(embeds, buf)
    return base64.b64encode(buf.getvalue()).decode()
