"""Adding an op (docs/ARCHITECTURE.md): what one op's files are, and that nothing else must change.

A toy op is defined in this file -- ``toy_scaled_matmul_all_reduce(a, b) = all_reduce(a @ b) / 2``,
a scaled copy of matmul_all_reduce with its own registered op, dispatcher and registry hooks -- and
registered for the length of each test (``registry.registered``, in every rank's process). The
registry-driven tests (one rank wrong, opcheck, the plan cache, the fp64 reference check), the
tuner and the bench's op suites then run it as they run the built-in ops, with no other file edited.

The doc's list of the files an op touches is checked against the registry: every op has them,
each defines the hooks the registry names, and the drivers that serve every op name none.
"""
import ast
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from pyfused import _ext, comm
from pyfused.ops import _common, _hooks
from pyfused.ops._dispatch import dispatched
from pyfused.ops.matmul_all_reduce import chunked_matmul_all_reduce
from pyfused.ops.registry import FUSED_HOOKS, HOOKS, OPS, OpSpec, registered
from tests import test_one_rank_wrong, test_ops_properties, test_plan_cache
from tests.op_checks import check_against_reference

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 120

# ---------------------------------------------------------------------------------------------
# The toy op, written as pyfused/ops/<op>.py would be

OP = "toy_scaled_matmul_all_reduce"
SCALE = 0.5  # exact in every float dtype
TOY = OpSpec(OP, ("a", "b"), "all_reduce", False, True, True,
             "a [d0, ..., K], b [K, N] -> [d0, ..., N]", None, (), module=__name__)


def toy_scaled_matmul_all_reduce_ref(a_per_rank, b_per_rank) -> Tensor:
    dt = torch.promote_types(b_per_rank[0].dtype, torch.float32)
    return SCALE * sum(torch.matmul(a.to(dt), b.to(dt)) for a, b in zip(a_per_rank, b_per_rank))


@comm.names_failures(OP)
def _run(a: Tensor, b: Tensor, pg, method: str, chunks: int) -> Tensor:
    if method == "decomposed" and comm.world_size(pg) > 1:
        out = chunked_matmul_all_reduce(a, b, pg, max(1, min(chunks or 2, a.shape[0])))
    else:
        out = a @ b
        if comm.world_size(pg) > 1:
            dist.all_reduce(out, group=pg)
    return out.mul_(SCALE)


@torch.library.custom_op(f"pyfused::{OP}", mutates_args=(), **_common.OP_TAGS)
def _toy_op(a: Tensor, b: Tensor, group_name: str, method: str, chunks: int) -> Tensor:
    if _common.take_validated():
        return _run(a, b, comm.group_from_name(group_name), method, chunks)
    pg, choice = _common.prepare_matmul(OP, a, b, comm.group_from_name(group_name), method, chunks)
    return _run(a, b, pg, choice.method, chunks or choice.chunks)


@_toy_op.register_fake
def _(a, b, group_name, method, chunks):
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])


def _backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    grad_a = SCALE * (grad_out @ b.t()) if ctx.needs_input_grad[0] else None
    grad_b = SCALE * (a.t() @ grad_out) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None, None


_toy_op.register_autograd(_backward, setup_context=_setup_context)


def _plan(group, method, chunks, a, b):
    return _common.plan_matmul(OP, a, b, group, method, chunks)


def _local(group, method, chunks, a, b):
    return (a @ b).mul_(SCALE)


def _direct(plan, group, method, chunks, a, b):
    out = _run(a.reshape(-1, a.shape[-1]), b, plan.pg, plan.method, plan.chunks)
    return out.view(*a.shape[:-1], b.shape[1])


def _registered(plan, group, method, chunks, a, b):
    out = _common.call_op(plan, torch.ops.pyfused.toy_scaled_matmul_all_reduce,
                          a.reshape(-1, a.shape[-1]), b, plan.group_name, plan.method, plan.chunks)
    return out.view(*a.shape[:-1], b.shape[1])


@dispatched(TOY.code, _plan, _local, _direct, _registered)
def toy_scaled_matmul_all_reduce(a, b, group=None, *, method="auto", chunks=0):
    """``all_reduce(SCALE * a @ b)`` over ``group``."""


def make_inputs(world, rows, n, k, dtype=torch.float32, device="cpu", seed=0):
    return _hooks.gemm_inputs(world, rows, n, k, dtype, device, seed, gathered=False)


