"""The signature one rank sends for an op or layer call, and the checks every op shares.

``CallSignature`` names every field that can make a rank refuse a call or that decides whether
backward runs collectives; ``common_refusal`` and ``agreement`` are the checks that apply to every
op and layer, ``check_matmul_inputs`` the contract of the three GEMM ops. All are pure functions of
the gathered signatures, so every rank reaches the same verdict (pyfused/ops/_common.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .. import comm

METHODS = ("unfused", "decomposed", "fused", "auto")
NOT_A_METHOD = len(METHODS)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class MethodUnavailable(RuntimeError):
    """``method=`` asked for a path that cannot run here; the message says why."""


def method_code(method: Any) -> int:
    return METHODS.index(method) if isinstance(method, str) and method in METHODS else NOT_A_METHOD


@dataclass(frozen=True)
class CallSignature:
    """What one rank asks of an op or layer call, as the ranks exchange it."""

    name: str                                # op or layer name
    tensors: Tuple[comm.TensorMeta, ...]     # the tensor arguments (absent: not a tensor)
    method: int = 0                          # index in METHODS; NOT_A_METHOD: not a method
    needs_grad: int = 0                      # bit i: tensor i needs a gradient (backward collectives)
    chunks: int = 0                          # -1: not an int >= 0
    in_group: bool = True                    # False: this rank is not in the group it passed
    fused_ok: bool = False                   # this rank can run the fused method
    auto_method: int = 0                     # this rank's preference for method="auto"
    auto_chunks: int = 0
    options: Tuple[int, ...] = ()            # op or layer specific (eps bits, flags, features)

    def to_wire(self) -> comm.Signature:
        ints = (self.method, self.needs_grad, self.chunks, int(self.in_group), int(self.fused_ok),
                self.auto_method, self.auto_chunks, *self.options)
        return comm.Signature(comm.op_code(self.name), ints, self.tensors)

    @staticmethod
    def from_wire(sig: comm.Signature) -> "CallSignature":
        i = sig.ints
        return CallSignature(sig.name, sig.tensors, i[0], i[1], i[2], bool(i[3]), bool(i[4]), i[5],
                             i[6], tuple(i[7:]))

    def grad_names(self, names: Sequence[str]) -> str:
        need = [n for i, n in enumerate(names) if self.needs_grad >> i & 1]
        return ", ".join(need) if need else "none"


def _meta(t) -> comm.TensorMeta:
    return comm.TensorMeta.of(t) if isinstance(t, torch.Tensor) else comm.TensorMeta(None, None, None)


def int_code(value) -> int:
    """``value`` as an int for a signature; -1 for anything that is not an int (a bool is 0/1)."""
    return int(value) if isinstance(value, int) else -1


def _chunk_code(chunks) -> int:
    return chunks if isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 0 else -1


def call_key(name: str, method, chunks, options: tuple, tensors: Sequence[Any]):
    """The key a repeated call is recognised by: one flat tuple of the arguments and of each tensor's
    shape, dtype, device and requires_grad (no formatting, nothing to hash twice). None when a tensor
    argument is not a tensor (a bad call: it always takes the exchange). A key that cannot be hashed
    (e.g. an unhashable ``method=``) is refused by ``validate.seen``/``remember`` the same way."""
    key = [name, method, chunks, options, torch.is_grad_enabled()]
    for t in tensors:
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):
            key += (t.shape, t.dtype, t.device, t.requires_grad)
        else:
            return None
    return tuple(key)


def common_refusal(sigs: List[CallSignature], names: Sequence[str],
                   method_arg: str = "method") -> Optional[str]:
    """What makes any rank refuse a call, whatever the op: a pure function of ``sigs``."""
    for r, s in enumerate(sigs):
        where = f" (rank {r})" if len(sigs) > 1 else ""
        if not s.in_group:
            return (f"the group passed is not a process group this rank belongs to (a group it is "
                    f"not a member of, or not a 1-D group){where}")
        if s.method == NOT_A_METHOD:
            return f"{method_arg} must be one of {METHODS}{where}"
        if s.chunks < 0:
            return f"chunks must be an int >= 0 (0: tuned or default){where}"
        for name, t in zip(names, s.tensors):
            if t.shape is None:
                return f"{name} must be a tensor{where}"
    return None


def agreement(sigs: List[CallSignature], names: Sequence[str], method_arg: str = "method"
              ) -> Optional[str]:
    """What must be the same on every rank, whatever the op."""
    return (comm.differs(sigs, method_arg, lambda s: s.method, lambda s: METHODS[s.method])
            or comm.differs(sigs, "chunks", lambda s: s.chunks)
            or comm.differs(sigs, "which inputs need a gradient (whether backward runs collectives)",
                            lambda s: s.needs_grad, lambda s: s.grad_names(names))
            or comm.differs(sigs, "the options", lambda s: s.options))


def check_matmul_inputs(sigs: List[CallSignature], world: int, allowed_devices: Tuple[str, ...],
                        scatter_dim0: bool) -> Optional[str]:
    """The contract of a: [d0, ..., K] and b: [K, N], identical across ranks. Pure in ``sigs``."""
    for r, s in enumerate(sigs):
        a, b = s.tensors[0], s.tensors[1]
        where = f" (rank {r})" if len(sigs) > 1 else ""
        if a.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES:
            return (f"a and b must be float32, float16, bfloat16 or float64; got a {a.describe()}, "
                    f"b {b.describe()}{where}")
        if a.dtype != b.dtype:
            return f"a and b must have the same dtype; got a {a.describe()}, b {b.describe()}{where}"
        if a.device != b.device:
            return f"a and b must be on the same device; got a {a.describe()}, b {b.describe()}{where}"
        if world > 1 and a.device not in allowed_devices:
            return (f"tensors on {a.device} cannot be communicated by this process group's backend "
                    f"(it serves {', '.join(allowed_devices)}){where}")
        if len(b.shape) != 2:
            return f"b must be 2-D [K, N]; got b {b.describe()}{where}"
        if not 2 <= len(a.shape) <= 8:
            return f"a must have 2 to 8 dims [d0, ..., K]; got a {a.describe()}{where}"
        if a.shape[-1] != b.shape[0]:
            return (f"a's last dim must equal b's first (K): got a {a.describe()}, "
                    f"b {b.describe()}{where}")
        if 0 in a.shape or 0 in b.shape:
            return f"empty inputs are not supported: a {a.describe()}, b {b.describe()}{where}"
        if scatter_dim0 and a.shape[0] % world != 0:
            return (f"a's dim 0 ({a.shape[0]}) must be divisible by the world size ({world}) to "
                    f"reduce-scatter it; got a {a.describe()}{where}")
    return (comm.differs(sigs, "a", lambda s: s.tensors[0], lambda s: s.tensors[0].describe())
            or comm.differs(sigs, "b", lambda s: s.tensors[1], lambda s: s.tensors[1].describe()))
