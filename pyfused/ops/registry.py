"""The one description of every fused op: everything else that lists the ops derives from ``OPS``.

The functional ops (``pyfused.ops``), the fused-implementation table (``pyfused.ops._fused``), the
tuner (``pyfused.tune``), the tuning and benchmark shapes (``pyfused.bench.shapes``), the bench
suites (``pyfused.bench.gemm_collective``, the ``overhead`` suite), the virtual-rank cases
(``pyfused.testing.virtual_cases``) and the tests' op lists read this table and the hooks below.
Adding an op is one entry here plus its own files (docs/ARCHITECTURE.md, "Adding an op").

Each op's module (``OpSpec.module``, by default ``pyfused/ops/<op>.py``) defines, beside the
functional ``<op>`` and its fp32 reference ``<op>_ref``, the hooks ``HOOKS`` names, which tests,
benchmarks and virtual ranks reach through the op's ``OpSpec``:

  make_inputs(world, rows, n, k, dtype, device, seed)
      every rank's tensor inputs (one tuple per rank, in ``inputs`` order), the same on every rank
      for one seed. ``rows`` (an int, or the leading dims) sets the rows: a GEMM op's product has
      W * rows of them (a shard the op gathers has ``rows``), an op without a GEMM takes
      [rows, ..., n]; ``n`` is the output's width, ``k`` a GEMM's inner dim;
  reference_per_rank(inputs)
      every rank's expected result from every rank's inputs, by ``<op>_ref``;
  opcheck_args(tensors, group_name)
      the registered op's (``torch.ops.pyfused.<op>``) arguments for one rank's 2-D inputs;
  plain_torch(tensors, pg)
      a function of no arguments doing the same work in plain torch.distributed, as a user would
      write it without pyfused (the ``overhead`` suite's baseline);
  virtual_cases()
      ops with a fused implementation only: its cases for virtual ranks, name -> parts of a
      ``pyfused.testing.virtual_cases.Case``.

Importing this module imports no op, kernel or fused implementation: the ``module``, ``fused`` and
``peers`` fields name them, and the properties below import on demand.
"""
from __future__ import annotations

import contextlib
import importlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Tuple

HOOKS = ("make_inputs", "reference_per_rank", "opcheck_args", "plain_torch")
FUSED_HOOKS = ("virtual_cases",)  # the hooks of ops with a fused implementation


def _import(target: str) -> Callable:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class OpSpec:
    name: str
    inputs: Tuple[str, ...]   # the tensor arguments, in call order
    collective: str           # "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all"
                              # | "p2p" (sends and receives between neighbours)
    scatters_dim0: bool       # the result is this rank's rows of dim 0 (dim 0 divisible by W)
    chunked: bool             # the decomposed method takes ``chunks=`` (row pieces)
    gemm: bool                # a @ b with a [d0, ..., K], b [K, N]; else x [..., H] + weight [H]
    shape_rule: str           # the output shape, for the docs
    fused: Optional[str]      # "module:function" of the fused implementation, None if there is none
    kernels: Tuple[str, ...]  # files of the kernels the fused implementation launches
    peers: Optional[str] = None  # "module:function" building the bench's torch symmetric-memory
                                 # baselines (pyfused/bench/peers.py); None: the bench has none
    module: str = ""          # the module of the op and its hooks; "" means pyfused.ops.<name>
    tuned: bool = True        # ``python -m pyfused.tune`` measures it (its inputs: a and b, or x
                              # and a weight [H]); False: ``auto`` is the op's own size rule
    methods: Tuple[str, ...] = ("unfused", "decomposed", "fused")  # ``method=`` values besides
                              # "auto"; the first is the plain one the drivers call by default

    def __post_init__(self):
        if not self.module:
            object.__setattr__(self, "module", f"pyfused.ops.{self.name}")

    @property
    def code(self) -> int:
        """The op's number in the plan cache's keys (pyfused/comm/plans.py)."""
        return zlib.crc32(self.name.encode()) & 0x3FFFFFFF

    @property
    def gathers_dim0(self) -> bool:
        """The result's dim 0 is W times the first input's (which is this rank's shard of it)."""
        return self.collective == "all_gather"

    @property
    def replicated(self) -> bool:
        """Every rank's result is the same tensor (a loss counts it once)."""
        return self.collective == "all_reduce"

    def hook(self, name: str) -> Callable:
        """The op module's function ``name`` (``HOOKS``, ``FUSED_HOOKS``, the op, its reference)."""
        return getattr(importlib.import_module(self.module), name)

    @property
    def function(self) -> Callable:
        return self.hook(self.name)

    @property
    def reference(self) -> Callable:
        """The fp32 (fp64 for fp64 inputs) reference the tests and benchmarks compare with."""
        return self.hook(f"{self.name}_ref")

    @property
    def make_inputs(self) -> Callable:
        return self.hook("make_inputs")

    @property
    def reference_per_rank(self) -> Callable:
        return self.hook("reference_per_rank")

    @property
    def opcheck_args(self) -> Callable:
        return self.hook("opcheck_args")

    @property
    def plain_torch(self) -> Callable:
        return self.hook("plain_torch")

    @property
    def virtual_cases(self) -> Callable:
        return self.hook("virtual_cases")

    @property
    def registered_op(self):
        """The registered op's overload ``torch.ops.pyfused.<op>.default``."""
        import torch

        return getattr(torch.ops.pyfused, self.name).default

    def fused_function(self) -> Callable:
        return _import(self.fused)

    def peers_function(self) -> Optional[Callable]:
        return _import(self.peers) if self.peers else None

    @property
    def everywhere_methods(self) -> Tuple[str, ...]:
        """The methods that run on every device (all but ``fused``)."""
        return tuple(m for m in self.methods if m != "fused")

    @property
    def tune_shape_inputs(self) -> Tuple[int, int]:
        """Which two inputs' shapes key a tuned entry (a and b; x and weight)."""
        return (0, 1) if self.gemm else (0, 2)


