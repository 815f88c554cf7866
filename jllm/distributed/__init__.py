"""Several processes serving one model: JAX's multi-controller runtime plus a step channel.

Every process runs the same JAX program over one global mesh (`jax.distributed`); only
process 0 runs the scheduler and the API. Before each device step process 0 sends the
step's host inputs to the others over `StepChannel`, and every process then runs the same
compiled step with the same inputs, as multi-controller JAX requires.
"""

from jllm.distributed.channel import ProcessLostError, StepChannel, exit_if_broken
from jllm.distributed.init import initialize_distributed, leader_address, open_step_channel

__all__ = [
    "ProcessLostError",
    "StepChannel",
    "exit_if_broken",
    "initialize_distributed",
    "leader_address",
    "open_step_channel",
]
