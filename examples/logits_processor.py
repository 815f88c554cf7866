"""A custom logits processor, vLLM V1's engine-level kind, written for jllm's jitted sampler.

`ForceToken` makes a request generate only the token named by its
`SamplingParams(extra_args={"target_token": id})`; requests without it are untouched (the
same behaviour as the dummy processor of vLLM's logits-processor example).

    python examples/logits_processor.py           # the embedded SmolLM2
    python examples/logits_processor.py MODEL_DIR

The engine can also load it by name: `LLM(model, logits_processors=["logits_processor:ForceToken"])`
(or the server's `--logits-processors logits_processor:ForceToken`) with this folder importable.
"""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np

from jllm import LLM, SamplingParams
from jllm.logits_process import LogitsProcessor


class ForceToken(LogitsProcessor):
    state_shape = ()  # one int32 per request: the token to force
    state_dtype = np.int32

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        target = (params.extra_args or {}).get("target_token")
        if target is not None and not isinstance(target, int):
            raise ValueError(f"target_token must be a token id, got {target!r}.")

    def row_state(self, params: SamplingParams):
        target = (params.extra_args or {}).get("target_token")
        if target is None:
            return None  # leave this request alone
        if not 0 <= target < self.config.vocab_size:
            raise ValueError(f"target_token {target} is outside the vocabulary.")
        return target

    def apply(self, logits, state, active):
        # Traced into the sampler: logits [R, V], state [R], active [R].
        vocab = jnp.arange(logits.shape[-1])[None, :]
        keep = (vocab == state[:, None]) | ~active[:, None]
        return jnp.where(keep, logits, -jnp.inf)


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    llm = LLM(model, logits_processors=[ForceToken], max_model_len=512)
    tok = llm.get_tokenizer()
    (target,) = tok.encode(" array", add_special_tokens=False)
    prompts = ["The best array library is", "The capital of France is"]
    params = [
        SamplingParams(temperature=0, max_tokens=5, extra_args={"target_token": target}),
        SamplingParams(temperature=0, max_tokens=5),
    ]
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
