"""Scheduler and engine core with a mock runner whose outputs can be computed by hand:
each sampled token is (last token + 1) mod 1000."""

from __future__ import annotations

import pytest
from kv_specs import groups

from jllm.config import SchedulerConfig
from jllm.engine.core import EngineCore
from jllm.engine.kv_cache_manager import KVCacheManager, block_key
from jllm.engine.scheduler import Scheduler
from jllm.outputs import CompletionOutput, RequestOutput
from jllm.runner.sampled import SampledToken
from jllm.sampling_params import SamplingParams
from jllm.scheduler_output import ModelRunnerOutput
from jllm.utils import cdiv


class MockRunner:
    """Keeps its own copy of each request from the scheduler's deltas, as the real runner's
    input batch does: it never sees a `Request`. A row verifying drafts accepts them while
    they equal the rule's tokens, then emits the rule's next token."""

    def __init__(self):
        self.steps = []
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def execute(self, out):
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tokens.pop(rid)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.computed[rid] = computed
        self.steps.append(list(out.num_scheduled_tokens.items()))
        result = ModelRunnerOutput()
        for rid, n in out.num_scheduled_tokens.items():
            tokens = self.tokens[rid]
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            if self.computed[rid] + n - len(drafts) < len(tokens):
                continue
            emitted = []
            for d in [*drafts, None]:
                nxt = ((emitted or tokens)[-1] + 1) % 1000
                emitted.append(nxt)
                if d != nxt:
                    break
            tokens.extend(emitted)
            result.sampled[rid] = [SampledToken(t, 0.0, 1, [], []) for t in emitted]
        return result


def make_core(
    num_blocks=64,
    block_size=4,
    budget=32,
    max_seqs=8,
    tile=1,
    caching=True,
    lookahead=0,
    policy="fcfs",
):
    config = SchedulerConfig(max_seqs, budget, 128, True, tile, lookahead, policy)
    sched = Scheduler(config, KVCacheManager(num_blocks, block_size, caching))
    runner = MockRunner()
    return RecordingCore(sched, runner, 128, eos_token_id=999), sched, runner


class RecordingCore(EngineCore):
    """The core, gathering each sequence's tokens from its step outputs (which hold only
    the new ones)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tokens: dict[str, list[int]] = {}

    def step(self):
        outputs = super().step()
        for out in outputs.outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return outputs


def run(core, limit=1000):
    """Step until idle; each finished request's tokens and finish, as an output."""
    done = {}
    for _ in range(limit):
        if not core.has_unfinished_requests():
            break
        for out in core.step().outputs:
            if out.finished:
                tokens = core.tokens[out.request_id]
                seq = CompletionOutput(
                    0, "", tokens, None, None, out.finish_reason, out.stop_reason
                )
                done[out.request_id] = RequestOutput(out.request_id, None, [], None, [seq], True)
    return done


def params(n=5, **kw):
    return SamplingParams(max_tokens=n, detokenize=False, **kw)


def test_generation_by_hand():
    core, _, runner = make_core()
    core.add_request("a", [10, 11, 12], params(4))
    core.add_request("b", [500], params(2))
    done = run(core)
    assert done["a"].outputs[0].token_ids == [13, 14, 15, 16]
    assert done["b"].outputs[0].token_ids == [501, 502]
    assert runner.steps[0] == [("a", 3), ("b", 1)]
    assert runner.steps[1] == [("a", 1), ("b", 1)]


def test_stop_tokens_eos_and_min_tokens():
    core, _, _ = make_core()
    core.add_request("eos", [996], params(10))  # 997, 998, 999=EOS
    core.add_request("ignore", [996], params(5, ignore_eos=True))
    core.add_request("stop", [10], params(10, stop_token_ids=[13]))
    core.add_request("min", [10], params(10, stop_token_ids=[12], min_tokens=3))
    done = run(core)
    assert done["eos"].outputs[0].token_ids == [997, 998, 999]
    assert done["eos"].outputs[0].finish_reason == "stop"
    assert done["eos"].outputs[0].stop_reason is None
    assert done["ignore"].outputs[0].token_ids == [997, 998, 999, 0, 1]
    assert done["ignore"].outputs[0].finish_reason == "length"
    assert done["stop"].outputs[0].token_ids == [11, 12, 13]
    assert done["stop"].outputs[0].stop_reason == 13
    # min_tokens=3: 12 comes second and is ignored as a stop; nothing stops it later.
    assert done["min"].outputs[0].token_ids == list(range(11, 21))


