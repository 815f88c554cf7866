"""What the runner hands back per sampled sequence (host data, no JAX)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # raw logprob of the sampled token
    rank: int  # 1 = most likely
    top_ids: np.ndarray  # [J] most likely ids, best first
    top_logprobs: np.ndarray  # [J]