def reference_per_rank(inputs):
    total = toy_scaled_matmul_all_reduce_ref([a for a, _ in inputs], [b for _, b in inputs])
    return [total] * len(inputs)


def opcheck_args(tensors, group_name):
    return (*tensors, group_name, "decomposed", 2)


def plain_torch(tensors, pg):
    a, b = tensors

    def matmul_all_reduce_scaled():
        y = a @ b
        if comm.world_size(pg) > 1:
            dist.all_reduce(y, group=pg)
        return y.mul_(SCALE)
    return matmul_all_reduce_scaled


# ---------------------------------------------------------------------------------------------
# The registry-driven tests, run with the toy registered in every process


def _with_toy(rank, world, body, *args, **kwargs):
    """``body(rank, world, *args, **kwargs)`` with the toy op registered in this rank's process."""
    with registered(TOY):
        return body(rank, world, *args, **kwargs)


class _RanksWithToy:
    """The ``ranks`` fixture, with the toy op registered in every rank while a body runs."""

    def __init__(self, ranks):
        self._ranks = ranks

    def run(self, world, fn, *args, **kwargs):
        return self._ranks.run(world, _with_toy, fn, *args, **kwargs)


@pytest.fixture
def toy_ranks(ranks):
    with registered(TOY):
        yield _RanksWithToy(ranks)
    assert OP not in OPS


def test_registration_is_reversible():
    names = list(OPS)
    with registered(TOY):
        assert list(OPS) == names + [OP] and OPS[OP].function is toy_scaled_matmul_all_reduce
        with pytest.raises(ValueError, match="already registered"):
            with registered(TOY):
                pass
    assert list(OPS) == names


@pytest.mark.parametrize("case", test_one_rank_wrong.OP_CASES + ["chunks"])
def test_one_rank_wrong_runs_the_toy(toy_ranks, case):
    test_one_rank_wrong.test_op_argument_wrong_on_one_rank(toy_ranks, OP, case)


@pytest.mark.parametrize("world", [1, 2])
def test_opcheck_runs_the_toy(toy_ranks, world):
    test_ops_properties.test_opcheck(toy_ranks, OP, world)


def test_reference_check_runs_the_toy(toy_ranks):
    """op_checks uses the toy's own reference (half of matmul_all_reduce's: a wrong one fails)."""
    for method in ("unfused", "decomposed"):
        assert all(toy_ranks.run(3, check_against_reference, OP, method, torch.float32,
                                 (5, 3, 7), 4, 1, timeout=TIMEOUT))


def _toy_plans(rank, world):
    """How many of the toy's calls found their plan in the plan cache."""
    from pyfused.comm import forget_seen, plans

    forget_seen()  # the plans of earlier calls go with validation's record
    a, b = make_inputs(world, 2, 3, 4)[rank]
    hits = []
    with plans.observe_hits(lambda plan: hits.append(plan.op)):
        for _ in range(3):
            toy_scaled_matmul_all_reduce(a, b, method="decomposed")
    return hits


@pytest.mark.parametrize("world", [1, 3])
def test_plan_cache_runs_the_toy(toy_ranks, world):
    for implementation in test_plan_cache.IMPLEMENTATIONS:
        if implementation == "cpp" and _ext.load() is None:
            continue  # pyfused._C not built: the Python implementation only
        test_plan_cache.test_repeated_calls_run_like_the_validated_first_call(
            toy_ranks, world, implementation)
    assert toy_ranks.run(world, _toy_plans) == [[OP, OP]] * world


def test_tuner_runs_the_toy():
    from pyfused.tune import cli, tuner

    with registered(TOY):
        assert OP in tuner.OPS and OP in tuner.CHUNKED
        assert OP in cli.parse_args([]).ops.split(",")
        result = tuner.tune(OP, (6, 8), (8, 5), chunks=[2], warmup=0, iters=1, write=False)
    assert result.key.split("|")[2] == OP
    assert set(result.times_ms) == {"unfused", "decomposed/c2"} and "fused" in result.skipped


def _bench_suites(rank, world):
    from pyfused.bench.gemm_collective import run_op_suite
    from pyfused.bench.harness import BenchContext
    from pyfused.bench.shapes import parse
    from pyfused.benchmarks import bench_overhead

    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=1, iters=2)
    rows = run_op_suite(ctx, OP, parse("24x16x12", OP, world, "cpu", True))
    rows += bench_overhead._op_rows(OP, (8, 16, 12), ctx, dist.group.WORLD)
    return [(row["op"], row["method"], row.get("status")) for row in rows]


