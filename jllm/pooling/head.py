"""The pooling head on the host: from a request's pooled hidden state (float32, after the
model's final norm) to what the user gets, as vLLM's heads compute it.

embed: cut to `dimensions` (Matryoshka), then L2-normalized if `use_activation` (vLLM's
order: cut, then normalize). classify: the score projection (+ bias), calibrated by the
pooler config's logit_mean/logit_sigma, then the activation if `use_activation`.
"""

from __future__ import annotations

import numpy as np


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def apply_head(spec, params, hidden: np.ndarray) -> np.ndarray:
    """`hidden` [D] float32 -> the request's vector: [dimensions or E] or [labels]."""
    x = np.asarray(hidden, np.float32)
    if spec.task == "embed":
        if params.dimensions is not None:
            x = x[: params.dimensions]
        if params.use_activation:
            x = x / max(float(np.linalg.norm(x)), 1e-12)
        return x
    logits = spec.score @ x
    if spec.score_bias is not None:
        logits = logits + spec.score_bias
    pooler = spec.pooler
    if pooler.logit_mean is not None:
        logits = logits - np.float32(pooler.logit_mean)
    if pooler.logit_sigma is not None:
        logits = logits / np.float32(pooler.logit_sigma)
    if not params.use_activation or spec.activation == "identity":
        return logits.astype(np.float32)
    if spec.activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    return _softmax(logits).astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """vLLM's bi-encoder score: the cosine of two embeddings (whatever their norms)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-8))
