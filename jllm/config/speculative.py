"""vLLM's `speculative_config`, parsed and checked (the proposers are in jllm/spec_decode)."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's method names that jllm does not build yet, refused by name.
NOT_YET = (
    "eagle",
    "eagle3",
    "suffix",
    "ngram_gpu",
    "medusa",
    "mlp_speculator",
)


def _int_at_least(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` (a dict offline, JSON for `--speculative-config`)."""

    method: str  # "ngram", "draft_model" or "mtp"
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    disable_by_batch_size: int | None = None
    # draft_model only: the draft checkpoint (same vocabulary as the target), how it is read.
    model: str | None = None
    quantization: str | None = None
    revision: str | None = None
    draft_tensor_parallel_size: int | None = None  # must equal the target's

    @classmethod
    def create(cls, spec: dict | None) -> SpeculativeConfig | None:
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        spec = {k.replace("-", "_"): v for k, v in spec.items()}
        known = {
            "method",
            "model",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
            "quantization",
            "revision",
            "draft_tensor_parallel_size",
        }
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}")
        model = spec.get("model")
        method = spec.get("method")
        if method is None:
            if model in ("ngram", "[ngram]"):
                method = "ngram"
            elif model is not None:
                method = "draft_model"
            else:
                raise ValueError(
                    "speculative_config needs a method ('ngram') or a draft model, e.g. "
                    '{"method": "ngram", "num_speculative_tokens": 4}.'
                )
        if method == "deepseek_mtp":  # vLLM's former name, replaced by "mtp"
            method = "mtp"
        if method in NOT_YET:
            raise ValueError(
                f"Speculative method {method!r} is not supported by jllm yet; use "
                "method='ngram', 'mtp' or a draft model ({'model': PATH})."
            )
        if method not in ("ngram", "draft_model", "mtp"):
            raise ValueError(f"Unsupported speculative method: {method!r}.")
        k = spec.get("num_speculative_tokens")
        if not _int_at_least(k, 1):
            raise ValueError(
                f"num_speculative_tokens must be an integer greater than zero, got {k!r}."
            )
        off = spec.get("disable_by_batch_size")
        if off is not None and not _int_at_least(off, 2):
            raise ValueError(
                "Expect the batch size threshold of disabling speculative decoding is > 1, "
                f"but got {off!r}"
            )
        if method == "mtp":  # the target's own MTP layers (a model path is the target's)
            return cls(method, k, disable_by_batch_size=off, model=model)
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config: method 'draft_model' needs a 'model' path.")
            dtp = spec.get("draft_tensor_parallel_size")
            if dtp is not None and not _int_at_least(dtp, 1):
                raise ValueError(f"draft_tensor_parallel_size must be >= 1, got {dtp!r}.")
            return cls(
                method,
                k,
                disable_by_batch_size=off,
                model=model,
                quantization=spec.get("quantization"),
                revision=spec.get("revision"),
                draft_tensor_parallel_size=dtp,
            )
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's defaults
        elif lo is None or hi is None:
            lo = hi = hi if lo is None else lo  # one given: both
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _int_at_least(value, 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return cls(method, k, lo, hi, off)
