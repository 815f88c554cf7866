"""vLLM's pooling routes: `/v1/embeddings`, `/pooling`, `/classify`, `/score` (and
`/v1/score`), `/rerank` (and `/v1/rerank`, `/v2/rerank`), mounted for a pooling model in
place of the generation routes (jllm/pooling)."""
