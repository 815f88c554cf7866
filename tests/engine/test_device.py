"""vLLM's --device: the engine runs on the platform asked for, and a platform this host's
JAX lacks (or did not start on) is refused clearly, before anything loads."""

from __future__ import annotations

import jax
import pytest

from jllm import LLM
from jllm.engine.platform import select_platform


def test_device_names():
    default = jax.devices()[0].platform
    assert select_platform("auto") == default
    assert select_platform({"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}[default]) == default
    with pytest.raises(ValueError, match="device must be one of"):
        select_platform("npu")
    missing = [p for p in ("gpu", "tpu") if p != default]
    for platform in missing:
        try:
            jax.devices(platform)
        except RuntimeError:
            with pytest.raises(ValueError, match=f"no {platform} backend"):
                select_platform("cuda" if platform == "gpu" else platform)


def _has(platform: str) -> bool:
    try:
        jax.devices(platform)
    except RuntimeError:
        return False
    return True


def test_llm_refuses_a_missing_device(llama_dir):
    missing = next(p for p in ("tpu", "gpu") if not _has(p))  # no host has both
    with pytest.raises(ValueError, match=f"no {missing} backend"):
        LLM(llama_dir, device="cuda" if missing == "gpu" else missing)
