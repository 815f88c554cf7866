"""vLLM's CPU backend embedding texts (`runner="pooling"`, `convert="embed"`), timed as
`benchmarks/embeddings.py` times jllm. Runs inside the peer's venv; embeddings.py starts it
(through throughput.run_vllm_cpu).

W.json: {name: {"texts": [str, ...]}}. The last line printed is one JSON object:
{"startup_s": ..., name: {"seconds", "texts"}}.
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
    args = ap.parse_args()
    from vllm import LLM

    with open(args.workloads) as f:
        workloads = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        runner="pooling",
        convert="embed",
        dtype=args.dtype,
        max_model_len=4096,
        seed=0,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
    )
    results = {"startup_s": time.perf_counter() - t0}
    llm.embed(["warm up"] * 8, use_tqdm=False)
    for name, w in workloads.items():
        t1 = time.perf_counter()
        outs = llm.embed(w["texts"], use_tqdm=False)
        results[name] = {"seconds": time.perf_counter() - t1, "texts": len(outs)}
    print(json.dumps(results), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
