"""Beam search as vLLM runs it: on top of the engine, one single-token request per live beam
per step, so the beams of a prompt share its KV blocks (and each other's) through prefix
caching rather than through a special kernel.

Each step every live beam asks for its `2 * beam_width` most likely next tokens (raw
logprobs); every candidate extends its beam's cumulative logprob; a candidate ending in EOS
(unless `ignore_eos`) is set aside as completed; the other candidates of all the prompt's
beams are pooled and the best `beam_width` live on. After `max_tokens` steps (or when no beam
lives) the completed and live beams are ranked by `cum_logprob / num_generated **
length_penalty` and the best `beam_width` are returned.

`BeamSearch` holds one prompt's search and is driven by `LLM.beam_search` (all prompts'
beams in one `generate` call per step) and by the server (`use_beam_search`).
Host-side only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jllm.outputs import Logprob, RequestOutput
from jllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """A beam: `tokens` are the prompt's and the generated ones, `logprobs` one dict per
    generated token (the step's candidates, as vLLM)."""

    orig_prompt: object
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_search_score(num_generated: int, cum_logprob: float, length_penalty: float) -> float:
    """vLLM's ranking: the cumulative logprob over the generated length to a power."""
    return cum_logprob / max(num_generated, 1) ** length_penalty


class BeamSearch:
    def __init__(
        self, orig_prompt, prompt_token_ids: list[int], params: BeamSearchParams, eos_ids: set
    ) -> None:
        self.params = params
        self.num_prompt = len(prompt_token_ids)
        self.eos_ids = set() if params.ignore_eos else set(eos_ids)
        self.beams = [BeamSearchSequence(orig_prompt, list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def step_params(self) -> SamplingParams:
        return SamplingParams(
            logprobs=2 * self.params.beam_width,
            max_tokens=1,
            temperature=self.params.temperature,
            ignore_eos=True,
            detokenize=False,
        )

    def beam_tokens(self) -> list[list[int]]:
        """The tokens of each live beam (prompt and generated), in beam order: one
        single-token request each, continuing the prompt (`LLMEngine.continue_prompt`, which
        keeps its salt, adapter and images)."""
        return [beam.tokens for beam in self.beams]

    def advance(self, outputs: list[RequestOutput]) -> None:
        """Extend the beams with their step's outputs (in `prompts` order)."""
        candidates = []
        for beam, out in zip(self.beams, outputs, strict=True):
            entry = out.outputs[0].logprobs[0]
            for token, lp in entry.items():
                new = BeamSearchSequence(
                    beam.orig_prompt,
                    [*beam.tokens, token],
                    [*beam.logprobs, entry],
                    beam.cum_logprob + lp.logprob,
                )
                if token in self.eos_ids:
                    new.finish_reason, new.stop_reason = "stop", token
                    self.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The best `beam_width` of the completed and live beams."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(
            self.completed + self.beams,
            key=lambda b: beam_search_score(
                len(b.tokens) - self.num_prompt, b.cum_logprob, self.params.length_penalty
            ),
            reverse=True,
        )
        return ranked[: self.params.beam_width]
