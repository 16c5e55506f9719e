"""Imports run one way: layers -> ops -> fused -> kernels -> comm, and tune -> bench -> ops.

Every import statement in pyfused's layers, ops, fused, kernels, tune and bench packages, lazy ones
inside functions included, is an edge between those packages; so is each op registry entry's
``fused`` (the ops import their fused implementations by that name).
The test fails on any cycle and on any edge the layering does not allow, and on any library import
of ``pyfused.benchmarks`` (the suites depend on the library, never the other way).
"""
import ast
from pathlib import Path

import pyfused
from pyfused.ops.registry import OPS

ROOT = Path(pyfused.__file__).parent
PACKAGES = ("layers", "ops", "fused", "kernels", "tune", "bench")
ALLOWED = {("layers", "ops"), ("ops", "fused"), ("ops", "kernels"), ("fused", "kernels"),
           ("ops", "tune"), ("tune", "bench"), ("tune", "ops"), ("bench", "ops")}


def _node(module: str):
    parts = module.split(".")
    if len(parts) > 1 and parts[0] == "pyfused" and parts[1] in PACKAGES:
        return parts[1]
    return None


def _imports(path: Path, module: str):
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target
            yield from (f"{target}.{alias.name}" for alias in node.names)


def _edges():
    edges = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = "pyfused." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            src = _node(module)
            for target in _imports(path, module):
                assert not target.startswith("pyfused.benchmarks"), f"{module} imports {target}"
                dst = _node(target)
                if src and dst and src != dst:
                    edges.setdefault((src, dst), f"{module} -> {target}")
    for spec in OPS.values():
        if spec.fused:
            edges.setdefault(("ops", _node(spec.fused.partition(":")[0])),
                             f"registry: {spec.name} -> {spec.fused}")
    return edges


def test_imports_follow_the_layers():
    edges = _edges()
    wrong = {e: why for e, why in edges.items() if e not in ALLOWED}
    assert not wrong, f"imports against the layering: {wrong}"


def test_no_cycle_between_ops_fused_tune_bench():
    edges = _edges()
    graph = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)

    def reaches(start, goal, seen=()):
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, (*seen, nxt)))
                   for nxt in graph.get(start, ()))

    cycles = [n for n in graph if reaches(n, n)]
    assert not cycles, f"import cycle through {cycles}: {edges}"