def test_budget_chunks_prefill_and_decodes_first():
    core, _, runner = make_core(budget=8, tile=1)
    core.add_request("a", list(range(20)), params(2))
    core.add_request("b", [1, 2], params(3))
    run(core)
    assert runner.steps[0] == [("a", 8)]
    assert runner.steps[1] == [("a", 8)]
    assert runner.steps[2] == [("a", 4), ("b", 2)]
    assert runner.steps[3] == [("a", 1), ("b", 1)]


def test_tiles_round_the_budget():
    core, _, runner = make_core(budget=20, tile=8)
    core.add_request("a", list(range(30)), params(1))
    run(core)
    # 30 tokens cost 32 > 20: the chunk is cut to whole tiles (16), then 14 (costs 16).
    assert runner.steps[0] == [("a", 16)]
    assert runner.steps[1] == [("a", 14)]


def test_max_num_seqs_caps_running():
    core, sched, runner = make_core(max_seqs=2)
    for i in range(4):
        core.add_request(str(i), [i], params(3))
    core.step()
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    done = run(core)
    assert len(done) == 4
    assert max(len(s) for s in runner.steps) == 2


def test_preemption_recomputes_and_output_is_unchanged():
    reference, _, _ = make_core()
    for i in range(4):
        reference.add_request(str(i), list(range(i, i + 6)), params(12))
    expected = {k: v.outputs[0].token_ids for k, v in run(reference).items()}

    core, sched, runner = make_core(num_blocks=9, block_size=4)
    for i in range(4):
        core.add_request(str(i), list(range(i, i + 6)), params(12))
    done = run(core)
    assert {k: v.outputs[0].token_ids for k, v in done.items()} == expected
    assert sched.num_preemptions > 0
    assert sched.kv_cache.num_free_blocks == 8


def test_abort_frees_blocks():
    core, sched, _ = make_core()
    core.add_request("a", list(range(10)), params(50))
    core.step()
    assert sched.kv_cache.num_free_blocks < 63
    core.abort_request(["a"])
    assert not core.has_unfinished_requests()
    assert sched.kv_cache.num_free_blocks == 63


class Proposer:
    """Drafts the rule's next 3 tokens, or wrong ones."""

    def __init__(self, wrong):
        self.wrong = wrong

    def propose(self, req, num_running=1):
        last = req.all_token_ids[-1]
        return [(last + i + (7 if self.wrong else 0)) % 1000 for i in (1, 2, 3)]


