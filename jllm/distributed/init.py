"""`jax.distributed.initialize` from vLLM's multi-node arguments.

nnodes -> num_processes, node_rank -> process_id, master_addr:master_port -> the JAX
coordinator (process 0 hosts it). Without `master_addr`, JAX finds the cluster itself: on
Cloud TPU from the TPU metadata and environment (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES, ...),
under Slurm or Open MPI from theirs, or from JAX_COORDINATOR_ADDRESS. On CPU the
cross-process collectives use gloo. `open_step_channel` then connects the processes'
step channel.
"""

from __future__ import annotations

import logging
import secrets
import socket

import jax
import numpy as np

from jllm.distributed.channel import TOKEN_BYTES, StepChannel

logger = logging.getLogger("jllm")

_ADDRESS_BYTES = 256


def initialize_distributed(
    nnodes: int, node_rank: int, master_addr: str | None, master_port: int
) -> int:
    """Join the JAX cluster (a no-op for one process). Returns this process's index."""
    if nnodes <= 1:
        return 0
    if not jax.distributed.is_initialized():
        # CPU collectives across processes need an implementation; harmless elsewhere.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if master_addr is None:
            logger.info(
                "Joining a %d-process cluster that JAX detects from the environment.", nnodes
            )
            jax.distributed.initialize()
        else:
            address = f"{master_addr}:{master_port}"
            logger.info(
                "Joining %d processes as process %d (JAX coordinator %s).",
                nnodes,
                node_rank,
                address,
            )
            jax.distributed.initialize(
                coordinator_address=address, num_processes=nnodes, process_id=node_rank
            )
    if jax.process_count() != nnodes:
        raise ValueError(
            f"nnodes={nnodes}, but the JAX cluster has {jax.process_count()} processes."
        )
    logger.info(
        "Process %d of %d: %d local devices, %d in all.",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return jax.process_index()


def leader_address(master_addr: str | None) -> str:
    """Where process 0 can be reached: `master_addr`, or else the address process 0 finds for
    its own host name, sent to every process (once, at start-up)."""
    if master_addr is not None:
        return master_addr
    from jax.experimental import multihost_utils

    mine = socket.gethostbyname(socket.gethostname()).encode()
    buf = np.zeros(_ADDRESS_BYTES, np.uint8)
    buf[: len(mine)] = np.frombuffer(mine, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return bytes(buf[buf != 0]).decode()


def open_step_channel(args, rank: int):
    """The step channel of a multi-process engine (None with one process): process 0 serves
    it on master_port + 1, the others connect."""
    if args.nnodes == 1:
        return None
    port = args.master_port + 1
    host = leader_address(args.master_addr)  # a collective: every process takes part
    token = channel_token()  # likewise
    if rank == 0:
        return StepChannel.serve("0.0.0.0", port, args.nnodes - 1, token)
    return StepChannel.connect(host, port, rank, token)


def channel_token() -> bytes:
    """The step channel's shared secret: 32 random bytes process 0 draws, sent to every
    process of the JAX cluster by JAX's own broadcast (no other party learns it)."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(secrets.token_bytes(TOKEN_BYTES), np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(mine)).astype(np.uint8))
