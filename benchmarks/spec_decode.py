"""Speculative decoding: jllm with n-gram prompt lookup and with draft models against jllm
without speculation, in one run.

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

Workload (b), draft models, on the same requests: SmolLM2 as its own draft (the upper bound
on acceptance: nearly every greedy draft is accepted, the cost is a second SmolLM2 pass per
drafted token) and a smaller random-initialised draft (the lower bound: its drafts are
noise, the cost is what is left).

    python benchmarks/spec_decode.py                  # default dtype, every engine
    python benchmarks/spec_decode.py --methods ngram  # plain and n-gram only
    python benchmarks/spec_decode.py --dtype bfloat16 --k 3
    python benchmarks/spec_decode.py --disable-by-batch-size 4   # no drafts above 4 requests
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import tempfile
import time

import jax

from jllm import LLM, SamplingParams
from jllm.metrics.stats import SpecDecodingStats
from jllm.model_loader import resolve_model

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


def random_draft(path: str) -> str:
    """A smaller random-initialised Llama of SmolLM2's vocabulary (4 layers of width 256, 17%
    of SmolLM2's non-embedding parameters): the lower bound, its drafts are noise."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["ngram", "draft-self", "draft-random"],
        choices=["ngram", "draft-self", "draft-random"],
        help="the speculative engines run beside the plain one",
    )
    args = ap.parse_args()
    common = {"num_speculative_tokens": args.k}
    if args.disable_by_batch_size:
        common["disable_by_batch_size"] = args.disable_by_batch_size
    smollm2 = str(resolve_model(None).path)
    tmp = tempfile.mkdtemp(prefix="jllm-draft-")
    specs = {
        "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        "draft-self": {"model": smollm2},
    }
    if "draft-random" in args.methods:
        specs["draft-random"] = {"model": random_draft(tmp)}
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    convs = chats()
    results = {}
    engines = [("plain", {})] + [
        (m, {"speculative_config": {**specs[m], **common}}) for m in args.methods
    ]
    for name, extra in engines:
        llm = LLM(dtype=args.dtype, disable_log_stats=True, **extra)
        stats = SpecStats()
        llm.llm_engine.core.stat_loggers.append(stats)
        llm.chat(convs[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        results[name] = {"dtype": llm.llm_engine.dtype.name}
        for w in ("single", "batch8"):
            stats.stats = SpecDecodingStats()
            results[name][w] = (*timed(llm, convs, params, batch=w == "batch8"), stats.stats)
        llm.llm_engine.shutdown()
        del llm
        # Drop the engine's executables: each loaded one keeps memory mappings, and four
        # engines' worth reach the kernel's limit (LLVM "Cannot allocate memory").
        gc.collect()
        jax.clear_caches()
    shutil.rmtree(tmp, ignore_errors=True)

    plain = results["plain"]
    print(f"\ndtype {plain['dtype']}; k={args.k}; n-gram lookup 2-4; greedy, 8 requests")
    print("| workload (a) | engine | tok/s | / plain | mean acceptance length | same tokens |")
    print("|---|---|---|---|---|---|")
    for w, label in (("single", "single stream"), ("batch8", "batch 8")):
        p_rate, p_tokens, _ = plain[w]
        print(f"| {label} | plain | {p_rate:.1f} | 1.00x | | |")
        for name in args.methods:
            rate, tokens, s = results[name][w]
            same = f"{sum(a == b for a, b in zip(p_tokens, tokens, strict=True))}/{len(tokens)}"
            mal = f"{1 + s.num_accepted_tokens / s.num_drafts:.2f}" if s.num_drafts else "-"
            print(f"| {label} | {name} | {rate:.1f} | {rate / p_rate:.2f}x | {mal} | {same} |")
    for name in args.methods:
        s = results[name]["single"][2]
        if s.num_drafts:
            rates = ", ".join(f"{n / s.num_drafts:.2f}" for n in s.accepted_per_pos)
            print(
                f"{name}, single stream: {s.num_accepted_tokens} of {s.num_draft_tokens} draft "
                f"tokens accepted in {s.num_drafts} drafts; per-position acceptance {rates}"
            )


if __name__ == "__main__":
    main()
