"""jllm's imports go downward (STYLE.md, "Imports go downward"): every import statement in
jllm/, at module level or inside a function, relative ones resolved, follows one layer order.

A unit is a package under jllm/ or a top-level module (`jllm/utils.py` is `utils`), except that
a module `LAYERS` names inside a package is a unit of its own (`entrypoints.cli`: the `jllm`
command sits above the benchmarks it dispatches to, which drive `LLM` from entrypoints); the
root `jllm/__init__.py` is the unit `jllm`, the facade that re-exports `LLM`. A unit may import
its own modules and any unit in a lower layer, never one in its own layer or above; no
package imports another's private (`_`) names; the unit graph has no cycle. The top-level
`sharding` and `pallas_kernels` packages sit below all of jllm and import nothing from it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Bottom first.
LAYERS = [
    # Config and the helpers and records every layer reads: they import nothing from jllm.
    {"config", "utils", "logger", "version", "outputs", "cpu_heap"},
    {"sampling_params", "pooling_params"},
    # Records the engine and the runner share (the KV-cache specs: models read them too),
    # and host-side request logic the engine and the front end share (reasoning, pooling).
    {
        "scheduler_output",
        "mrope",
        "logits_process",
        "beam_search",
        "kv_cache_interface",
        "reasoning",
        "pooling",
    },
    # What a model is built from and what the engine feeds it, none knowing a model: the
    # attention backends, weight formats, the multi-host channel, metrics, grammars, and
    # LoRA's delta, slot arrays and adapters (the model installs its slots: models/lora.py),
    # and how a trainer's weights arrive (rl: the weight transfer backends).
    {"attention", "quantization", "distributed", "metrics", "structured_output", "lora", "rl"},
    {"models"},
    {"model_loader"},  # above models, as in vLLM: it builds a model and fills its weights
    {"runner", "tracing"},
    {"spec_decode"},  # the draft model runs on the runner's batch layout and inputs
    {"engine"},
    {"entrypoints"},
    {"jllm"},  # the facade: `from jllm import LLM`
    {"bench"},  # `jllm bench` drives the facade's LLM
    {"entrypoints.cli"},  # the `jllm` command: serve, convert, bench
]

# Upward imports that other work removes; (importing module, imported unit). An entry that
# no longer matches any import fails the test, so it is deleted with the edge.
EXEMPT: set[tuple[str, str]] = set()


def _modules(package: str) -> dict[str, tuple[pathlib.Path, bool]]:
    """Every module under a top-level package: {dotted name: (path, is a package)}."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules("jllm")


def _imports(name: str, path: pathlib.Path, is_package: bool, known) -> list[tuple]:
    """(imported module, imported name or None, line) for each import in one module; `from
    P import n` imports the module P.n where there is one, else the name n of P."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    out.append((f"{base}.{alias.name}", None, node.lineno))
                else:
                    out.append((base, alias.name, node.lineno))
    return out


def _jllm_imports() -> list[tuple]:
    """(importing module, imported module, imported name or None, line), jllm to jllm."""
    return [
        (name, target, imported, line)
        for name, (path, is_package) in MODULES.items()
        for target, imported, line in _imports(name, path, is_package, MODULES)
        if target == "jllm" or target.startswith("jllm.")
    ]


UNITS = set().union(*LAYERS)
LAYER = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit(module: str) -> str:
    """The unit of a jllm module: the longest unit in `LAYERS` its name starts with."""
    if module == "jllm":
        return "jllm"
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in UNITS:
            return ".".join(parts[:n])
    return parts[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_every_unit_has_a_layer():
    missing = sorted({unit(m) for m in MODULES} - UNITS)
    assert not missing, f"place {missing} in LAYERS (tests/test_imports.py)"
    assert sum(map(len, LAYERS)) == len(UNITS), "a unit is named in two layers"


def test_config_is_at_the_bottom():
    """Every package may import the config, so it imports nothing but itself."""
    assert "config" in LAYERS[0]


def test_imports_go_downward():
    upward = []
    for source, target, _, line in _jllm_imports():
        a, b = unit(source), unit(target)
        if a != b and LAYER[b] >= LAYER[a] and (source, b) not in EXEMPT:
            upward.append(f"{source}:{line} imports {target} ({b} is not below {a})")
    assert not upward, "\n".join(upward)


def test_exemptions_are_still_needed():
    used = {(source, unit(target)) for source, target, _, _ in _jllm_imports()}
    stale = EXEMPT - used
    assert not stale, f"no import needs these any more; delete them from EXEMPT: {stale}"


def test_no_package_imports_another_packages_private_names():
    def package(module):
        return module.split(".")[1] if "." in module else module

    private = [
        f"{source}:{line} imports {target}{'.' + imported if imported else ''}"
        for source, target, imported, line in _jllm_imports()
        if package(source) != package(target)
        and any(_private(p) for p in [*target.split("."), imported or ""])
    ]
    assert not private, "\n".join(private)


def test_the_unit_graph_has_no_cycle():
    """Read from the code alone, whatever LAYERS says (exempt edges left out)."""
    graph: dict[str, set[str]] = {}
    for source, target, _, _ in _jllm_imports():
        a, b = unit(source), unit(target)
        if a != b and (source, b) not in EXEMPT:
            graph.setdefault(a, set()).add(b)
    done: set[str] = set()

    def visit(node, path):
        if node in path:
            cycle = path[path.index(node) :] + [node]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


@pytest.mark.parametrize("package", ["sharding", "pallas_kernels"])
def test_lower_packages_import_nothing_from_jllm(package):
    found = [
        f"{name}:{line} imports {target}"
        for name, (path, is_package) in _modules(package).items()
        for target, _, line in _imports(name, path, is_package, MODULES)
        if target == "jllm" or target.startswith("jllm.")
    ]
    assert not found, "\n".join(found)
