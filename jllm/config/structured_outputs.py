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
    apply to every request. `reasoning_parser` (the engine argument `reasoning_parser`, the
    server's `--reasoning-parser`): a request's grammar applies once its reasoning has
    ended, unless `enable_in_reasoning` (jllm/structured_output/reasoning.py)."""

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

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
    def create(cls, config, guided_decoding_backend: str | None = None, reasoning_parser=None):
        """From the engine arguments: a dict or a config, vLLM's older
        `guided_decoding_backend` name for the backend, and `reasoning_parser`."""
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
        if reasoning_parser:
            out = dataclasses.replace(out, reasoning_parser=reasoning_parser)
        return out