def test_drafts_verified_and_rejected_positions_recomputed():
    expected = {"a": list(range(13, 23)), "b": list(range(501, 505))}
    for wrong, steps in ((False, 4), (True, 10)):
        core, sched, runner = make_core(lookahead=3, block_size=4)
        core.proposer = Proposer(wrong)
        core.add_request("a", [10, 11, 12], params(10))
        core.add_request("b", [500], params(4))
        done = run(core)
        assert {k: v.outputs[0].token_ids for k, v in done.items()} == expected
        # a: the prefill gives 1 token, then each step verifies 3 drafts: 1 + 4 + 4 + 1
        assert len(runner.steps) == steps
        if not wrong:  # b has 3 tokens left: 2 drafts, whose 3 tokens end it
            assert runner.steps[1] == [("a", 4), ("b", 3)]
        # every cached block is a block of a's or b's real tokens, never of a draft
        kv = sched.kv_cache
        keys = set()
        for seq in ([10, 11, 12, *range(13, 23)], [500, *range(501, 505)]):
            parent = None
            for i in range(len(seq) // 4):
                parent = block_key(parent, seq[i * 4 : (i + 1) * 4])
                keys.add(parent)
        cached = kv.pools[0].cached  # the one KV-cache group
        assert cached and set(cached) <= keys


def test_host_side_imports_no_jax():
    import subprocess
    import sys

    modules = [
        "jllm.config",
        "jllm.sampling_params",
        "jllm.engine.request",
        "jllm.kv_cache_interface",
        "jllm.engine.block_pool",
        "jllm.engine.single_type_manager",
        "jllm.engine.kv_cache_manager",
        "jllm.engine.scheduler",
        "jllm.engine.detokenizer",
        "jllm.engine.processor",
        "jllm.metrics.stats",
        "jllm.engine.core",
        "jllm.engine.step_budget",
        # the front end and the core's interface (the output processor and its thread)
        "jllm.engine.outputs",
        "jllm.engine.core_client",
        "jllm.engine.output_processor",
        "jllm.engine.logprobs",
        "jllm.engine.output_thread",
        "jllm.entrypoints.media",
        "jllm.runner.sampled",
        "jllm.scheduler_output",
    ]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def first_scheduled(runner) -> list[str]:
    order = []
    for step in runner.steps:
        order += [rid for rid, _ in step if rid not in order]
    return order


def test_priority_orders_the_waiting_queue():
    """Lower priority value first, ties by arrival; fcfs ignores priority (as vLLM)."""
    for policy, want in (("fcfs", ["a", "b", "c", "d"]), ("priority", ["b", "d", "c", "a"])):
        core, _, runner = make_core(max_seqs=1, policy=policy)
        for rid, prio in (("a", 5), ("b", -1), ("c", 2), ("d", -1)):
            core.add_request(rid, [1, 2], params(2), priority=prio)
        done = run(core)
        assert first_scheduled(runner) == want, policy
        assert all(done[r].outputs[0].token_ids == [3, 4] for r in "abcd")


def test_priority_preempts_the_lowest_priority_first():
    """Four usable blocks of 4 tokens; "low" is admitted a step before "high". In the fifth
    step "high" needs a block: fcfs preempts the last admitted ("high" itself), priority
    preempts "low", which was already scheduled in that step and is taken back out of it."""
    for policy, victim in (("fcfs", "high"), ("priority", "low")):
        core, sched, runner = make_core(num_blocks=5, caching=False, policy=policy)
        victims = []
        preempt = sched._preempt
        sched._preempt = lambda req, v=victims, p=preempt: (v.append(req.request_id), p(req))
        core.add_request("low", [1, 2, 3, 4], params(6), priority=1)
        core.step()
        core.add_request("high", [11, 12, 13, 14, 15, 16], params(6), priority=0)
        done = run(core)
        assert victims == [victim], policy
        if policy == "priority":
            assert runner.steps[4] == [("high", 1)]  # "low" taken back out of the step
        assert done["low"].outputs[0].token_ids == [5, 6, 7, 8, 9, 10]
        assert done["high"].outputs[0].token_ids == [17, 18, 19, 20, 21, 22]


def test_draft_lookahead_slots_are_a_wish():
    """With a draft model the scheduler allocates k slots past a sampling step's tokens
    (where the drafts are written), capped at what could still be emitted; when the pool
    has no room for them the request runs without, and nothing is preempted for them (a
    request that fits the pool alone would otherwise preempt itself for ever)."""
    config = SchedulerConfig(8, 32, 128, True, 1, 3, "fcfs", num_draft_lookahead=3)
    sched = Scheduler(config, KVCacheManager(4, 4, False))  # 3 usable blocks of 4 slots
    core = RecordingCore(sched, MockRunner(), 128, eos_token_id=999)
    core.add_request("b", [7, 8, 9], params(2))  # 3 + 2 ahead (max_tokens caps the 3)
    core.step()
    assert len(sched.kv_cache.block_ids("b")[0]) == 2
    assert run(core)["b"].outputs[0].token_ids == [10, 11]
    core.add_request("a", list(range(1, 10)), params(4))  # 9 + 3 ahead: all 3 blocks
    core.step()
    assert len(sched.kv_cache.block_ids("a")[0]) == 3
    # Its next decodes want slots up to 13 (a 4th block): they run in the 3 it has.
    assert run(core)["a"].outputs[0].token_ids == [10, 11, 12, 13]
    assert sched.num_preemptions == 0


class WindowRunner(MockRunner):
    """Keeps each request's block tables from the deltas, as the real runner does, and
    checks before each step that every block a row reads is live: in a sliding group from
    c-W+1 on (the entries before it NULL in the scheduler's lists, stale ids in the tables),
    the tables agreeing there, and no request holding more than `max_blocks_per_request`."""

    def __init__(self, kv, max_step):
        super().__init__()
        self.kv, self.max_step = kv, max_step
        self.tables: dict[str, list[list[int]]] = {}
        self.null_hits = 0  # requests admitted from a hit with skipped (NULL) blocks

    def execute(self, out):
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid)
        start = {}
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(b) for b in new.block_ids]
            start[new.req_id] = new.num_computed_tokens
            self.null_hits += new.num_computed_tokens > 0 and 0 in new.block_ids[-1]
        cached = out.scheduled_cached_reqs
        for rid, ids, c in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            for table, new_ids in zip(self.tables[rid], ids, strict=True):
                table.extend(new_ids)
            start[rid] = c
        size = self.kv.block_size
        for rid, n in out.num_scheduled_tokens.items():
            c = start[rid]
            groups = zip(self.kv.block_ids(rid), self.tables[rid], self.kv.specs, strict=True)
            for held, table, spec in groups:
                first = spec.num_skipped_tokens(c) // size
                assert len(table) == len(held) >= cdiv(c + n, size)
                assert set(held[:first]) <= {0} and 0 not in held[first:]
                assert table[first:] == held[first:]
                bound = spec.max_blocks_per_request(10**6, size, self.max_step)
                assert len(held) - first <= bound
        return super().execute(out)


