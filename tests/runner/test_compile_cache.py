"""The persistent compilation cache: a second start of the same configuration compiles
nothing, with jllm's own directory and with one the operator set (JAX_COMPILATION_CACHE_DIR),
where JAX's default threshold (keep only executables that took a second) used to skip every
small bucket."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import pytest

from jllm.runner.compile_cache import enable_compilation_cache

START = """
import json, sys
import jax
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
from jllm import LLM
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=2, max_num_batched_tokens=32,
          max_model_len=64, kv_cache_memory_bytes=4 << 20, disable_log_stats=True)
print(json.dumps({
    "compiles": events.count("/jax/compilation_cache/cache_misses"),
    "loaded": events.count("/jax/compilation_cache/cache_hits"),
    "dir": jax.config.jax_compilation_cache_dir,
}))
"""


def start(model: str, env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")} | env
    out = subprocess.run(
        [sys.executable, "-c", START, model], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"log": out.stderr}


@pytest.mark.parametrize("where", ["jllm", "operator"])
def test_second_start_compiles_nothing(llama_dir, tmp_path, where):
    if where == "jllm":
        env, cache = {"XDG_CACHE_HOME": str(tmp_path)}, tmp_path / "jllm" / "xla"
    else:
        cache = tmp_path / "operator-cache"
        env = {"XDG_CACHE_HOME": str(tmp_path / "unused"), "JAX_COMPILATION_CACHE_DIR": str(cache)}
    first = start(llama_dir, env)
    assert first["dir"] == str(cache) and first["compiles"] > 10
    assert f"XLA compilation cache: {cache}" in first["log"]
    second = start(llama_dir, env)  # every executable from the cache, none compiled
    assert (second["compiles"], second["loaded"]) == (0, first["compiles"])
    assert re.search(r"\(0 executables compiled, [1-9]\d* loaded from the comp", second["log"])
    assert re.search(r"Engine ready in [\d.]+ seconds: loading the model [\d.]+ s, ", second["log"])


def test_a_threshold_the_user_set_is_kept():
    """jllm lowers JAX's default threshold, not one the user chose."""
    name = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, name)
    try:
        jax.config.update(name, 5.0)
        enable_compilation_cache()
        assert getattr(jax.config, name) == 5.0
        jax.config.update(name, 1.0)  # JAX's default
        enable_compilation_cache()
        assert getattr(jax.config, name) == 0.0
    finally:
        jax.config.update(name, before)
