"""The package's layer contract, read from the source's imports (every import, a function's
included): an import only points to its own layer or one below, and no two modules import each
other, directly or through others.

From the ground up: ``core`` (the shared vocabulary: the grid, findings, naming rules, the
smoothing factors, errors, io, memory, this CPU; with the data, the models and the hub it reads)
< ``formats`` (one on-disk layout each, with its kernels and vLLM methods) < ``quantize`` (the
algorithms and the run) < ``export``, ``eval``, ``verify``, ``report``, ``convert``, ``probe``,
``model_card`` < the command line.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cpu_quant"

# (module prefix, layer); the longest matching prefix wins
LAYERS: dict[str, int] = {
    "cpu_quant.core": 0, "cpu_quant.data": 0, "cpu_quant.models": 0, "cpu_quant.hub": 0,
    "cpu_quant.formats": 1, "cpu_quant.runtime_patches": 1,
    "cpu_quant.quantize": 2,
    "cpu_quant.export": 3, "cpu_quant.eval": 3, "cpu_quant.verify": 3, "cpu_quant.report": 3,
    "cpu_quant.convert": 3, "cpu_quant.probe": 3, "cpu_quant.model_card": 3,
    "cpu_quant": 4,  # the package's facade (load_quantized)
    "cpu_quant.__main__": 4, "cpu_quant.cli": 4, "cpu_quant.vllm_alias": 4,
}
NAMES = {0: "core", 1: "formats", 2: "quantize", 3: "export/eval/verify/report", 4: "cli"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int | None:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len,
               default=None)
    return None if best is None else LAYERS[best]


def imports(modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every import of a package module, at any depth."""
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                # "from pkg import module" imports the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for t in targets:
                while t not in modules and "." in t:
                    t = t.rpartition(".")[0]
                if t in modules and t != name:
                    found.append((name, t, node.lineno))
    return found


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _modules() if layer_of(m) is None)
    assert not unplaced, f"modules outside the layer table: {unplaced}"


def test_no_import_points_up():
    modules = _modules()
    up = [f"{a}:{line} ({NAMES[layer_of(a)]}) imports {b} ({NAMES[layer_of(b)]})"
          for a, b, line in imports(modules)
          if layer_of(b) > layer_of(a)]
    assert not up, "imports that point up:\n" + "\n".join(sorted(up))


def test_no_import_cycle():
    """No module reaches itself through imports (a function-local import included, so that a
    deferred import cannot hide a cycle)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for a, b, _ in imports(modules):
        if not modules[b].name == "__init__.py" or not a.startswith(b + "."):
            graph[a].add(b)  # a submodule importing its own package's __init__ is no cycle
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