@pytest.mark.parametrize("shared", [False, True], ids=["own-pools", "one-pool"])
def test_sliding_window_requests_keep_their_window_live(shared):
    """A full and a sliding group (W=8, S=4, a small pool for the window, or one pool for
    both): requests with drafts (right, or all rejected), lookahead slots, a shared prompt
    admitted from a hit whose early sliding blocks are NULL, and preemptions, give the rule's
    tokens."""
    expected = {"a": list(range(40, 100)), "b": list(range(40, 100)), "c": list(range(130, 190))}
    for wrong in (False, True):
        config = SchedulerConfig(4, 12, 512, True, 1, 3, "fcfs", num_draft_lookahead=3)
        if shared:
            kv = KVCacheManager(48, 4, True, groups(None, 8), pools=[0, 0])
        else:
            kv = KVCacheManager([40, 16], 4, True, groups(None, 8))
        sched = Scheduler(config, kv)
        runner = WindowRunner(kv, max_step=12 + 3)
        core = RecordingCore(sched, runner, 512, eos_token_id=999)
        core.proposer = Proposer(wrong)
        core.add_request("a", list(range(40)), params(60))
        core.add_request("c", list(range(100, 130)), params(60))
        for _ in range(4):
            core.step()
        core.add_request("b", list(range(40)), params(60))
        done = run(core)
        assert {k: v.outputs[0].token_ids for k, v in done.items()} == expected
        assert runner.null_hits and sched.num_preemptions
        assert kv.group_num_free == ((47, 47) if shared else (39, 15))


class AsyncMockRunner(MockRunner):
    """The mock runner behind async scheduling: a step's tokens come back with the fetch
    that follows the next step's dispatch."""

    def dispatch(self, out):
        return self.execute(out)

    def fetch(self, handle):
        return handle


def test_priority_preempts_a_victim_skipped_in_the_step():
    """Two usable blocks of 4 tokens; "low" (priority 1) is admitted before "high". Under
    async scheduling "low"'s last token is in flight in the third step, so the step skips it;
    "high" then needs a second block and the lowest priority is "low", which sits before
    "high" but was never scheduled in the step: it is preempted all the same (as vLLM), and
    its in-flight token still ends it."""
    core, sched, runner = make_core(num_blocks=3, caching=False, policy="priority")
    core.runner = AsyncMockRunner()
    core.async_scheduling = True
    victims = []
    preempt = sched._preempt
    sched._preempt = lambda req, p=preempt: (victims.append(req.request_id), p(req))
    core.add_request("low", [1, 2, 3], params(2), priority=1)
    core.step()
    core.add_request("high", [11, 12, 13, 14], params(5), priority=0)
    done = run(core)
    assert victims == ["low"]
    assert core.runner.steps[2] == [("high", 1)]
    assert done["low"].outputs[0].token_ids == [4, 5]
    assert done["high"].outputs[0].token_ids == [15, 16, 17, 18, 19]
    assert sched.kv_cache.num_free_blocks == 2


def test_without_same_step_hits_each_step_hits_only_earlier_steps():
    """Under pipeline stages (`same_step_hits=False`) two requests with one prompt admitted
    in one step each compute it; a third, a step later, hits its full blocks."""
    config = SchedulerConfig(8, 32, 128, True, 1, 0, "fcfs")
    sched = Scheduler(config, KVCacheManager(64, 4, True, same_step_hits=False))
    core = RecordingCore(sched, MockRunner(), 128, eos_token_id=999)
    prompt = list(range(9))
    core.add_request("a", prompt, params(3))
    core.add_request("b", prompt, params(3))
    core.step()
    core.add_request("c", prompt, params(3))
    done = run(core)
    assert core.runner.steps[0] == [("a", 9), ("b", 9)]
    assert core.runner.steps[1] == [("a", 1), ("b", 1), ("c", 1)]
    assert all(done[r].outputs[0].token_ids == [9, 10, 11] for r in "abc")
