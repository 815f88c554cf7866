"""DeepSeek-V3's multi-token prediction (MTP) module as a draft model: the layer its
checkpoints carry after the decoder's (`num_nextn_predict_layers`, layer index
`num_hidden_layers`), read from the target's own checkpoint (vLLM's `DeepSeekMTP`).

At position p it takes the target's hidden state h_p (after the final norm) and the token
t_{p+1}, and predicts t_{p+2}:

    x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])     (the embedding zero at position 0)
    x = a DeepSeek decoder layer (latent attention over its own latent cache, its experts)
    logits = shared_head.head(shared_head.norm(x))

Drafting k tokens feeds x, the layer's output before the norm, back as the next h with the
token just drafted, at the next position (vLLM's; with one MTP layer every draft step uses
it). The module is the family's causal LM of one layer (its embedding, the layer, its final
norm as `shared_head.norm`, its LM head as `shared_head.head`) plus enorm, hnorm and
eh_proj; `propose` is its forward. spec_decode/mtp.py runs it.

Glossary: T tokens, D model dim.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
from flax import nnx

from jllm.models.architecture import TOP_WEIGHTS, Architecture
from jllm.models.context import StepContext
from jllm.models.deepseek import DeepseekConfig, DeepseekForCausalLM, layer_weights
from jllm.models.layers import Linear, RMSNorm

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# The MTP layer's own tensors beside its decoder layer's, as the maps name them.
_OWN = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.norm.weight": "model.norm.weight",
    "shared_head.head.weight": "lm_head.weight",
    "enorm.weight": "mtp.enorm.weight",
    "hnorm.weight": "mtp.hnorm.weight",
    "eh_proj.weight": "mtp.eh_proj.weight",
}


def mtp_config(cfg: DeepseekConfig) -> DeepseekConfig:
    """The draft's config: one layer, index `num_layers` of the target (sparse where the
    target's rule makes that index sparse), its own untied LM head."""
    if cfg.draft_layers < 1:
        raise ValueError(
            "speculative_config method 'mtp' needs a model with multi-token prediction "
            "layers (num_nextn_predict_layers >= 1 in its config); this one has none."
        )
    index = cfg.num_layers
    experts = cfg.moe.num_experts > 1 and any(cfg.moe.sparse_layers)
    first_sparse = next((i for i, s in enumerate(cfg.moe.sparse_layers) if s), index)
    sparse = experts and index >= first_sparse
    return dataclasses.replace(
        cfg,
        num_layers=1,
        moe=dataclasses.replace(cfg.moe, sparse_layers=(sparse,)),
        draft_layers=0,
        tie_word_embeddings=False,
    )


class DeepseekMTP(DeepseekForCausalLM):
    """The MTP draft (the module's docstring)."""

    takes_hidden = True  # the runner's forward runs `propose` after the target

    def __init__(self, cfg: DeepseekConfig, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype, rngs)
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(D, eps, dtype)
        self.hnorm = RMSNorm(D, eps, dtype)
        self.eh_proj = Linear("TE,ED->TD", (2 * D, D), (None, "embed"), dtype, rngs)

    def propose(self, token_ids, prev_hidden, ctx: StepContext, kv_caches: tuple):
        """token_ids [T] (t_{p+1}), the hidden states they follow [T, D] (h_p), at positions
        p (ctx) -> (the layer's output x [T, D] before the norm, the updated caches)."""
        e = self.embed(token_ids)
        e = jnp.where((ctx.positions == 0)[:, None], jnp.zeros_like(e), e)
        h = self.hnorm(prev_hidden.astype(e.dtype))
        x = self.eh_proj(jnp.concatenate([self.enorm(e), h], axis=-1), ctx)
        x, kv_caches, _ = self.run_layers(x, ctx, kv_caches)
        return x, kv_caches

    def draft_logits(self, x):
        """[R, D] layer outputs -> [R, V] float32 logits through the shared head."""
        return self.compute_logits(self.norm(x))


MTP_TOP_WEIGHTS = TOP_WEIGHTS | {
    "mtp.enorm.weight": (("enorm", "weight"), None),
    "mtp.hnorm.weight": (("hnorm", "weight"), None),
    "mtp.eh_proj.weight": (("eh_proj", "weight"), "t"),
}


def mtp_architecture(target_layers: int, names: set[str]) -> Architecture:
    """The MTP draft's architecture over the target's checkpoint (whose tensor names are
    `names`): layer `target_layers` read as the draft's layer 0 and its own tensors, every
    other tensor left out. A checkpoint whose MTP layer shares the target's embedding or LM
    head (no `embed_tokens` or `shared_head.head` of its own) gives the target's."""
    prefix = f"model.layers.{target_layers}."
    shared = {
        "model.embed_tokens.weight": prefix + "embed_tokens.weight",
        "lm_head.weight": prefix + "shared_head.head.weight",
    }
    borrowed = {name for name, own in shared.items() if own not in names}

    def rename(name: str) -> str | None:
        if name in borrowed:
            return name
        m = _LAYER.fullmatch(name)
        if m is None or int(m.group(1)) != target_layers:
            return None
        rest = m.group(2)
        return _OWN.get(rest, f"model.layers.0.{rest}")

    return Architecture(
        name="DeepseekMTP",
        config=lambda hf: None,  # built from the target's config (mtp_config)
        module=DeepseekMTP,
        layer_weights=layer_weights,
        top_weights=MTP_TOP_WEIGHTS,
        rename=rename,
    )
