"""The host cache of LoRA adapters under the server's processor pool: an adapter is read once
however many requests ask for it at once, and a slow read holds up only the requests for
that adapter."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from jllm.lora import manager
from jllm.lora.manager import LoraCache
from jllm.lora.request import LoRARequest


@pytest.fixture
def reads(monkeypatch):
    """Adapter reads recorded; a read of "slow" waits for `release`."""
    log = SimpleNamespace(names=[], entered=threading.Event(), release=threading.Event())

    def load(name, int_id, path, targets, num_layers, max_rank, rows=None):
        log.names.append(name)
        if name == "slow":
            log.entered.set()
            assert log.release.wait(60)
        if name == "broken":
            raise ValueError("not a PEFT folder")
        return SimpleNamespace(name=name, path=path, digest=name.encode())

    monkeypatch.setattr(manager, "load_peft_adapter", load)
    return log


def test_a_slow_read_holds_up_only_its_own_adapter(reads):
    cache = LoraCache({}, 1, 8, capacity=4)
    slow, fast = LoRARequest("slow", 1, "/a"), LoRARequest("fast", 2, "/b")
    with ThreadPoolExecutor(4) as pool:
        waiting = [pool.submit(cache.get, slow) for _ in range(3)]
        assert reads.entered.wait(60)
        assert cache.get(fast).name == "fast"  # while "slow" is being read
        assert not any(f.done() for f in waiting)
        reads.release.set()
        got = [f.result(60) for f in waiting]
    assert all(a is got[0] for a in got) and got[0].request is slow
    assert reads.names.count("slow") == 1
    assert cache.get(slow) is got[0] and reads.names.count("slow") == 1  # cached


def test_a_failed_read_fails_its_askers_and_is_tried_again(reads):
    cache = LoraCache({}, 1, 8, capacity=4)
    broken = LoRARequest("broken", 3, "/c")
    for _ in range(2):
        with pytest.raises(ValueError, match="not a PEFT folder"):
            cache.get(broken)
    assert reads.names == ["broken", "broken"] and 3 not in cache
