"""Speculative decoding: jllm with n-gram prompt lookup against jllm without it, in one run.

Workload (a), input-grounded: SmolLM2-135M-Instruct is asked to repeat, or lightly edit,
a text given in the prompt, so its answer copies spans of the prompt, the case prompt
lookup serves. Eight chat requests, greedy, up to 128 output tokens each, run one at a
time (single stream) and all together (batch 8), by an engine without speculation and by
one with `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 4}`. Printed: output tok/s of each, their ratio, the mean acceptance
length (1 + accepted / drafts, vLLM's definition), the per-position acceptance rate, and
how many requests got the same tokens from both engines: all in float32 (greedy
verification is exact); in bf16 a verification row's logits come from another step shape
than a decode's, so a near-tie can go the other way, as between batch shapes without
speculation.

    python benchmarks/spec_decode.py                  # default dtype
    python benchmarks/spec_decode.py --dtype bfloat16 --k 3
    python benchmarks/spec_decode.py --disable-by-batch-size 4   # no drafts above 4 requests
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from jllm import LLM, SamplingParams
from jllm.metrics.stats import SpecDecodingStats

TEXTS = [
    "The scheduler admits requests in arrival order and gives every running request one "
    "token per step before it spends the rest of the budget on prompt chunks.",
    "Blocks of the key and value cache are sixteen tokens long. A block that holds a full "
    "prefix is kept after its request finishes, so a later request can reuse it.",
    "To bake the bread, mix the flour, water, salt and yeast, leave the dough to rise for "
    "two hours, shape it, and bake it for forty minutes in a hot oven.",
    "Our meeting moves from Tuesday to Thursday at ten. Please bring the quarterly report, "
    "the budget draft and the list of open questions from last week.",
    "The river rises in the northern hills, runs south through three towns and a long "
    "valley of farms, and reaches the sea beside the old harbour.",
    "Each layer normalises its input, attends over the cached keys and values, adds the "
    "result back, and then applies a gated feed-forward block.",
    "Customers can return any item within thirty days if it is unused and in its original "
    "box. Refunds are paid to the card used for the purchase.",
    "The library opens at nine on weekdays and at eleven on Saturdays. It is closed on "
    "Sundays and public holidays, and the reading room closes an hour early.",
]
TASKS = [
    "Repeat the following text exactly, word for word:",
    "Rewrite the following text, changing only the first word:",
]


def chats():
    return [
        [{"role": "user", "content": f"{TASKS[i % 2]}\n\n{text}"}] for i, text in enumerate(TEXTS)
    ]


class SpecStats:
    """A stat logger that keeps the engine's spec-decode counts."""

    def __init__(self):
        self.stats = SpecDecodingStats()

    def record(self, step, sched):
        self.stats.add(step.spec_decoding)


def timed(llm, convs, params, batch: bool):
    t0 = time.perf_counter()
    if batch:
        outs = llm.chat(convs, params, use_tqdm=False)
    else:
        outs = [llm.chat(c, params, use_tqdm=False)[0] for c in convs]
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    args = ap.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    if args.disable_by_batch_size:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    convs = chats()
    results = {}
    for name, extra in (("plain", {}), ("ngram", {"speculative_config": spec})):
        llm = LLM(dtype=args.dtype, disable_log_stats=True, **extra)
        stats = SpecStats()
        llm.llm_engine.core.stat_loggers.append(stats)
        llm.chat(convs[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        stats.stats = SpecDecodingStats()
        results[name] = {
            "dtype": llm.llm_engine.dtype.name,
            "single": timed(llm, convs, params, batch=False),
            "batch8": timed(llm, convs, params, batch=True),
            "spec": stats.stats,
        }
        llm.llm_engine.shutdown()
        del llm

    plain, ngram = results["plain"], results["ngram"]
    print(f"\ndtype {plain['dtype']}; n-gram config {spec}")
    print(
        "| workload (a), 8 requests | plain tok/s | n-gram tok/s | n-gram / plain | same tokens |"
    )
    print("|---|---|---|---|---|")
    for w, label in (("single", "single stream"), ("batch8", "batch 8")):
        (p_rate, p_tokens), (n_rate, n_tokens) = plain[w], ngram[w]
        same = f"{sum(a == b for a, b in zip(p_tokens, n_tokens, strict=True))}/{len(p_tokens)}"
        print(f"| {label} | {p_rate:.1f} | {n_rate:.1f} | {n_rate / p_rate:.2f}x | {same} |")
    s = ngram["spec"]
    if s.num_drafts:
        rates = ", ".join(f"{n / s.num_drafts:.2f}" for n in s.accepted_per_pos)
        print(
            f"mean acceptance length {1 + s.num_accepted_tokens / s.num_drafts:.2f} "
            f"({s.num_accepted_tokens} of {s.num_draft_tokens} draft tokens accepted in "
            f"{s.num_drafts} drafts); per-position acceptance {rates}"
        )
    print("draft-model speculation (workload b): not built yet")


if __name__ == "__main__":
    main()
