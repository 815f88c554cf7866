"""A tiny model that says what a test scripts: the tiny Llama turned into a table of next
tokens, so a server can be driven to emit reasoning tags, tool calls or any text through its
real sampling path (greedy), without a grammar.

A fresh model of the tiny Llama's shape (nothing of its weights is kept). The residual
branches are zeroed and the final norm's weight set to ones, so the final
hidden state is the last token's embedding scaled to unit RMS; every embedding row has the
same norm, so by Cauchy-Schwarz a row's dot product with itself is the strict maximum over
the vocabulary. The untied output projection's row j is the embedding of the token that j
follows: after token i the largest logit is script[i]'s, whatever the random weights (the
margin: 1 - the largest cosine between two rows, times the head's scale). Tokens off the
script follow themselves. `save_scripted` checks the script with transformers before it returns.
"""

from __future__ import annotations

import shutil

import torch
import transformers

END = "<|im_end|>"


def script_chain(tokenizer, start_id: int, text: str) -> list[int]:
    """`start_id`, the token ids of `text`, then the chat template's end-of-turn token."""
    ids = [start_id, *tokenizer.encode(text, add_special_tokens=False)]
    ids.append(tokenizer.convert_tokens_to_ids(END))
    if len(set(ids)) != len(ids):
        raise ValueError(f"a script's tokens must be distinct: {text!r} gives {ids}")
    return ids


def save_scripted(llama_dir: str, path, text: str, added: tuple[str, ...] = ()) -> str:
    """A copy of the tiny Llama at `llama_dir` that, after a chat prompt's generation
    prompt (its last token: "\\n"), greedily emits `text` (its tokens must be distinct)
    and then `<|im_end|>`; `added`: tokens to add to the vocabulary (reasoning tags)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    if added:
        tokenizer.add_tokens(list(added))
    vocab = len(tokenizer)
    chain = script_chain(tokenizer, tokenizer.convert_tokens_to_ids("Ċ"), text)
    # A fresh model of the tiny Llama's shape, untied from the start: no weight of it comes
    # from the checkpoint (whose random init, resize and tie state are what failed before).
    config = transformers.AutoConfig.from_pretrained(llama_dir)
    config.vocab_size, config.tie_word_embeddings = vocab, False
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        embed = torch.randn(vocab, config.hidden_size, generator=gen)
        embed /= embed.norm(dim=1, keepdim=True)
        follows = torch.arange(vocab)  # follows[i]: the token emitted after i
        for i, j in zip(chain, chain[1:], strict=False):
            # A swap keeps `follows` a permutation. (`follows[i]` on the right would be a
            # view that the first assignment changes: a duplicate, a row of the head never
            # written, whatever the allocator left there: the order-dependent failure.)
            k, displaced = int((follows == j).nonzero()[0, 0]), int(follows[i])
            follows[i], follows[k] = j, displaced
        assert torch.equal(follows.sort().values, torch.arange(vocab))
        head = torch.zeros_like(embed)
        head[follows] = 50.0 * embed  # row follows[i] is i's embedding; sampling at
        # temperature 1 follows the script too (the gap is hundreds of nats)
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(path)
    _check(path, chain)
    tokenizer.save_pretrained(path)
    if not (path / "chat_template.jinja").exists():
        shutil.copy(f"{llama_dir}/chat_template.jinja", path)
    return str(path)


def _check(path, chain: list[int]) -> None:
    """The saved model, reloaded by transformers, follows its script token by token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(torch.tensor([chain])).logits[0]
    got = logits.argmax(-1).tolist()[:-1]
    if got != chain[1:]:
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        raise AssertionError(
            f"the scripted model does not follow {chain[1:]}: {got} (non-finite: embeddings "
            f"{int((~torch.isfinite(embed)).sum())}, head {int((~torch.isfinite(head)).sum())}; "
            f"head is the embeddings: {bool(torch.equal(embed, head))})"
        )
