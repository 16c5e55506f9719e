"""Functional fused ops: GEMM + collective (all-to-all for the MoE ops), each with methods
unfused | decomposed | fused | auto.

Each is a ``torch.library`` custom op (``torch.ops.pyfused.<name>``, 2-D, with a fake implementation
and registered autograd) under a functional wrapper that validates across ranks and reshapes.
"""
from ..comm import InputError
from ._common import METHODS, MethodUnavailable, observe_methods
from .all_gather_matmul import all_gather_matmul, all_gather_matmul_ref
from .all_reduce_add_rmsnorm import all_reduce_add_rmsnorm, all_reduce_add_rmsnorm_ref
from .matmul_all_reduce import matmul_all_reduce, matmul_all_reduce_ref
from .matmul_reduce_scatter import matmul_reduce_scatter, matmul_reduce_scatter_ref
from .moe_combine import moe_combine, moe_combine_ref
from .moe_dispatch import moe_dispatch, moe_dispatch_ref
from .ring_attention import ring_attention, ring_attention_ref

__all__ = [
    "METHODS", "InputError", "MethodUnavailable", "all_gather_matmul", "all_gather_matmul_ref",
    "all_reduce_add_rmsnorm", "all_reduce_add_rmsnorm_ref",
    "matmul_all_reduce", "matmul_all_reduce_ref", "matmul_reduce_scatter", "matmul_reduce_scatter_ref",
    "moe_combine", "moe_combine_ref", "moe_dispatch", "moe_dispatch_ref",
    "observe_methods", "ring_attention", "ring_attention_ref",
]
