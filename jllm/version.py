"""jllm's version, in the bottom layer so that any module can read it without importing the
`jllm` facade, which sits on top of every package (it re-exports `LLM` from entrypoints)."""

__version__ = "0.1.0"
