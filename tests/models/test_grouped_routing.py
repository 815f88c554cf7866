"""DeepSeek's routers (models/moe.py: `route_grouped`) against transformers' own: V3's
sigmoid scores with the correction bias and the groups' two best, V2's softmax greedy and
group-limited choice; the same experts and weights for every token."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from jllm.config import batch_invariant
from jllm.models.moe import GroupedRouting, route_grouped

D, E, T = 32, 16, 40


def by_expert(ids, weights):
    """Each token's (expert, weight) pairs in expert order (the routers' order differs)."""
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


def run(router, cfg, bias=None, invariant=False, method="greedy"):
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        x = torch.randn(T, D)
        logits, weights, ids = router(x)
    with batch_invariant.scope(invariant):
        got_w, got_ids = route_grouped(
            jnp.asarray(logits.numpy()),
            cfg.num_experts_per_tok,
            GroupedRouting.from_hf(cfg, method),
            None if bias is None else jnp.asarray(bias.numpy()),
        )
    want_ids, want_w = by_expert(ids.numpy(), weights.numpy())
    have_ids, have_w = by_expert(np.asarray(got_ids), np.asarray(got_w))
    np.testing.assert_array_equal(have_ids, want_ids)
    np.testing.assert_allclose(have_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_v3_sigmoid_groups_and_bias(normalize, invariant):
    cfg = transformers.DeepseekV3Config(
        hidden_size=D,
        n_routed_experts=E,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=normalize,
        routed_scaling_factor=2.5,
    )
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0.0, 0.3)
    run(router, cfg, router.e_score_correction_bias, invariant, method="noaux_tc")


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_softmax(method):
    cfg = transformers.DeepseekV2Config(
        hidden_size=D,
        n_routed_experts=E,
        num_experts_per_tok=3,
        topk_method=method,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    )
    run(DeepseekV2TopkRouter(cfg), cfg)


def test_unknown_routers_are_refused():
    cfg = transformers.DeepseekV2Config(hidden_size=D, n_routed_experts=E, topk_method="random")
    with pytest.raises(ValueError, match="not supported"):
        GroupedRouting.from_hf(cfg)
