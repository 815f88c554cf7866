"""`jllm bench latency|throughput|serve`: vLLM's benchmark commands, with its flag names and
its printed and saved results, on jllm (`benchmarks/` keeps the side-by-side comparisons
with peers, and calls this code for its datasets)."""
