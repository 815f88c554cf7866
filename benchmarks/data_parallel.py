"""What data parallelism adds to a step, at DP = 1, 2, 4 on fake CPU devices.

Fake devices share this machine's cores, so D shards cannot run D times the work here;
what can be measured is what the shards cost around the same work: the host's time per
step (building D shards' inputs from D input batches, `throughput.py`'s step timer), the
step's device time, and the collectives in the compiled forward and sampler (a dense
model's shards exchange nothing: the count should stay what one replica's is).

The model is SmolLM2-135M's shape with 32 layers (as `pipeline.py`'s), random weights,
float32. The workload: 16 prompts of 64 tokens, 32 tokens out each, spread over the shards.

    python benchmarks/throughput.py --data-parallel-size 1 2 4
"""

from __future__ import annotations

import gc
import re
import shutil
import time

import numpy as np
from pipeline import INPUT, LAYERS, OUTPUT, PROMPTS, config_dir

COLLECTIVES = r"(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(?:-start)?\("


def collectives(llm, tokens: int) -> int:
    """Collective ops in the compiled forward of `tokens` tokens and the largest sampler."""
    runner = llm.llm_engine.runner
    hlo = runner.forward_for((tokens,)).as_text()
    hlo += runner.table._table[("sampler", runner.layout.sample_buckets[-1])].as_text()
    return len(re.findall(COLLECTIVES, hlo))


def run(sizes, run_jllm, step_timer) -> None:
    from jllm import LLM

    path = config_dir()
    rng = np.random.default_rng(0)
    reqs = [(rng.integers(100, 40000, INPUT).tolist(), OUTPUT) for _ in range(PROMPTS)]
    rows = []
    try:
        for dp in sizes:
            llm = LLM(
                path,
                load_format="dummy",
                skip_tokenizer_init=True,
                dtype="float32",
                max_model_len=512,
                kv_cache_memory_bytes=256 << 20,  # per device: fake devices share the host
                max_num_seqs=PROMPTS,
                data_parallel_size=dp,
                async_scheduling=False,
                disable_log_stats=True,
            )
            timer = step_timer(llm.llm_engine.runner, False)
            run_jllm(llm, reqs[:4], "warm-up")
            timer.records.clear()
            start = time.perf_counter()
            result = run_jllm(llm, reqs, f"DP={dp}")
            wall = time.perf_counter() - start
            step, host, _ = timer.host_profile(PROMPTS)
            per_shard = PROMPTS // dp
            tokens = next(b for b in llm.llm_engine.runner.layout.token_buckets if b >= per_shard)
            rows.append((dp, result["tok_s"], wall, step, host, collectives(llm, tokens)))
            del llm, timer
            gc.collect()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    print(
        f"\nSmolLM2 shape x {LAYERS} layers, float32, {PROMPTS} x {INPUT} in x {OUTPUT} out, "
        "fake CPU devices sharing the cores"
    )
    print(
        "| DP | tok/s | decode step ms | host ms per step | collectives in the step |\n"
        "|---|---|---|---|---|"
    )
    for dp, tok_s, _, step, host, count in rows:
        print(f"| {dp} | {tok_s:.1f} | {step:.1f} | {host:.2f} | {count} |")
