"""The step channel without pickle: a connection without the cluster's token is refused and
the channel goes on; frames carry data only, so a pickle payload (even with a valid HMAC)
is refused without being run, and a frame with a wrong HMAC is refused."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading

import numpy as np
import pytest
from openai_server import free_port

from jllm.distributed.channel import StepChannel, _mac
from jllm.distributed.codec import MalformedMessage, decode, encode

TOKEN = os.urandom(32)


def serve(port: int, result: list) -> threading.Thread:
    def run():
        result.append(StepChannel.serve("127.0.0.1", port, 1, TOKEN, timeout=60))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_wrong_token_is_refused_then_the_follower_connects(caplog):
    port, result = free_port(), []
    thread = serve(port, result)
    stray = StepChannel.connect("127.0.0.1", port, 1, os.urandom(32), timeout=30)
    assert stray.leader.recv(1) == b""  # closed by process 0
    follower = StepChannel.connect("127.0.0.1", port, 1, TOKEN, timeout=30)
    thread.join(timeout=60)
    leader = result[0]
    assert "refused a connection" in caplog.text
    step = {"kind": "step", "key": [4, 0], "inputs": np.arange(6, dtype=np.int32)}
    leader.send(step)
    got = follower.recv()
    assert got["key"] == [4, 0] and np.array_equal(got["inputs"], step["inputs"])
    leader.close(timeout=1)
    assert follower.recv() == {"kind": "stop"}
    follower.hang_up()


class Boom:
    """Unpickling this would create a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def raw_pair(token: bytes):
    a, b = socket.socketpair()
    follower = StepChannel(token)
    follower.leader = b
    return a, follower


def test_pickle_payload_is_refused_and_never_run(tmp_path):
    target = tmp_path / "ran"
    payload = pickle.dumps(Boom(str(target)))
    sender, follower = raw_pair(TOKEN)
    sender.sendall(struct.pack("!Q", len(payload)) + _mac(TOKEN, payload) + payload)
    with pytest.raises(MalformedMessage):
        follower.recv()
    assert not target.exists()
    with pytest.raises(MalformedMessage):
        decode(payload)


def test_wrong_hmac_is_refused():
    payload = encode({"kind": "stop"})
    sender, follower = raw_pair(TOKEN)
    sender.sendall(struct.pack("!Q", len(payload)) + _mac(os.urandom(32), payload) + payload)
    with pytest.raises(MalformedMessage, match="HMAC"):
        follower.recv()


@pytest.mark.parametrize(
    "message",
    [
        {"kind": "step", "x": np.zeros(3, np.complex64)},  # a dtype outside the schema
        {"kind": "step", "x": object()},
    ],
)
def test_only_schema_data_encodes(message):
    with pytest.raises(TypeError):
        encode(message)
