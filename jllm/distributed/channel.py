"""The step channel: process 0 sends each step's inputs to the other processes over TCP.

Messages are length-prefixed pickles of numpy pytrees (a few KB per step), on a plain
socket rather than a JAX collective so that nothing is compiled for them. Process 0 watches
every connection from a thread, so a process that exits or crashes is reported by name at
the next step instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
import time

logger = logging.getLogger("jllm")

_HEADER = struct.Struct("!Q")


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


class StepChannel:
    def __init__(self) -> None:
        self.peers: dict[int, socket.socket] = {}
        self.leader: socket.socket | None = None
        self.lost: list[int] = []
        self.closing = False
        self._gone = threading.Condition()

    # ---- process 0 -----------------------------------------------------------------------
    @classmethod
    def serve(cls, host: str, port: int, num_followers: int, timeout: float = 600) -> StepChannel:
        """Wait for every other process to connect (they send their rank)."""
        channel = cls()
        server = socket.create_server((host, port), reuse_port=False)
        server.settimeout(timeout)
        try:
            while len(channel.peers) < num_followers:
                conn, _ = server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                (rank,) = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
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
        frame = _pack(message)
        for rank, conn in self.peers.items():
            try:
                conn.sendall(frame)
            except OSError as e:
                self.lost.append(rank)
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
                conn.sendall(_pack(("stop",)))
            except OSError:
                pass
        with self._gone:
            self._gone.wait_for(lambda: set(self.peers) <= set(self.lost), timeout)
        for conn in self.peers.values():
            conn.close()
        self.peers.clear()

    # ---- the other processes -------------------------------------------------------------
    @classmethod
    def connect(cls, host: str, port: int, rank: int, timeout: float = 600) -> StepChannel:
        channel = cls()
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
        sock.sendall(_HEADER.pack(rank))
        channel.leader = sock
        return channel

    def hang_up(self) -> None:
        """A follower that got "stop" closes its end, which process 0 is waiting for."""
        if self.leader is not None:
            self.leader.close()
            self.leader = None

    def recv(self):
        try:
            (n,) = _HEADER.unpack(_recv_exact(self.leader, _HEADER.size))
            return pickle.loads(_recv_exact(self.leader, n))
        except (EOFError, OSError) as e:
            raise ProcessLostError("Process 0 of the cluster exited.") from e


def _pack(message) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data
