"""vLLM's `structured_outputs_config` (engine level), parsed and checked; the backends and the
engine's manager are in jllm/structured_output."""

from __future__ import annotations

import dataclasses

BACKENDS = ("auto", "xgrammar", "guidance")
# vLLM names of backends jllm does not ship.
OTHER_VLLM_BACKENDS = ("outlines", "lm-format-enforcer")


@dataclasses.dataclass
class StructuredOutputsConfig:
    """vLLM's `structured_outputs_config` (engine level). `backend`: "auto" (xgrammar when
    it is installed, falling back per request to guidance for a constraint xgrammar cannot
    take, unless `disable_fallback`), "xgrammar" or "guidance". The `disable_*` options
    apply to every request."""

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.backend in OTHER_VLLM_BACKENDS:
            raise ValueError(
                f"The {self.backend!r} structured outputs backend is not supported by jllm; "
                f"use one of {list(BACKENDS)}."
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"structured outputs backend must be one of {list(BACKENDS)}, got {self.backend!r}."
            )

    @classmethod
    def create(cls, config, guided_decoding_backend: str | None = None):
        """From the engine arguments: a dict or a config, and vLLM's older
        `guided_decoding_backend` name for the backend."""
        if isinstance(config, cls):
            out = config
        else:
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = set(config or {}) - names
            if unknown:
                raise ValueError(
                    f"Unknown structured_outputs_config keys {sorted(unknown)}; jllm takes "
                    f"{sorted(names)}."
                )
            out = cls(**(config or {}))
        if guided_decoding_backend is not None:
            out = dataclasses.replace(out, backend=guided_decoding_backend)
        return out
