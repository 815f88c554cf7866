"""Scheduler and engine core with a mock runner whose outputs can be computed by hand:
each sampled token is (last token + 1) mod 1000."""

from __future__ import annotations

from jllm.config import SchedulerConfig
from jllm.engine.core import EngineCore
from jllm.engine.kv_cache_manager import KVCacheManager
from jllm.engine.scheduler import Scheduler
from jllm.runner.sampled import SampledToken
from jllm.sampling_params import SamplingParams


class MockRunner:
    def __init__(self):
        self.steps = []

    def execute(self, out):
        self.steps.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        result = []
        for s in out.scheduled:
            if not s.samples:
                result.append(None)
                continue
            last = s.request.all_token_ids[-1]
            result.append(SampledToken((last + 1) % 1000, 0.0, 1, [], []))
        return result

    def free_request(self, request_id):
        pass


def make_core(num_blocks=64, block_size=4, budget=32, max_seqs=8, tile=1, caching=True):
    config = SchedulerConfig(max_seqs, budget, 128, True, tile)
    sched = Scheduler(config, KVCacheManager(num_blocks, block_size, caching))
    runner = MockRunner()
    return EngineCore(sched, runner, None, 128, eos_token_id=999), sched, runner


def run(core, limit=1000):
    done = {}
    for _ in range(limit):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            if out.finished:
                done[out.request_id] = out
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


def test_host_side_imports_no_jax():
    import subprocess
    import sys

    modules = [
        "jllm.config",
        "jllm.sampling_params",
        "jllm.engine.request",
        "jllm.engine.kv_cache_manager",
        "jllm.engine.scheduler",
        "jllm.engine.detokenizer",
        "jllm.engine.processor",
        "jllm.metrics.stats",
        "jllm.engine.core",
        "jllm.runner.sampled",
    ]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
