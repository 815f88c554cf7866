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

import re

from pipeline import INPUT, LAYERS, OUTPUT, PROMPTS, sweep

COLLECTIVES = r"(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(?:-start)?\("


def collectives(llm, tokens: int) -> int:
    """Collective ops in the compiled forward of `tokens` tokens and the largest sampler."""
    runner = llm.llm_engine.runner
    hlo = runner.forward_for((tokens,)).as_text()
    hlo += runner.table._table[("sampler", runner.layout.sample_buckets[-1])].as_text()
    return len(re.findall(COLLECTIVES, hlo))


def run(sizes, run_jllm, step_timer) -> None:
    def extra(llm, dp):
        tokens = next(b for b in llm.llm_engine.runner.layout.token_buckets if b >= PROMPTS // dp)
        return (collectives(llm, tokens),)

    rows = sweep("data_parallel_size", sizes, run_jllm, step_timer, extra)
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
