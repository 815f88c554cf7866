"""Every runner manager's device writes reach a follower process by construction.

A leader engine's steps go through the real wire form (the codec's bytes) to an in-process
follower runner of an engine built alike; after a mixed workload (LoRA adapters, penalties,
logit bias, and a host KV tier that evicts and reloads blocks) every manager's arrays and
the KV cache are the same on both. Each manager's wire form is also checked on its own:
writes round-trip, and a malformed or missing entry is a MalformedMessage.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from lora_oracle import make_adapters
from oracle import prompt_ids

from jllm import LLM, SamplingParams
from jllm.distributed import codec
from jllm.distributed.codec import MalformedMessage
from jllm.lora.request import LoRARequest
from jllm.runner.encoder import ImageEncoder, PatchEncoder
from jllm.runner.manager import RunnerManager
from jllm.runner.penalty_state import PenaltyState
from jllm.runner.state_copies import StateCopies, rounds
from jllm.runner.step_message import StepPlan, from_message, to_message
from sharding import make_mesh, replicated

ENGINE = dict(
    dtype="float32",
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=128,
    num_gpu_blocks_override=24,  # 16-token blocks: the prompts below evict each other
    kv_offloading_size=0.02,
    enable_lora=True,
    max_loras=1,  # two adapters take turns in one slot: slot writes after admissions
    max_lora_rank=16,
    enforce_eager=True,
    disable_log_stats=True,
)


class Relay:
    """The leader's step channel: each message is encoded to bytes and decoded, as on the
    wire, then run by the follower's runner; records which managers' writes it carried."""

    def __init__(self, follower) -> None:
        self.follower = follower
        self.carried: set[str] = set()

    def send(self, message) -> None:
        message = codec.decode(codec.encode(message))
        plan = from_message(message, self.follower.step_layouts, self.follower.managers)
        for m in self.follower.managers:
            if plan.writes[m.name] != m.empty():
                self.carried.add(m.name)
        self.follower.run_step(plan)


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    return make_adapters(llama_dir, tmp_path_factory.mktemp("lora"), ("all8", "attn4"))


def test_every_managers_writes_reach_a_follower(llama_dir, adapters):
    leader, follower = LLM(llama_dir, **ENGINE), LLM(llama_dir, **ENGINE)
    lead, follow = leader.llm_engine.runner, follower.llm_engine.runner
    relay = lead.channel = Relay(follow)
    loras = [LoRARequest(n, i + 1, adapters[n][0]) for i, n in enumerate(("all8", "attn4"))]
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(4, 90, seed=3)]
    params = [
        SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=1, max_tokens=4, logit_bias={7: 5.0}),
        SamplingParams(temperature=0, max_tokens=4, presence_penalty=0.5, n=2),
    ]
    for _ in range(2):  # the second round's prefixes come back from the host tier
        for lora in [*loras, None]:
            leader.generate(prompts, [*params, params[0]], use_tqdm=False, lora_request=lora)
    assert (
        relay.carried
        == {m.name for m in lead.managers}
        == {
            "lora",
            "host_kv",
            "penalties",
            "bias",
        }
    )
    for m, f in zip(lead.managers, follow.managers, strict=True):
        for a, b in zip(m.device_arrays(lead), f.device_arrays(follow), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=m.name)
    for a, b in zip(lead.kv_cache, follow.kv_cache, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lead.channel = None


def test_a_managers_missing_writes_are_refused(llama_llm):
    runner = llama_llm.llm_engine.runner
    key, rs = runner.layout.shapes()[0], runner.layout.sample_buckets[0]
    layouts = runner.step_layouts(key, rs)
    plan = StepPlan(
        key=key,
        rs=rs,
        inputs=np.zeros(sum(int(np.prod(s)) for s, _ in layouts[0].leaves), np.int32),
        sampling=np.zeros(sum(int(np.prod(s)) for s, _ in layouts[1].leaves), np.int32),
        writes={m.name: m.empty() for m in runner.managers},
    )
    message = codec.decode(codec.encode(to_message(plan, runner.managers)))
    assert set(message["writes"]) == {m.name for m in runner.managers}
    assert from_message(message, runner.step_layouts, runner.managers).writes == plan.writes
    del message["writes"]["penalties"]
    with pytest.raises(MalformedMessage, match="managers"):
        from_message(message, runner.step_layouts, runner.managers)


def _encoder():
    vision = types.SimpleNamespace(
        num_channels=3, image_size=4, tokens_per_image=2, text_hidden_size=8
    )
    return ImageEncoder(None, vision, 3, 2, "float32", replicated(make_mesh(1)))


def test_patch_encoder_wire_form_checks_pages_and_grid():
    """Images cut at their own size: (pages, patches [n, K], grid) on the wire; pages past
    the pool, a grid that is not the patches', or too few pages are refused."""
    vision = types.SimpleNamespace(
        tokens_per_image=4, embed_width=8, unit=4, merge=2, patch_pixels=6
    )
    enc = PatchEncoder(None, vision, 5, 64, "float32", replicated(make_mesh(1)))
    px = np.ones((32, 6), np.float32)  # a 4x8 grid: 8 tokens, 2 pages
    images = [((3, 1), px, (1, 4, 8))]
    back = enc.decode(codec.decode(codec.encode(enc.encode(images))))
    assert back[0][0] == (3, 1) and back[0][2] == (1, 4, 8)
    np.testing.assert_array_equal(back[0][1], px)
    for bad in (
        [[[3, 5], px, [1, 4, 8]]],  # page 5 is past the pool
        [[[3], px, [1, 4, 8]]],  # 8 tokens need 2 pages
        [[[3, 1], px, [1, 4, 4]]],  # 16 patches, not 32
        [[[3, 1], px, [1, 3, 8]]],  # not whole merge squares
        [[[3, 1], np.ones((32, 5), np.float32), [1, 4, 8]]],
        [[[3, 1], px]],
    ):
        with pytest.raises(MalformedMessage):
            enc.decode(bad)


