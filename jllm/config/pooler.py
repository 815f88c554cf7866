"""vLLM's `pooler_config` (engine level, `--pooler-config '<json>'`), parsed and checked; how
a model becomes a pooling model is jllm/pooling/model.py."""

from __future__ import annotations

import dataclasses

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
SEQ_POOLING_TYPES = ("LAST", "MEAN", "CLS")
TASKS = ("embed", "classify")


@dataclasses.dataclass
class PoolerConfig:
    """vLLM's PoolerConfig: `task` forces the pooling task; `pooling_type` is the shorthand
    for `seq_pooling_type` (LAST, MEAN or CLS: which token states make the vector; None:
    the sentence-transformers config's, else LAST); `use_activation` and `dimensions` are
    the defaults of requests that leave them unset; `logit_mean`/`logit_sigma` calibrate a
    classifier (act((x - mean) / sigma))."""

    task: str | None = None
    pooling_type: str | None = None
    seq_pooling_type: str | None = None
    use_activation: bool | None = None
    dimensions: int | None = None
    logit_mean: float | None = None
    logit_sigma: float | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"pooler_config task must be one of {list(TASKS)}, got {self.task!r}.")
        if self.pooling_type is not None:
            if self.seq_pooling_type is not None:
                raise ValueError("pooler_config: set pooling_type or seq_pooling_type, not both.")
            self.seq_pooling_type, self.pooling_type = self.pooling_type, None
        if self.seq_pooling_type is not None:
            self.seq_pooling_type = self.seq_pooling_type.upper()
            if self.seq_pooling_type not in SEQ_POOLING_TYPES:
                raise ValueError(
                    f"pooler_config seq_pooling_type must be one of {list(SEQ_POOLING_TYPES)}, "
                    f"got {self.seq_pooling_type!r}."
                )
        if self.logit_sigma == 0:
            raise ValueError("pooler_config logit_sigma must not be 0.")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"pooler_config dimensions must be >= 1, got {self.dimensions}.")

    @classmethod
    def create(cls, config) -> PoolerConfig | None:
        """From the engine argument: None, a dict (vLLM's JSON) or a PoolerConfig."""
        if config is None or isinstance(config, cls):
            return config
        if not isinstance(config, dict):
            raise ValueError("pooler_config must be a dict of PoolerConfig fields.")
        if "normalize" in config:
            raise ValueError("Parameter `normalize` was removed; use `use_activation` instead.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(config) - names
        if unknown:
            raise ValueError(
                f"Unknown pooler_config keys {sorted(unknown)}; jllm takes {sorted(names)}."
            )
        return cls(**config)
