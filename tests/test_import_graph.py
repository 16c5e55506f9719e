"""Imports run one way, between pyfused's packages and between its files.

Every import in pyfused is an edge from the importing file to the module it names: import
statements at the top and inside functions, ``importlib.import_module`` of a literal name, and the
modules the op registry names as strings (each op's ``fused``, which ``pyfused.ops._fused`` and the
op's own module import, and ``peers``, which ``pyfused.bench.peers`` imports). The registry's
``module`` field, by which the drivers reach an op's own module at call time, is not an edge: the
op's module imports the registry, not the reverse.

A package is a folder of pyfused (``ops``, ``comm``, ...) or one of its top-level modules (``_ext``,
``clip_grad``, the extension ``_C``); ``pyfused`` is the package's own ``__init__``. ``ARROWS`` is
the diagram of docs/ARCHITECTURE.md as data: the packages each package imports directly. A package
may import every package its arrows reach; the arrows have no cycle, so neither have the packages.
The tests fail on a cycle between files (however lazy its imports), on an import between packages
the arrows do not reach, on a package the arrows do not place, and on a library import of
``pyfused.benchmarks`` (the suites depend on the library, never the other way). No arrow reaches
``testing``: the test beds stay out of the library's call path.
"""
import ast
import re
import shutil
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

import pyfused
from pyfused.ops.registry import OPS

ROOT = Path(pyfused.__file__).parent
REPO = Path(__file__).resolve().parents[1]
NOT_LIBRARY = ("benchmarks",)  # pyfused.benchmarks: the installed suites, which import the library
EXTENSIONS = ("_C",)           # compiled modules of pyfused (no .py file to read)

ARROWS: Dict[str, Set[str]] = {
    "pyfused": {"parallelize", "tune", "clip_grad"},   # the package's lazy attributes
    "parallelize": {"layers", "fsdp"},
    "layers": {"ops", "dp", "pipeline"},
    "fsdp": {"dp", "pipeline"},
    "dp": {"kernels"},
    "pipeline": {"comm"},
    "tune": {"bench"},
    "bench": {"ops"},
    "testing": {"ops"},
    "ops": {"fused"},
    "fused": {"kernels"},
    "kernels": {"comm"},
    "clip_grad": {"comm"},
    "comm": {"_ext"},
    "_ext": {"_C", "_logging"},
    "_C": set(),
    "_logging": set(),
}


# ---- the graph -------------------------------------------------------------------------------

def modules(root: Path) -> Dict[str, Path]:
    """Every library module under ``root`` (a pyfused folder), by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in NOT_LIBRARY:
            continue
        found[".".join(("pyfused",) + parts).removesuffix(".__init__")] = path
    return found


def _imported(path: Path, module: str, known: Dict[str, Path]) -> Iterator[Tuple[str, int]]:
    """(module named, line) for every import in ``path``: a ``from X import Y`` names X.Y where
    that is a module, else X."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base,
                       node.lineno)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"):
            yield node.args[0].value, node.lineno


def _registry_edges() -> Iterator[Tuple[str, str, str]]:
    for spec in OPS.values():
        if spec.fused:
            for importer in ("pyfused.ops._fused", spec.module):
                yield importer, spec.fused.partition(":")[0], f"registry {spec.name}.fused"
        if spec.peers:
            yield "pyfused.bench.peers", spec.peers.partition(":")[0], f"registry {spec.name}.peers"


def file_edges(root: Path = ROOT) -> Dict[str, Dict[str, str]]:
    """importer -> {imported module: where} over pyfused's modules (and its extensions)."""
    known = modules(root)
    edges: Dict[str, Dict[str, str]] = {name: {} for name in known}
    for name, path in known.items():
        for target, line in _imported(path, name, known):
            if (target == "pyfused" or target.startswith("pyfused.")) and target != name:
                edges[name].setdefault(target, f"{path.relative_to(root.parent)}:{line}")
    for importer, target, why in _registry_edges():
        if importer in edges:
            edges[importer].setdefault(target, why)
    return edges


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "pyfused"