OPS: Dict[str, OpSpec] = {s.name: s for s in (
    OpSpec("all_gather_matmul", ("a", "b"), "all_gather", False, False, True,
           "a [m, ..., K], b [K, N] -> [W*m, ..., N]",
           "pyfused.fused.gemm_collectives:fused_all_gather_matmul",
           ("pyfused/kernels/gemm.py",), peers="pyfused.bench.peers:all_gather_matmul_peers"),
    OpSpec("matmul_reduce_scatter", ("a", "b"), "reduce_scatter", True, False, True,
           "a [M, ..., K], b [K, N] -> [M/W, ..., N]",
           "pyfused.fused.gemm_collectives:fused_matmul_reduce_scatter",
           ("pyfused/kernels/gemm.py", "pyfused/kernels/reduce.py"),
           peers="pyfused.bench.peers:matmul_reduce_scatter_peers"),
    OpSpec("matmul_all_reduce", ("a", "b"), "all_reduce", False, True, True,
           "a [d0, ..., K], b [K, N] -> [d0, ..., N]",
           "pyfused.fused.all_reduce:fused_matmul_all_reduce",
           ("pyfused/kernels/gemm.py", "csrc/allreduce_cuda.cu"),
           peers="pyfused.bench.peers:matmul_all_reduce_peers"),
    OpSpec("all_reduce_add_rmsnorm", ("x", "residual", "weight"), "all_reduce", False, True, False,
           "x [..., H], residual [..., H], weight [H] -> (normed, new_residual) [..., H]",
           "pyfused.fused.all_reduce:fused_all_reduce_add_rmsnorm",
           ("csrc/allreduce_cuda.cu",)),
    OpSpec("moe_dispatch", ("x", "topk_idx", "weight"), "all_to_all", False, False, False,
           "x [..., H], topk_idx [..., k], weight [E/W, H, N] or None "
           "-> (out [R, N], layout [W, E/W])",
           "pyfused.fused.moe:fused_moe_dispatch", ("pyfused/kernels/grouped_gemm.py",),
           tuned=False),
    OpSpec("moe_combine", ("y", "topk_weights", "topk_idx", "layout", "weight"), "all_to_all",
           False, False, False,
           "y [R, N], topk_weights [..., k], topk_idx [..., k], layout [W, E/W], "
           "weight [E/W, N, H] or None -> out [..., H]", "pyfused.fused.moe:fused_moe_combine",
           ("pyfused/kernels/grouped_gemm.py",), tuned=False),
    OpSpec("ring_attention", ("q", "k", "v"), "p2p", False, False, False,
           "q [B, Hq, S/W, D], k [B, Hkv, S/W, D], v [B, Hkv, S/W, D] -> [B, Hq, S/W, D]",
           None, (), tuned=False, methods=("ring", "allgather", "ulysses")),
)}


class OpNames(Sequence):
    """The names of the registered ops that ``keep`` accepts, read from ``OPS`` at each use, so
    that an op registered later (``registered``) is among them."""

    def __init__(self, keep: Callable[[OpSpec], bool]):
        self._keep = keep

    def _names(self) -> Tuple[str, ...]:
        return tuple(name for name, spec in OPS.items() if self._keep(spec))

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name) -> bool:
        spec = OPS.get(name) if isinstance(name, str) else None
        return spec is not None and self._keep(spec)

    def __repr__(self) -> str:
        return repr(self._names())


GEMM_OPS = OpNames(lambda spec: spec.gemm)
CHUNKED_OPS = OpNames(lambda spec: spec.chunked)
TUNED_OPS = OpNames(lambda spec: spec.tuned)
FUSED_OPS = OpNames(lambda spec: spec.fused is not None)


@contextlib.contextmanager
def registered(spec: OpSpec) -> Iterator[OpSpec]:
    """Within the block ``spec`` is registered like the ops above: everything that reads ``OPS``
    (and the name lists) sees it. On exit it is removed. For ops defined outside pyfused, such as
    a test's toy op, in every process that calls it (each rank of a multi-rank test)."""
    if spec.name in OPS:
        raise ValueError(f"an op named {spec.name!r} is already registered")
    OPS[spec.name] = spec
    try:
        yield spec
    finally:
        del OPS[spec.name]
