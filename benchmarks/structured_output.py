"""The cost of structured outputs per step: the same requests with and without a JSON schema,
side by side in one run, on the embedded SmolLM2-135M-Instruct.

Each request asks for a list of people; with the schema every request's output must be a JSON
object holding an array of at least 40 {"name", "age"} objects, so no output can end before
`max_tokens` and both runs compute the same number of decode steps. Reported per run: output
tokens/s, engine steps, ms per step, and the host time per step spent filling the grammar
bitmasks (the matchers' work; the rest of a constrained step's extra cost is the bitmask's
transfer and the masking in the sampler). The runs alternate (free, schema, free, schema) so
that the machine's drift shows.

    python benchmarks/structured_output.py                   # xgrammar ("auto")
    python benchmarks/structured_output.py --backend guidance --requests 64
"""

from __future__ import annotations

import argparse
import platform
import time

import jax

from jllm import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            },
        }
    },
    "required": ["people"],
}
TOPICS = ["a village", "a ship's crew", "a chess club", "a band", "a lab", "a school class"]


class Timed:
    """Wraps a callable, adding up its calls' wall time."""

    def __init__(self, fn) -> None:
        self.fn, self.calls, self.seconds = fn, 0, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def run(llm, prompts, max_tokens: int, schema: bool) -> dict:
    engine = llm.llm_engine
    step, engine.core.step = engine.core.step, Timed(engine.core.step)
    fill = engine.structured.bitmask
    engine.structured.bitmask = Timed(fill)
    so = StructuredOutputsParams(json=SCHEMA) if schema else None
    params = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=max_tokens,
            ignore_eos=not schema,
            structured_outputs=so,
        )
        for i in range(len(prompts))
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    steps, filled = engine.core.step, engine.structured.bitmask
    engine.core.step, engine.structured.bitmask = step, fill
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "tokens": tokens,
        "tok/s": tokens / elapsed,
        "steps": steps.calls,
        "ms/step": steps.seconds / steps.calls * 1e3,
        "fill ms/step": filled.seconds / steps.calls * 1e3,
        "sample": outs[0].outputs[0].text[:60],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--backend", default="auto", choices=["auto", "xgrammar", "guidance"])
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    llm = LLM(
        dtype=args.dtype,
        structured_outputs_config={"backend": args.backend},
        disable_log_stats=True,
    )
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"List the people of {TOPICS[i % len(TOPICS)]} as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.requests)
    ]
    run(llm, prompts[:2], 8, True)  # warm: the grammar compiled, its steps seen once
    print(
        f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, "
        f"{args.requests} requests x {args.max_tokens} tokens, backend {args.backend}"
    )
    print("| run | output tokens | tok/s | steps | ms/step | bitmask fill ms/step |")
    print("|---|---|---|---|---|---|")
    results = {"free": [], "schema": []}
    for name in ("free", "schema", "free", "schema"):
        r = run(llm, prompts, args.max_tokens, name == "schema")
        results[name].append(r)
        print(
            f"| {name} | {r['tokens']} | {r['tok/s']:.1f} | {r['steps']} | {r['ms/step']:.1f} "
            f"| {r['fill ms/step']:.2f} |"
        )
    free = min(r["ms/step"] for r in results["free"])
    schema = min(r["ms/step"] for r in results["schema"])
    print(f"\nbest ms/step: free {free:.1f}, schema {schema:.1f} ({schema / free:.2f}x)")
    print("schema sample:", results["schema"][0]["sample"])


if __name__ == "__main__":
    main()