def package_edges(edges: Dict[str, Dict[str, str]]) -> Dict[Tuple[str, str], str]:
    found = {}
    for importer, targets in edges.items():
        for target, where in targets.items():
            src, dst = package_of(importer), package_of(target)
            if src != dst:
                found.setdefault((src, dst), f"{where}: {importer} -> {target}")
    return found


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def reach(arrows: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """Every package each package's arrows reach, directly or through others."""
    def walk(package: str, seen: Set[str]) -> Set[str]:
        for nxt in arrows.get(package, ()):
            if nxt not in seen:
                seen.add(nxt)
                walk(nxt, seen)
        return seen
    return {package: walk(package, set()) for package in arrows}


def problems(root: Path = ROOT) -> List[str]:
    """Every way the imports under ``root`` break the rules of the module docstring."""
    edges = file_edges(root)
    found = []
    for component in cycles({name: set(targets) for name, targets in edges.items()}):
        inside = [f"{edges[a][b]}: {a} -> {b}"
                  for a in component for b in edges[a] if b in component]
        found.append(f"import cycle between files {component}: {inside}")
    allowed = reach(ARROWS)
    for (src, dst), where in sorted(package_edges(edges).items()):
        if dst not in allowed.get(src, ()):
            found.append(f"{src} -> {dst} is not an arrow of ARROWS ({where})")
    for importer, targets in edges.items():
        found += [f"{where}: the library imports {target}" for target, where in targets.items()
                  if target.split(".")[:2] == ["pyfused", "benchmarks"]]
    return found


# ---- the tests -------------------------------------------------------------------------------

def test_no_cycle_and_every_import_follows_the_arrows():
    assert not problems(), "\n".join(problems())


def test_the_arrows_place_every_package_and_have_no_cycle():
    packages = {package_of(name) for name in modules(ROOT)} | set(EXTENSIONS)
    assert packages == set(ARROWS), (packages ^ set(ARROWS))
    assert set().union(*ARROWS.values()) <= set(ARROWS)
    assert not cycles(ARROWS)
    assert not any("testing" in reached for reached in reach(ARROWS).values())


def test_the_architecture_diagram_draws_these_arrows():
    """docs/ARCHITECTURE.md's diagram: one line ``pyfused.<package> -> <arrows>  <what>`` per
    package, the same arrows as ``ARROWS`` (the extension and the logger have no line)."""
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    diagram = doc.split("## Layers", 1)[1].split("```")[1]
    drawn = {}
    for match in re.finditer(r"^ pyfused\.?(\w*) +-> ((?:\w+, )*\w+)", diagram, flags=re.M):
        drawn[match.group(1) or "pyfused"] = set(match.group(2).split(", "))
    assert drawn == {p: a for p, a in ARROWS.items() if a}, drawn


PLANTED = {
    # a lazy import that closes a circle between two files of one package
    "file cycle": ("ops/_signature.py", "def _planted():\n    from . import _common\n",
                   ("import cycle between files", "pyfused.ops._signature -> pyfused.ops._common")),
    # a lazy import against the arrows, closing a circle between two packages
    "package arrow": ("comm/group.py", "def _planted():\n    from ..pipeline import stage\n",
                      ("comm -> pipeline is not an arrow of ARROWS",)),
    "benchmarks": ("bench/cli.py", "def _planted():\n    import pyfused.benchmarks.bench_gemm\n",
                   ("the library imports pyfused.benchmarks.bench_gemm",)),
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_planted_import_is_found(tmp_path, planted):
    """The checks on a copy of the package with one import added."""
    relative, code, expected = PLANTED[planted]
    copy = tmp_path / "pyfused"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", *NOT_LIBRARY))
    assert problems(copy) == []
    with open(copy / relative, "a") as f:
        f.write("\n\n" + code)
    found = problems(copy)
    assert any(all(part in p for part in expected) for p in found), found
