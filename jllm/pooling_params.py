"""vLLM's `PoolingParams`: what a pooling request (an embedding, a classification, a score)
asks of the pooled vector. Host-side only."""

from __future__ import annotations

import dataclasses

# The parameters each task takes (vLLM's `valid_parameters`).
VALID_PARAMETERS = {"embed": ("dimensions", "use_activation"), "classify": ("use_activation",)}


@dataclasses.dataclass
class PoolingParams:
    """`use_activation`: an embedding's L2 normalization, a classifier's softmax/sigmoid
    (None: the pooler config's, else True). `dimensions`: a Matryoshka embedding's size
    (the vector is cut, then normalized). `task` is set by the API that sends the request
    (`LLM.embed`: "embed")."""

    use_activation: bool | None = None
    dimensions: int | None = None
    task: str | None = None
    # vLLM's STEP pooling parameters, which jllm does not offer: refused when set.
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    def clone(self) -> PoolingParams:
        return dataclasses.replace(self)

    def verify(self, spec, model_name: str) -> PoolingParams:
        """A copy with the pooler config's defaults merged in and checked against the model's
        pooling spec (jllm/pooling/model.py PoolingSpec): ValueError with vLLM's messages."""
        if self.task not in VALID_PARAMETERS:
            raise ValueError(f"Unsupported task: {self.task!r}")
        out = self.clone()
        valid = VALID_PARAMETERS[out.task]
        step = [k for k in ("step_tag_id", "returned_token_ids") if getattr(out, k) is not None]
        if step:
            raise ValueError(
                f"Task {out.task} only supports {list(valid)} parameters, does not support "
                f"{step} parameters"
            )
        for k in valid:
            if getattr(out, k) is None:
                setattr(out, k, getattr(spec.pooler, k))
        if out.use_activation is None:
            out.use_activation = True
        invalid = [k for k in ("dimensions", "use_activation") if k not in valid]
        invalid = [k for k in invalid if getattr(out, k) is not None]
        if invalid:
            raise ValueError(
                f"Task {out.task!r} only supports {list(valid)} parameters, does not support "
                f"{invalid} parameters"
            )
        d = out.dimensions
        if out.task == "embed" and d is not None:
            if not spec.is_matryoshka:
                raise ValueError(
                    f"Model {model_name!r} does not support Matryoshka embeddings; dimensions "
                    f"must be unset (received dimensions={d})."
                )
            if not 1 <= d <= spec.embedding_size:
                raise ValueError(
                    f"Model {model_name!r} only supports dimensions in range "
                    f"[1, {spec.embedding_size}], got {d}."
                )
            if spec.matryoshka_dimensions is not None and d not in spec.matryoshka_dimensions:
                raise ValueError(
                    f"Model {model_name!r} only supports Matryoshka dimensions "
                    f"{spec.matryoshka_dimensions}, got {d}."
                )
        return out
