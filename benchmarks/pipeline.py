"""What the pipeline schedule adds to a step, at PP = 1, 2, 4 on fake CPU devices.

Fake devices share this machine's cores, so the pipeline's fill cannot show speed here (a
stage's work does not run beside another's); what can be measured is what the schedule
costs around the same work: the host's time per step (the step's wall time less the time
the device part took, as `throughput.py`'s step timer measures it) and the transfers per
step. Transfers are counted from the compiled forward itself (its HLO: the stage-boundary
`collective-permute` inside the tick loop, the `all-reduce` that hands the last stage's
output to every device) and the schedule's trip count: M + S - 1 ticks of one permute of
[T/M, D] each.

The model is SmolLM2-135M's shape with 32 layers instead of 30 (so that 4 stages divide it),
random weights (`load_format="dummy"`), float32 (the XLA products: the CPU's layer kernels
run only on a mesh of one device). The workload: 16 prompts of 64 tokens, 32 tokens out each.

    python benchmarks/throughput.py --pipeline-parallel-size 1 2 4
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import tempfile
import time

import numpy as np

LAYERS = 32
PROMPTS, INPUT, OUTPUT = 16, 64, 32


def config_dir() -> str:
    from jllm.model_loader import resolve_model

    config = resolve_model(None).hf_config.to_dict()
    config.update(num_hidden_layers=LAYERS, architectures=["LlamaForCausalLM"])
    out = tempfile.mkdtemp(prefix="pp-bench-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def transfers(llm, tokens: int) -> tuple[int, int, int]:
    """(permutes per step, their bytes, all-reduces per step) of the forward of `tokens`
    tokens: the HLO's ops, the permute counted once per tick of the schedule."""
    from jllm.models.pipeline import micro_batch_count

    runner = llm.llm_engine.runner
    hlo = runner.forward_for((tokens,)).as_text()
    permutes = len(re.findall(r"collective-permute(?:-start)?\(", hlo))
    reduces = len(re.findall(r"all-reduce(?:-start)?\(", hlo))
    stages = runner.mesh.shape["stage"]
    if stages == 1:
        return 0, 0, reduces
    ragged = runner.attention.prefill_tile is None  # the XLA backend's tiles are not cut
    micro = micro_batch_count(tokens, stages) if ragged else 1
    ticks = micro + stages - 1
    width = llm.llm_engine.model_config.hidden_size
    per_permute = tokens // micro * width * llm.llm_engine.dtype.itemsize
    return permutes * ticks, permutes * ticks * per_permute, reduces


def sweep(argument: str, sizes, run_jllm, step_timer, extra) -> list[tuple]:
    """An engine per size with `argument` (pipeline_parallel_size, data_parallel_size) set
    to it, on the SmolLM2 x LAYERS shape: (size, tok/s, wall s, decode step ms, host ms per
    step, *extra(llm, size)) for each."""
    from jllm import LLM

    path = config_dir()
    rng = np.random.default_rng(0)
    reqs = [(rng.integers(100, 40000, INPUT).tolist(), OUTPUT) for _ in range(PROMPTS)]
    rows = []
    try:
        for size in sizes:
            llm = LLM(
                path,
                load_format="dummy",
                skip_tokenizer_init=True,
                dtype="float32",
                max_model_len=512,
                kv_cache_memory_bytes=256 << 20,  # per device: fake devices share the host
                max_num_seqs=PROMPTS,
                async_scheduling=False,
                disable_log_stats=True,
                **{argument: size},
            )
            timer = step_timer(llm.llm_engine.runner, False)
            run_jllm(llm, reqs[:4], "warm-up")
            timer.records.clear()
            start = time.perf_counter()
            result = run_jllm(llm, reqs, f"{argument}={size}")
            wall = time.perf_counter() - start
            step, host, _ = timer.host_profile(PROMPTS)
            rows.append((size, result["tok_s"], wall, step, host, *extra(llm, size)))
            del llm, timer
            gc.collect()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return rows


def run(sizes, run_jllm, step_timer) -> None:
    rows = sweep(
        "pipeline_parallel_size",
        sizes,
        run_jllm,
        step_timer,
        lambda llm, _: transfers(llm, PROMPTS),
    )
    print(
        f"\nSmolLM2 shape x {LAYERS} layers, float32, {PROMPTS} x {INPUT} in x {OUTPUT} out, "
        "fake CPU devices sharing the cores"
    )
    print(
        "| PP | tok/s | decode step ms | host ms per step | permutes per step | "
        "bytes permuted per step | all-reduces |\n|---|---|---|---|---|---|---|"
    )
    for pp, tok_s, _, step, host, permutes, nbytes, reduces in rows:
        print(
            f"| {pp} | {tok_s:.1f} | {step:.1f} | {host:.2f} | {permutes} | {nbytes} | {reduces} |"
        )
