"""The step channel: process 0 sends each step's inputs to the other processes over TCP.

Messages are data only (`codec.py`: msgpack with numpy arrays of a few dtypes, a few KB per
step), on a plain socket rather than a JAX collective so that nothing is compiled for them.
Nothing a socket hands a process is unpickled or executed.

A shared secret guards the channel: process 0 draws a 32-byte token and sends it to every
process of the JAX cluster with JAX's own broadcast (`open_step_channel`); a process that
connects must present it, and a connection that does not is refused and logged. Every frame
carries an HMAC-SHA256 of its payload under the token, which the follower checks, so bytes
injected into the stream are refused too. A follower that receives a malformed message stops
with a clear error; process 0, which watches every connection from a thread, reports the
follower's exit by name at the next step instead of leaving the others waiting in a
collective.

Frame: 8-byte payload length, 32-byte HMAC, payload. Connect: 8-byte rank, 32-byte token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time

from jllm.distributed.codec import MalformedMessage, decode, encode

logger = logging.getLogger("jllm")

_HEADER = struct.Struct("!Q")
TOKEN_BYTES = 32
_MAC_BYTES = 32
MAX_MESSAGE_BYTES = 1 << 30


class ProcessLostError(RuntimeError):
    """Another process of the cluster exited; the model cannot run any more."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _mac(token: bytes, payload: bytes) -> bytes:
    return hmac.new(token, payload, hashlib.sha256).digest()


class StepChannel:
    def __init__(self, token: bytes) -> None:
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"The step channel's token must be {TOKEN_BYTES} bytes.")
        self.token = token
        self.peers: dict[int, socket.socket] = {}
        self.leader: socket.socket | None = None
        self.lost: list[int] = []
        self.closing = False
        self.broken = False  # a process exited out of turn (`exit_if_broken`)
        self._gone = threading.Condition()

    # ---- process 0 -----------------------------------------------------------------------
    @classmethod
    def serve(
        cls, host: str, port: int, num_followers: int, token: bytes, timeout: float = 600
    ) -> StepChannel:
        """Wait for every other process to connect (they send their rank and the token);
        a connection without the token, or for a rank out of range, is refused and
        logged."""
        channel = cls(token)
        server = socket.create_server((host, port), reuse_port=False)
        server.settimeout(timeout)
        try:
            while len(channel.peers) < num_followers:
                conn, address = server.accept()
                rank = channel._admit(conn, address, num_followers)
                if rank is not None:
                    channel.peers[rank] = conn
        except TimeoutError as e:
            missing = sorted(set(range(1, num_followers + 1)) - set(channel.peers))
            raise ProcessLostError(f"Processes {missing} never connected.") from e
        finally:
            server.close()
        for rank, conn in channel.peers.items():
            threading.Thread(target=channel._watch, args=(rank, conn), daemon=True).start()
        logger.info("Step channel: %d other processes connected.", num_followers)
        return channel

    def _admit(self, conn: socket.socket, address, num_followers: int) -> int | None:
        """The rank of a connecting process that presents the token, else None (closed)."""
        conn.settimeout(10)
        try:
            hello = _recv_exact(conn, _HEADER.size + TOKEN_BYTES)
        except (EOFError, OSError):
            hello = b""
        rank = _HEADER.unpack(hello[: _HEADER.size])[0] if len(hello) >= _HEADER.size else -1
        token = hello[_HEADER.size :]
        if not hmac.compare_digest(token, self.token) or not 1 <= rank <= num_followers:
            logger.warning(
                "Step channel: refused a connection from %s (wrong token or rank).", address
            )
            conn.close()
            return None
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return rank

    def _watch(self, rank: int, conn: socket.socket) -> None:
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        with self._gone:
            if rank not in self.lost:
                self.lost.append(rank)
                if not self.closing:
                    self.broken = True
                    logger.error(
                        "Process %d of the cluster exited; the engine cannot continue.", rank
                    )
            self._gone.notify_all()

    def send(self, message) -> None:
        if self.lost:
            raise ProcessLostError(
                f"Process(es) {sorted(self.lost)} of the cluster exited; the model is split "
                "over them, so no step can run. Restart every process."
            )
        frame = self._frame(message)
        for rank, conn in self.peers.items():
            try:
                conn.sendall(frame)
            except OSError as e:
                self.lost.append(rank)
                self.broken = True
                raise ProcessLostError(f"Process {rank} of the cluster is gone: {e}") from e

    def close(self, timeout: float = 30) -> None:
        """Tell the other processes to stop and wait until they hang up, so that they leave
        JAX's cluster in order before process 0 (which hosts its coordinator) does."""
        if not self.peers:
            return
        self.closing = True
        logger.info("Stopping the other %d processes.", len(self.peers))
        for conn in self.peers.values():
            try:
                conn.sendall(self._frame({"kind": "stop"}))
            except OSError:
                pass
        with self._gone:
            self._gone.wait_for(lambda: set(self.peers) <= set(self.lost), timeout)
        for conn in self.peers.values():
            conn.close()
        self.peers.clear()

    # ---- the other processes -------------------------------------------------------------
    @classmethod
    def connect(
        cls, host: str, port: int, rank: int, token: bytes, timeout: float = 600
    ) -> StepChannel:
        channel = cls(token)
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ProcessLostError(f"Process 0 at {host}:{port} never answered.") from None
                time.sleep(0.2)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_HEADER.pack(rank) + token)
        channel.leader = sock
        return channel

    def hang_up(self) -> None:
        """A follower that got "stop" closes its end, which process 0 is waiting for."""
        if self.leader is not None:
            self.leader.close()
            self.leader = None

    def recv(self) -> dict:
        """The next message, as data; MalformedMessage (the follower must stop) for a
        frame whose HMAC is wrong or whose payload is not a step-channel message."""
        try:
            (n,) = _HEADER.unpack(_recv_exact(self.leader, _HEADER.size))
            if n > MAX_MESSAGE_BYTES:
                raise MalformedMessage(f"a frame of {n} bytes")
            mac = _recv_exact(self.leader, _MAC_BYTES)
            payload = _recv_exact(self.leader, n)
        except (EOFError, OSError) as e:
            self.broken = True
            raise ProcessLostError("Process 0 of the cluster exited.") from e
        if not hmac.compare_digest(mac, _mac(self.token, payload)):
            raise MalformedMessage("a frame whose HMAC does not match the channel's token")
        message = decode(payload)
        if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
            raise MalformedMessage("a message without its kind")
        return message

    def _frame(self, message: dict) -> bytes:
        payload = encode(message)
        return _HEADER.pack(len(payload)) + _mac(self.token, payload) + payload


def exit_if_broken(channel: StepChannel) -> None:
    """At exit, after the engine's own shutdown: a process of a cluster that lost another
    cannot pass JAX's shutdown barrier (`jax.distributed` waits there for every process, up
    to its shutdown_timeout_seconds, 5 minutes), so it exits at once, with status 1."""
    if channel.broken:
        logger.error("Exiting without JAX's shutdown barrier: the cluster lost a process.")
        logging.shutdown()
        os._exit(1)