def _penalties():
    return PenaltyState(2, 32, 10, replicated(make_mesh(1)))


def test_each_wire_form_round_trips_and_checks():
    enc = _encoder()
    images = [((2,), np.ones((3, 4, 4), np.float32), None)]
    back = enc.decode(codec.decode(codec.encode(enc.encode(images))))
    assert back[0][0] == (2,) and np.array_equal(back[0][1], images[0][1])
    for bad in ([[3, images[0][1]]], [[0, np.ones((3, 4, 5), np.float32)]], [[0, [1.0]]]):
        with pytest.raises(MalformedMessage):
            enc.decode(bad)
    pen = _penalties()
    (w,) = pen.admit([(1, [4, 5], [6])])
    (got,) = pen.decode(codec.decode(codec.encode(pen.encode([w]))))
    for a, b in zip(
        (w.reset_rows, w.rows, w.tokens, w.is_output),
        (got.reset_rows, got.rows, got.tokens, got.is_output),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(MalformedMessage):
        pen.decode([[w.reset_rows, w.rows[:3], w.tokens[:3], w.is_output[:3]]])


def test_state_copies_wire_form_and_rounds():
    """The prefix cache's state copies: (group, source, destination) triples on the wire,
    a group with no state refused; a copy that reads what an earlier one writes goes in a
    later call."""
    copies = StateCopies({1: 1}, 4, replicated(make_mesh(1)))
    writes = [(1, 3, 5), (1, 5, 7)]
    assert copies.decode(codec.decode(codec.encode(copies.encode(writes)))) == writes
    for bad in ([[0, 3, 5]], [[1, 3]], [["1", 3, 5]]):
        with pytest.raises(MalformedMessage):
            copies.decode(bad)
    assert rounds([(3, 5), (4, 6), (5, 7), (6, 8), (9, 3)]) == [
        [(3, 5), (4, 6)],
        [(5, 7), (6, 8), (9, 3)],
    ]


def test_every_manager_kind_is_covered():
    """A new manager class must join this file's checks: the relay engine's managers or
    the unit checks above."""
    covered = {"lora", "host_kv", "state_copies", "penalties", "bias", "images"}
    assert {m.name for m in RunnerManager.__subclasses__()} == covered
