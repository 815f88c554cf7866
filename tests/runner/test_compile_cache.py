"""The persistent compilation cache: a second start of the same configuration compiles
nothing, with jllm's own directory and with one the operator set (JAX_COMPILATION_CACHE_DIR),
where JAX's default threshold (keep only executables that took a second) used to skip every
small bucket. One restart covers both: the first start writes the operator's directory, and
the second finds the same directory as jllm's own (under XDG_CACHE_HOME) and compiles nothing;
that jllm's own directory keeps every executable too is checked in process (the threshold)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax

from jllm.runner.compile_cache import _KEEP_ALL, enable_compilation_cache

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


def share_kernel_builds(xdg: Path) -> None:
    """The C++ kernels this process built (pallas_kernels/cpu/build.py caches them under
    XDG_CACHE_HOME too), for a start under `xdg`: the XLA cache is the subject here, and a
    fresh XDG_CACHE_HOME would otherwise rebuild every kernel with GCC first."""
    root = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    built = Path(root) / "jllm" / "kernels"
    built.mkdir(parents=True, exist_ok=True)
    (xdg / "jllm").mkdir(parents=True, exist_ok=True)
    (xdg / "jllm" / "kernels").symlink_to(built, target_is_directory=True)


def test_second_start_compiles_nothing(llama_dir, tmp_path):
    share_kernel_builds(tmp_path)
    cache = tmp_path / "jllm" / "xla"  # jllm's own directory under XDG_CACHE_HOME
    # The operator sets the directory: every executable is written there.
    operator = {"XDG_CACHE_HOME": str(tmp_path), "JAX_COMPILATION_CACHE_DIR": str(cache)}
    first = start(llama_dir, operator)
    assert first["dir"] == str(cache) and first["compiles"] > 10
    assert f"XLA compilation cache: {cache}" in first["log"]
    # No directory set: jllm's own is the same one, and every executable comes from it.
    second = start(llama_dir, {"XDG_CACHE_HOME": str(tmp_path)})
    assert second["dir"] == str(cache)
    assert f"XLA compilation cache: {cache}" in second["log"]
    assert (second["compiles"], second["loaded"]) == (0, first["compiles"])
    assert re.search(r"\(0 executables compiled, [1-9]\d* loaded from the comp", second["log"])
    assert re.search(r"Engine ready in [\d.]+ seconds: loading the model [\d.]+ s, ", second["log"])


def test_jllms_own_directory_keeps_every_executable(tmp_path, monkeypatch):
    """With no directory set, jllm makes its own under XDG_CACHE_HOME and lowers JAX's
    threshold there too (the start above wrote through the operator's directory)."""
    names = ("jax_compilation_cache_dir", *_KEEP_ALL)
    before = {name: getattr(jax.config, name) for name in names}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in _KEEP_ALL:
        monkeypatch.delenv(name.upper(), raising=False)
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        for name, (default, _) in _KEEP_ALL.items():
            jax.config.update(name, default)
        path = enable_compilation_cache()
        assert path == str(tmp_path / "jllm" / "xla") == jax.config.jax_compilation_cache_dir
        assert (tmp_path / "jllm" / "xla").is_dir()
        for name, (_, keep_all) in _KEEP_ALL.items():
            assert getattr(jax.config, name) == keep_all, name
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


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
