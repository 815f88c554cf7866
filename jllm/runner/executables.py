"""Every compiled executable of the runner and its managers, in one table, with the compile
guard built in.

An entry's key is (kind, detail): what it is and the shape it was compiled for
(`("forward", (64,))`, `("penalty write", 256)`, `("host kv gather", (shape, dtype, 4))`).
`get(kind, detail, lower)` returns the executable, compiling `lower()` the first time under
the runner's mesh; once `guard` is set (after the start-up pass, `ModelRunner.compile_all`),
a missing key raises `CompileAfterWarmupError` instead of compiling: no compile happens in
steady state.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jllm.runner.compile_guard import CompileAfterWarmupError


class ExecutableTable:
    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.guard = False
        # XLA options for what compiles from now on (an eager GPU engine's: no autotuning)
        self.compiler_options: dict | None = None
        self._table: dict[tuple, object] = {}

    def get(self, kind: str, detail, lower: Callable[[], object]):
        """The executable of (`kind`, `detail`); `lower()` (a `jax.jit(...).lower(...)`)
        compiles it the first time, unless the guard is set."""
        key = (kind, detail)
        exe = self._table.get(key)
        if exe is None:
            if self.guard:
                raise CompileAfterWarmupError(f"{kind} {detail} was not compiled at start-up")
            with jax.set_mesh(self.mesh):
                exe = lower().compile(compiler_options=self.compiler_options)
            # Start-up compiles on several threads; a key compiled twice keeps the first.
            exe = self._table.setdefault(key, exe)
        return exe

    def details(self, kind: str) -> list:
        """The details (shapes) compiled for `kind`."""
        return [detail for k, detail in self._table if k == kind]

    def __contains__(self, key: tuple) -> bool:
        return key in self._table

    def __len__(self) -> int:
        return len(self._table)
