"""jllm's log format (vLLM's: level, time, file:line, message) on the `jllm` logger."""

from __future__ import annotations

import logging


def setup_logging(level: int = logging.INFO) -> None:
    root = logging.getLogger("jllm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s")
        )
        root.addHandler(handler)
        root.setLevel(level)
        root.propagate = False
