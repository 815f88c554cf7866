"""vLLM's CPU backend on several offline workloads in one start-up, timed as jllm's
`benchmarks/throughput.py` times its own runs. Runs inside the peer's venv (the set-up in
`../shared/peers/vllm_cpu/setup.sh`); `throughput.py --peer vllm-cpu` starts it.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \
      python vllm_cpu_offline.py --model MODEL_DIR --workloads W.json --dtype bfloat16

With `--dummy`: random weights (`load_format="dummy"`) and no tokenizer, for a folder that
holds only a config.json (benchmarks/deepseek.py's shapes).

With `--lora-paths '["dir", ...]' --max-loras N`: LoRA enabled (rank up to 16) and the
requests round-robin over those PEFT adapters (an empty list: the base model only).

W.json: {name: {"prompts": [[token ids], ...], "max_tokens": [int, ...]}}: greedy, EOS
ignored, each request exactly its max_tokens. A workload may add "n" (samples per prompt),
"temperature" (unseeded: vLLM's CPU sampler fails on per-request seeds, "CPU Generator
does not use offset", 2026-11-27) and "logprobs" (the sampled token's, as an RL
rollout asks). The last line printed is one JSON object:
{name: {"seconds", "tokens", "tok_s", "ttft" (one-request workloads)}, "startup_s": ...}.
Engine settings are jllm's defaults: max_num_batched_tokens 2048, max_num_seqs 256.
"""

import argparse
import json
import os
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lora-paths", default=None, help="JSON list of PEFT folders")
    ap.add_argument("--max-loras", type=int, default=1)
    ap.add_argument("--dummy", action="store_true", help="random weights, no tokenizer")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    lora = {}
    if args.lora_paths is not None:  # requests round-robin over these adapters
        paths = json.loads(args.lora_paths)
        adapters = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
        lora = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=16)

    with open(args.workloads) as f:
        workloads = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=4096,
        seed=0,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        **lora,
        **(dict(load_format="dummy", skip_tokenizer_init=True) if args.dummy else {}),
    )
    results = {"startup_s": time.perf_counter() - t0}
    warm = [TokensPrompt(prompt_token_ids=list(range(100, 108)))] * 8
    llm.generate(warm, SamplingParams(max_tokens=8), use_tqdm=False)
    for name, w in workloads.items():
        prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
        params = [
            SamplingParams(
                n=w.get("n", 1),
                temperature=w.get("temperature", 0.0),
                logprobs=w.get("logprobs"),
                max_tokens=n,
                min_tokens=n,
                ignore_eos=True,
            )
            for n in w["max_tokens"]
        ]
        ttft = None
        if len(prompts) == 1:
            t1 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            ttft = time.perf_counter() - t1
        t1 = time.perf_counter()
        requests = None
        if lora and adapters:
            requests = [adapters[i % len(adapters)] for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
        seconds = time.perf_counter() - t1
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        assert tokens == w.get("n", 1) * sum(w["max_tokens"]), (name, tokens)
        results[name] = {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}
        if ttft is not None:
            results[name]["ttft"] = ttft
    print(json.dumps(results), flush=True)
    os._exit(0)  # vLLM's engine core process goes with it


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