def test_bench_suites_run_the_toy(toy_ranks):
    """The GEMM op suite's body and the overhead suite's rows, on 2 ranks."""
    rows = toy_ranks.run(2, _bench_suites, timeout=TIMEOUT)[0]
    assert {op for op, _, _ in rows} == {OP}
    methods = {method: status for _, method, status in rows}
    assert methods["fused"].startswith("unavailable") or methods["fused"] == "unavailable"
    for method in ("gemm alone", "all_reduce alone", "unfused", "decomposed", "auto", "torch",
                   "unfused, validate=always"):
        assert methods[method] == "ok", (method, methods)


# ---------------------------------------------------------------------------------------------
# The doc's "Adding an op" is true


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start)
    return text[start:end if end >= 0 else len(text)]


NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}


def _doc_files():
    """(the files every op has, the files a fused method adds): the numbered items of the doc's
    "Adding an op", each starting with the file's path, and the counts its sentences say."""
    section = _section((REPO / "docs" / "ARCHITECTURE.md").read_text(), "### Adding an op")
    items = re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M)
    every = NUMBERS[re.search(r"^(\w+) files", section, flags=re.M).group(1).lower()]
    fused = NUMBERS[re.search(r"adds (\w+) files", section).group(1).lower()]
    assert len(items) == every + fused, (items, every, fused)
    return items[:every], items[every:], section


def _module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def test_every_op_has_the_files_the_doc_lists():
    every, fused, _ = _doc_files()
    for name, spec in OPS.items():
        assert _module_file(spec.module) == f"pyfused/ops/{name}.py"
        for template in every:
            assert (REPO / template.replace("<op>", name)).is_file(), (name, template)
        if spec.fused:
            fused_file = _module_file(spec.fused.partition(":")[0])
            assert re.fullmatch(fused[0].replace("<file>", r"\w+"), fused_file), fused_file
            assert (REPO / fused_file).is_file()
            for kernel in spec.kernels:
                assert (REPO / kernel).is_file(), kernel
                assert any(re.fullmatch(pattern, kernel) for pattern in
                           (fused[1].replace("<family>", r"\w+"), r"csrc/\w+\.(cu|cpp)")), kernel


def test_the_doc_names_every_hook_and_every_op_module_defines_them():
    _, _, section = _doc_files()
    for hook in HOOKS + FUSED_HOOKS:
        assert f"`{hook}`" in section, hook
    exports = __import__("pyfused.ops", fromlist=["__all__"]).__all__
    for name, spec in OPS.items():
        for hook in (name, f"{name}_ref", *HOOKS, *(FUSED_HOOKS if spec.fused else ())):
            assert callable(spec.hook(hook)), (name, hook)
        assert name in exports and f"{name}_ref" in exports


# The drivers that serve every op: per-op knowledge reaches them through the registry only.
DRIVERS = ["pyfused/bench", "pyfused/tune", "pyfused/fused", "pyfused/comm",
           "pyfused/testing/virtual_cases.py", "pyfused/testing/virtual_ranks.py",
           "pyfused/ops/_common.py", "pyfused/ops/_dispatch.py", "pyfused/ops/_fused.py",
           "pyfused/ops/_hooks.py", "pyfused/ops/_signature.py", "pyfused/ops/tuned.py",
           "benchmarks/bench_overhead.py", "benchmarks/bench_virtual_ranks.py",
           "benchmarks/sanitize_fused.py", "tests/op_checks.py", "tests/test_one_rank_wrong.py",
           "tests/test_ops_properties.py", "tests/test_compile.py", "setup.py"]


def _op_names_in(path: Path):
    """The op names among ``path``'s string constants (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings):
            for name in OPS:
                if re.search(rf"(^|[^\w]){name}($|[^\w])", node.value):
                    yield node.lineno, name


def _own_files():
    """Every op's own files: its module, its fused implementation, its kernels."""
    own = set()
    for spec in OPS.values():
        own.add(_module_file(spec.module))
        if spec.fused:
            own |= {_module_file(spec.fused.partition(":")[0]), *spec.kernels}
    return own


def test_drivers_name_no_op():
    own, files = _own_files(), []
    for driver in DRIVERS:
        path = REPO / driver
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    files = [f for f in files if str(f.relative_to(REPO)) not in own]
    named = [(str(f.relative_to(REPO)), line, name)
             for f in files for line, name in _op_names_in(f)]
    assert not named, f"ops named outside their own files: {named}"
