"""The MTP proposer (`speculative_config={"method": "mtp", "num_speculative_tokens": k}`):
DeepSeek-V3's multi-token prediction layer (models/deepseek_mtp.py) drafts from the
target's hidden states, as vLLM's EAGLE-style proposers do.

Its cache. The MTP layer's latent cache is a KV-cache group of its own after the target's,
held, hit, preempted and freed with them like a draft model's. Its entry at position p is the
layer's over the pair (h_p, t_{p+1}): the target's hidden state there (after the final norm)
and the token that follows. In each step the target's forward runs the layer over the step's
flat batch right after the target (`runner/model_runner.py`), at the target's positions and
slots, each token paired with its successor (`StepInputs.next_tokens`, built on the host:
the next token of the step, or of the prompt past a chunk). The last token of a row that
samples has no successor yet: its entry is written by the first draft step below, which
also overwrites the entries of rejected drafts' positions. Since the entry at a block's last
position depends on the next block's first token, a prefix-cache hit drops its last block
(vLLM's block drop for EAGLE-like methods), so that every entry a hit keeps is its own.

Drafting. After a step, a request that sampled knows L tokens; the target's hidden state at
position L - 2 (the token whose logits gave the last emitted token: its sample row) pairs
with t_{L-1} in draft step 0, at position L - 2; step i feeds the layer's own output and the
draft of step i - 1 at position L - 2 + i. Step 0 runs for every request that sampled (it
writes the entry the forward could not); the later steps only while the drafts' positions
stay inside the request's blocks. Drafts are drawn as the draft model's are
(`draft_model.draft_draw`: the target's key for the same output index), so the verified
output is exactly the target's distribution.

Glossary: R draft rows, D model dim, P the forward's sample rows (`logit_rows`).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.config import batch_invariant
from jllm.models.context import StepContext
from jllm.runner.buckets import bucket
from jllm.runner.transfer import unpack
from jllm.spec_decode.draft_model import DraftModel, draft_draw, draft_inputs

logger = logging.getLogger(__name__)


def _mtp_step(
    state, kv_cache, src, prev, prev_index, buf, *, layout, graphdef, backend, logits_sharding
):
    """One MTP draft step: each row's token is `src[row]` (the last emitted token, or the
    draft of the step before) and its hidden state `prev[prev_index]` ([P, D]: the target's
    sample rows, or the step before's outputs in their first rows). Returns `src` with the
    rows' drafts, the layer's outputs in the first rows of a [P, D] array, the cache."""
    batch, md = unpack(buf, layout)
    token_ids = src[batch.from_device]
    model = nnx.merge(graphdef, state)
    ctx = StepContext(batch.positions, batch.attn, backend)
    x, kv_cache = model.propose(token_ids, prev[prev_index], ctx, kv_cache)
    logits = model.draft_logits(x[batch.logits_indices])
    logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    out = src.at[md.batch_row].set(draft_draw(logits, md))
    hidden = prev.at[: x.shape[0]].set(x.astype(prev.dtype))
    if not jax.sharding.get_abstract_mesh().empty:
        replicated = jax.sharding.PartitionSpec()
        out = jax.lax.with_sharding_constraint(out, replicated)
        hidden = jax.lax.with_sharding_constraint(hidden, replicated)
    return out, hidden, kv_cache


mtp_step = jax.jit(
    batch_invariant.keyed(_mtp_step),
    static_argnames=("layout", "graphdef", "backend", "logits_sharding", "invariant"),
    donate_argnames=("kv_cache",),
)


class MtpDraft(DraftModel):
    """The MTP layer's weights and cache, run by the `ModelRunner` as a draft model's are,
    but after the target in the forward (it reads the target's hidden states) and with the
    step's sample rows' hidden states in its first draft step (`propose`)."""

    takes_hidden = True
    dtype = None  # the target's, which its hidden states have

    step_name = "mtp step"
    back = 2  # step 0 pairs the last token with the hidden state at L - 2

    def _step(self):
        return mtp_step

    def _inputs(self, runner, Rd: int) -> tuple:
        return (runner.last_tokens, runner.step_hidden, jnp.zeros(Rd, jnp.int32))

    def propose(self, runner, groups, sampled=None) -> dict[str, list[int]]:
        """Drafts for every request that sampled in the step just fetched (`groups`, their
        tokens already appended; `sampled`: {req id: its emitted tokens}), up to k each."""
        batch = runner.batch
        live, rows, room = self.live_rows(runner, groups)
        if not live:
            return {}
        # The sample row whose logits gave each request's last emitted token: the target's
        # hidden state at position L - 2.
        at = [g.first + len(sampled[g.req_id]) - 1 for g in live]
        groups = self.groups(runner)
        drafting = self.drafting(runner)
        src, prev, slot = runner.last_tokens, runner.step_hidden, dict(zip(rows, at, strict=True))
        outs = []
        for step in range(self.k):
            active = rows if step == 0 else rows[room > step]
            if active.size == 0 or (step > 0 and not drafting):
                break
            Rd = bucket(active.size, self.layout.decode_buckets)
            backend = runner.attention
            buf, layout = draft_inputs(
                batch, active, step, self.layout, backend, Rd, groups, self.back
            )
            buf = jax.device_put(buf, runner.replicated)
            index = np.zeros(Rd, np.int32)
            index[: active.size] = [slot[r] for r in active]
            index = jax.device_put(index, runner.replicated)
            exe = self._executable(runner, Rd, buf, layout)
            src, prev, self.kv_cache = exe(self.state, self.kv_cache, src, prev, index, buf)
            slot = {r: i for i, r in enumerate(active)}
            outs.append(src)
        return self.drafts(live, room, outs) if drafting else {}


def load_mtp_draft(spec, target, args, kv_itemsize: int) -> MtpDraft:
    """The MTP draft of `target` (an engine_setup.EngineModel of a DeepSeek family with
    `num_nextn_predict_layers`): its first MTP layer, read from the target's checkpoint by
    the same loader, in its dtype, on its mesh. Refuses a target without MTP layers, a
    `model` other than the target's, and what the draft model refuses."""
    from jllm.model_loader.loader import load_model
    from jllm.model_loader.safetensors_io import read_header
    from jllm.models.deepseek import DeepseekConfig
    from jllm.models.deepseek_mtp import mtp_architecture, mtp_config
    from jllm.quantization import resolve_quantization

    cfg = target.config
    if not isinstance(cfg, DeepseekConfig):
        raise ValueError(
            "speculative_config method 'mtp' runs a model's own multi-token prediction "
            f"layers: jllm has them for DeepSeek-V3 checkpoints, not {target.arch.name}."
        )
    if spec.model not in (None, target.source.path, args.model):
        raise ValueError(
            "speculative_config method 'mtp' reads the MTP layers from the target's own "
            f"checkpoint; model={spec.model!r} is another."
        )
    if args.pipeline_parallel_size > 1 or args.nnodes > 1:
        raise ValueError("MTP drafts run on one pipeline stage and one node only, for now.")
    draft_cfg = mtp_config(cfg)
    if cfg.draft_layers > 1:
        logger.info(
            "MTP: the checkpoint has %d prediction layers; every draft step runs the first.",
            cfg.draft_layers,
        )
    source = target.source
    names = set()
    if args.load_format != "dummy" and source.kind == "hf":
        names = {e.name for path in source.weight_files for e in read_header(path)}
    arch = mtp_architecture(cfg.num_layers, names)
    graphdef, state = load_model(
        arch,
        draft_cfg,
        source,
        target.dtype,
        target.mesh,
        args.load_format,
        seed=(args.seed or 0) + 1,
        kv_replicas=target.kv_replicas,
        quantization=resolve_quantization(args.quantization, source),
    )
    specs = arch.module.kv_cache_specs(draft_cfg)
    latent = draft_cfg.kv_lora_rank + draft_cfg.qk_rope_head_dim
    draft = MtpDraft(
        graphdef,
        state,
        draft_cfg,
        specs,
        spec.num_speculative_tokens,
        spec.disable_by_batch_size,
        token_bytes=latent * kv_itemsize,
    )
    draft.dtype = target.dtype
    logger.info("Speculative decoding: MTP, %d tokens.", spec.num_speculative_tokens)
    return draft
