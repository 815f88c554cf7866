"""The host KV tier on the CPU: a multi-turn chat load whose histories outgrow the device's
KV pool, and a preempting load, each with and without `kv_offloading_size`, in one run.

Chat: `--conversations` conversations of `--turns` turns on the embedded SmolLM2; each starts
with a `--history`-token history (random ids) and every turn appends 64 user tokens and the
model's 32-token answer. All conversations of a turn are submitted together, so between
turns the device pool (a quarter of the histories, `num_gpu_blocks_override`) evicts most of
them: without the tier the next turn recomputes them, with it the prefix comes back from
host memory. Reported for the turns after the first: mean time to first token and the
prompt tokens computed (prompt minus cached).

Preempting: `--conversations` requests of `--history` / 2 prompt tokens and 256 output
tokens on the same small pool (8 running requests outgrow it while they decode); reported:
the preemptions, the tokens computed in all (a preempted request recomputes what it lost,
or reloads it) and the time.

What to expect: a load copies a block (16 tokens x 30 layers x 2 x 3 x 64 x 2 bytes =
360 KiB in bf16) in tens of microseconds, where recomputing it costs 16 tokens of prefill
(a few ms on this CPU): time to first token of later turns falls towards that of the new
tokens alone.

    python benchmarks/host_kv_tier.py [--conversations 16 --turns 4 --history 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jllm import LLM, SamplingParams

BLOCK = 16


def chat(llm, histories, turns: int, rng) -> tuple[float, int]:
    """Mean TTFT (s) and prompt tokens computed over turns 2.."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ttfts, computed = [], 0
    for turn in range(turns):
        for h in histories:
            h.extend(rng.integers(100, 40000, 64).tolist())
        outs = llm.generate(
            [{"prompt_token_ids": list(h)} for h in histories], params, use_tqdm=False
        )
        for h, out in zip(histories, outs, strict=True):
            h.extend(out.outputs[0].token_ids)
            if turn:
                m = out.metrics
                ttfts.append(m.first_token_time - m.arrival_time)
                computed += len(out.prompt_token_ids) - out.num_cached_tokens
    return statistics.mean(ttfts), computed


def preempting(llm, prompts) -> tuple[float, int, int]:
    scheduler = llm.llm_engine.scheduler
    schedule, total = scheduler.schedule, [0]

    def counted():
        out = schedule()
        total[0] += out.total_num_scheduled_tokens
        return out

    scheduler.schedule = counted
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    before = scheduler.num_preemptions
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    del scheduler.schedule
    return elapsed, total[0], scheduler.num_preemptions - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--host-gib", type=float, default=2.0)
    args = ap.parse_args()
    per_conv = (args.history + args.turns * 96) // BLOCK + 1
    pool = max(8, args.conversations * per_conv // 4)  # a quarter of the histories
    common = dict(
        max_model_len=args.history + args.turns * 96 + 256,
        num_gpu_blocks_override=pool,
        max_num_seqs=8,
        disable_log_stats=True,
    )
    print(
        f"device pool: {pool} blocks of {BLOCK} tokens; {args.conversations} conversations "
        f"of {args.history}+ tokens; host tier {args.host_gib} GiB"
    )
    rows = []
    for name, extra in (
        ("without the tier", {}),
        ("with the tier", {"kv_offloading_size": args.host_gib}),
    ):
        llm = LLM(**common, **extra)
        rng = np.random.default_rng(0)
        histories = [
            rng.integers(100, 40000, args.history).tolist() for _ in range(args.conversations)
        ]
        ttft, computed = chat(llm, histories, args.turns, rng)
        llm.reset_prefix_cache()
        half = args.history // 2
        prompts = [rng.integers(100, 40000, half).tolist() for _ in range(args.conversations)]
        elapsed, total, preemptions = preempting(llm, prompts)
        rows.append((name, ttft, computed, elapsed, total, preemptions))
        del llm
    print(
        f"{'':18} {'TTFT (turns 2+)':>16} {'prompt tokens computed':>23} "
        f"{'preempting load':>16} {'tokens computed':>16} {'preemptions':>12}"
    )
    for name, ttft, computed, elapsed, total, preemptions in rows:
        print(
            f"{name:18} {ttft:15.3f}s {computed:23d} {elapsed:15.1f}s {total:16d} {preemptions:12d}"
        )


if __name__ == "__main__":
    main()
