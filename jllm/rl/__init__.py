"""Reinforcement-learning rollouts: how a trainer's weights reach the engine
(`jllm/rl/transfer.py`); the engine's side is runner/weight_sync.py and the core's
utility calls (engine/core.py)."""
