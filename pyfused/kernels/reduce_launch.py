"""Launcher of the multi-source reduce (reduce.py), its fp32 reference, and the pieces the
fused kernels share: pointer tables, chunk layout, the timeout status.

``multi_source_reduce(sources, residual=..., weight=..., residual_out=...)`` is the all-reduce +
residual + RMSNorm step of a tensor-parallel block once the P partial sums are reachable by address
(peers' symmetric buffers). ``reduce_ref`` is the fp32 reference tests and benchmarks use.

Pointer tables. The kernels take P buffers as an int64 tensor of ``data_ptr()``s on the kernel's
device (``PointerTable``). On GPU these may be peers' buffers mapped into this process (symmetric
memory); ``PointerTable.from_addresses`` wraps such raw addresses. On CPU the kernels run in the
Triton interpreter, which dereferences a loaded int64 address as a host address: tables of CPU
tensors therefore work unchanged there (checked by tests/test_reduce.py), and the same kernel code
runs on both. What cannot work is a table of CUDA addresses under the interpreter, or CPU tensors
without it; ``check_backend`` refuses both with a clear message.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import preload

# Polls of a flag before a wait gives up (see gemm.py "No hang"). One acquire poll of a flag
# costs on the order of a microsecond on current GPUs, so this is about a minute: far longer than
# any legitimate skew between ranks, finite so that a lost flag fails instead of hanging forever.
DEFAULT_SPIN_LIMIT = 1 << 26
# On a GPU the waits are bounded in wall-clock time instead (gemm.py "No hang"); 0 = forever.
DEFAULT_TIMEOUT_MS = 60_000
SCOPES = ("gpu", "sys")


class WaitTimeout(RuntimeError):
    """A fused kernel gave up waiting for a flag (a peer never signalled)."""


@dataclass
class PointerTable:
    """P buffers of the same shape, strides and dtype, addressed by an int64 tensor on the device.

    ``keep_alive`` holds the tensors the addresses came from (when there are any) so they outlive
    every launch that uses the table."""

    ptrs: Tensor
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    aligned: bool
    keep_alive: Tuple[Tensor, ...] = field(default=(), repr=False)

    def __len__(self) -> int:
        return self.ptrs.numel()

    @classmethod
    def of(cls, tensors: Sequence[Tensor], shape: Optional[Tuple[int, ...]] = None) -> "PointerTable":
        """A table of ``tensors`` (same dtype, device and strides; ``shape`` if given overrides the
        common shape check: each tensor must then have at least ``shape[0]`` rows)."""
        tensors = tuple(tensors)
        if not tensors:
            raise ValueError("a pointer table needs at least one tensor")
        t0 = tensors[0]
        for i, t in enumerate(tensors):
            if t.dtype != t0.dtype or t.device != t0.device or t.stride() != t0.stride():
                raise ValueError(
                    f"pointer table entries must share dtype, device and strides: entry 0 is "
                    f"{t0.dtype} on {t0.device} strides {t0.stride()}, entry {i} is {t.dtype} on "
                    f"{t.device} strides {t.stride()}")
            if shape is None and t.shape != t0.shape:
                raise ValueError(f"pointer table entries must share a shape: entry 0 is "
                                 f"{tuple(t0.shape)}, entry {i} is {tuple(t.shape)}")
        addrs = [t.data_ptr() for t in tensors]
        table = cls.from_addresses(addrs, tuple(shape or t0.shape), t0.stride(), t0.dtype, t0.device)
        table.keep_alive = tensors
        return table

    @classmethod
    def from_addresses(cls, addrs: Sequence[int], shape: Tuple[int, ...], stride: Tuple[int, ...],
                       dtype: torch.dtype, device: torch.device) -> "PointerTable":
        """A table of raw addresses (e.g. peers' symmetric buffers mapped into this process)."""
        device = torch.device(device)
        ptrs = torch.tensor(list(addrs), dtype=torch.int64).to(device)
        # Only the base addresses need the claim; the kernel's stride arguments carry their own
        # divisibility (Triton specializes integer arguments divisible by 16).
        aligned = all(a % 16 == 0 for a in addrs)
        return cls(ptrs, tuple(shape), tuple(stride), dtype, device, aligned)


# The interpreter keeps the grid index of the running launch in module state, so launches from
# several threads (virtual ranks on CPU, pyfused/testing/virtual_ranks.py) must not interleave.
_INTERPRETER_LOCK = threading.Lock()
# How many concurrent_interpreter_launches blocks are open, in any thread.
_CONCURRENT_HARNESSES = [0]
_CONCURRENT_LOCK = threading.Lock()


@contextlib.contextmanager
def concurrent_interpreter_launches():
    """Inside the block, interpreted launches (CPU tensors) from different threads run at once
    instead of one after another, and a CPU wait may start before its flag is set (another
    thread's launch or copy sets it). Only for an interpreter made safe for concurrent launches
    first: pyfused/testing/interpreter.py does that for the threaded-rank tests. Process-wide (the
    threads that launch are not the one that enters the block)."""
    with _CONCURRENT_LOCK:
        _CONCURRENT_HARNESSES[0] += 1
    try:
        yield
    finally:
        with _CONCURRENT_LOCK:
            _CONCURRENT_HARNESSES[0] -= 1


def interpreter_launches_concurrent() -> bool:
    """Whether interpreted launches may overlap (``concurrent_interpreter_launches`` in force)."""
    return _CONCURRENT_HARNESSES[0] > 0


def check_backend(device: torch.device, kernel, what: str) -> bool:
    """Refuse the two combinations the Triton launch cannot serve (see the module docstring);
    whether the launch runs in the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(kernel, InterpretedFunction)
    if device.type == "cuda" and interpreted:
        raise RuntimeError(f"{what}: TRITON_INTERPRET=1 is set but the tensors are on {device}; the "
                           f"interpreter cannot dereference device addresses. Unset TRITON_INTERPRET.")
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(f"{what}: tensors on {device} run only in the Triton interpreter; set "
                           f"TRITON_INTERPRET=1 before pyfused.kernels is imported, or use CUDA tensors")
    if interpreted:
        with _INTERPRETER_LOCK:  # the probe is an interpreted launch too
            problem = interpreter_problem()
        if problem:
            raise RuntimeError(f"{what}: {problem}")
    return interpreted


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> Optional[str]:
    """Why this Triton's interpreter cannot run pyfused's kernels (None: it can), found by running
    the construct they need: a loop bounded by ``tl.program_id``. Triton 3.6's interpreter turns
    such a bound into an int with ``int(<1-element array>)``, which NumPy >= 2.4 refuses (later
    Triton squeezes the array first)."""
    import numpy as np
    import triton
    import triton.language as tl

    @triton.jit
    def probe(out_ptr, n):
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            tl.store(out_ptr + i, i + 1)

    out = torch.zeros(2, dtype=torch.int32)
    try:
        probe[(1,)](out, 2)
    except Exception as e:  # noqa: BLE001 -- whatever it is, the kernels would hit it too
        return (f"the Triton interpreter (triton {triton.__version__}, numpy {np.__version__}) fails "
                f"on a loop bounded by tl.program_id: {type(e).__name__}: {e}. Known case: triton "
                f"3.6 with numpy >= 2.4 (pip install 'numpy<2.4', or triton >= 3.8)")
    if out.tolist() != [1, 2]:
        return f"the Triton interpreter computed {out.tolist()} for a probe loop instead of [1, 2]"
    return None


def chunk_rows_of(m: int, num_chunks: int) -> int:
    """Rows per chunk (the last chunk may be shorter); raises if a chunk would be empty."""
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    rows = -(-m // num_chunks)
    if (num_chunks - 1) * rows >= m:
        raise ValueError(f"{m} rows cannot be cut into {num_chunks} non-empty chunks of "
                         f"ceil({m}/{num_chunks}) = {rows} rows; use at most {-(-m // rows)} chunks")
    return rows


_order_cache: Dict[Tuple[Tuple[int, ...], int, torch.device], Tensor] = {}


def chunk_order_tensor(order: Optional[Sequence[int]], num_chunks: int,
                       device: torch.device) -> Optional[Tensor]:
    """The int32 device tensor of a chunk visiting order (a permutation of range(num_chunks)),
    cached per (order, device) so steady-state calls do no host-to-device copy."""
    if order is None:
        return None
    if isinstance(order, Tensor):
        raise TypeError("chunk_order must be a sequence of ints (it is validated on the host)")
    cached = _order_cache.get((tuple(order), num_chunks, device))
    if cached is not None:  # an order is checked once, when it is first seen
        return cached
    ints = tuple(int(c) for c in order)
    if sorted(ints) != list(range(num_chunks)):
        raise ValueError(f"chunk_order must be a permutation of range({num_chunks}), got {ints}")
    tensor = torch.tensor(ints, dtype=torch.int32).to(device)
    _order_cache[(tuple(order), num_chunks, device)] = tensor
    return tensor


def check_flags(name: str, flags: Tensor, shape: Tuple[int, ...], device: torch.device) -> None:
    if not isinstance(flags, Tensor) or flags.dtype != torch.int32 or flags.device != device:
        raise ValueError(f"{name} must be an int32 tensor on {device}, got "
                         f"{getattr(flags, 'dtype', type(flags))} on {getattr(flags, 'device', '?')}")
    if tuple(flags.shape) != shape or not flags.is_contiguous():
        raise ValueError(f"{name} must be a contiguous tensor of shape {shape}, got "
                         f"{tuple(flags.shape)} (contiguous={flags.is_contiguous()})")


# On CPU a wait on an unset flag is allowed only with a spin limit the interpreter gets through in a
# moment (to exercise the timeout path); a longer one would just look like a hang.
CPU_MAX_SPINS = 1000


def check_wait_args(name: str, flags: Tensor, expected: int, spin_limit: int) -> None:
    """Checks of a wait's spin limit, and on CPU of the flags themselves: the interpreter runs
    programs one after another, so nothing can set a flag while the kernel spins (unless another
    thread's launch can: ``concurrent_interpreter_launches``)."""
    if not isinstance(spin_limit, int) or not 0 < spin_limit < 2 ** 31:
        raise ValueError(f"spin_limit must be an int in [1, 2**31), got {spin_limit!r}")
    if (flags.device.type == "cuda" or spin_limit <= CPU_MAX_SPINS
            or interpreter_launches_concurrent()):
        return
    if bool((flags < expected).any()):
        bad = torch.nonzero(flags.reshape(-1) < expected).reshape(-1).tolist()
        raise ValueError(f"{name}: on CPU (Triton interpreter) every flag must be >= expected "
                         f"({expected}) before the launch; flat indices {bad} are not (pass "
                         f"spin_limit <= {CPU_MAX_SPINS} to see the kernel time out instead)")


def new_status(device: torch.device) -> Tensor:
    """A zeroed timeout-status word for one launch (see ``raise_on_timeout``)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def raise_on_timeout(status: Tensor, describe) -> None:
    """Raise ``WaitTimeout`` if a kernel recorded a timeout in ``status`` (synchronizes with it).
    ``describe(code)`` turns the kernel's code into words."""
    code = int(status.reshape(-1)[0].item())
    if code != 0:
        raise WaitTimeout(f"gave up waiting on {describe(code)} after its time limit; the peer that "
                          f"should have set it did not (the output is incomplete)")


def timeout_ns(timeout_ms: int) -> int:
    """The kernels' wall-clock wait bound in ns for ``timeout_ms`` (0: wait forever, ~146 years)."""
    if not isinstance(timeout_ms, int) or timeout_ms < 0:
        raise ValueError(f"timeout_ms must be an int >= 0, got {timeout_ms!r}")
    return min(timeout_ms, 10**9) * 1_000_000 if timeout_ms else 2**62


def serialized(device: torch.device):
    """Hold the interpreter's lock around a launch on CPU tensors (unless launches may overlap:
    ``concurrent_interpreter_launches``); nothing on a GPU."""
    if device.type == "cuda" or interpreter_launches_concurrent():
        return contextlib.nullcontext()
    return _INTERPRETER_LOCK


def check_scope(name: str, scope: str) -> None:
    if scope not in SCOPES:
        raise ValueError(f"{name} must be one of {SCOPES}, got {scope!r}")


# ------------------------------------------------------------------------------------------------
# The multi-source reduce
# ------------------------------------------------------------------------------------------------

def reduce_ref(sources: Sequence[Tensor], residual: Optional[Tensor] = None,
               weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """fp32 reference: (out, h) with h = sum(sources) (+ residual) and out = h, or RMSNorm(h) *
    weight when ``weight`` is given."""
    dt = torch.promote_types(sources[0].dtype, torch.float32)
    h = sum(s.to(dt) for s in sources)
    if residual is not None:
        h = h + residual.to(dt)
    if weight is None:
        return h, h
    rstd = torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return h * rstd * weight.to(dt), h


def _as_table(sources: Union[PointerTable, Sequence[Tensor]]) -> PointerTable:
    if isinstance(sources, PointerTable):
        return sources
    if isinstance(sources, Tensor):
        raise TypeError("sources must be a sequence of tensors or a PointerTable, not one tensor "
                        "(for stacked sources pass list(stacked))")
    return PointerTable.of(sources)


def _check_rows_like(name: str, t: Tensor, m: int, n: int, device: torch.device) -> None:
    if not isinstance(t, Tensor) or t.dim() != 2 or tuple(t.shape) != (m, n):
        raise ValueError(f"{name} must be a 2-D tensor of shape ({m}, {n}), got "
                         f"{tuple(t.shape) if isinstance(t, Tensor) else type(t)}")
    if t.device != device or t.stride(1) != 1 or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor on {device} with unit column stride, "
                         f"got {t.dtype} on {t.device} strides {t.stride()}")


def _check_reduce_tensors(table: PointerTable, out, residual, residual_out, weight) -> Tensor:
    """Validate the tensors of a reduce; returns ``out`` (allocated if None)."""
    if len(table.shape) != 2 or table.stride[1] != 1:
        raise ValueError(f"sources must be 2-D [M, N] with unit column stride, got shape "
                         f"{table.shape} strides {table.stride}")
    if table.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"sources must be float16, bfloat16 or float32, got {table.dtype}")
    (m, n), device = table.shape, table.device
    if m == 0 or n == 0:
        raise ValueError(f"empty sources are not supported: shape {table.shape}")
    if out is None:
        out = torch.empty((m, n), dtype=table.dtype, device=device)
    _check_rows_like("out", out, m, n, device)
    if out.dtype != table.dtype:
        raise ValueError(f"out must have the sources' dtype {table.dtype}, got {out.dtype}")
    for name, t in (("residual", residual), ("residual_out", residual_out)):
        if t is not None:
            _check_rows_like(name, t, m, n, device)
    if weight is not None and (tuple(weight.shape) != (n,) or weight.device != device):
        raise ValueError(f"weight must be a tensor of shape ({n},) on {device}, got "
                         f"{tuple(weight.shape)} on {weight.device}")
    return out


def multi_source_reduce(sources: Union[PointerTable, Sequence[Tensor]], *,
                        out: Optional[Tensor] = None, residual: Optional[Tensor] = None,
                        residual_out: Optional[Tensor] = None, weight: Optional[Tensor] = None,
                        eps: float = 1e-6, num_chunks: int = 1,
                        chunk_order: Optional[Sequence[int]] = None,
                        wait_flags: Optional[Tensor] = None, wait_expected: int = 1,
                        status: Optional[Tensor] = None, spin_limit: int = DEFAULT_SPIN_LIMIT,
                        timeout_ms: int = DEFAULT_TIMEOUT_MS, flag_scope: str = "sys", config=None,
                        num_programs: Optional[int] = None) -> Tensor:
    """``out = sum_p sources[p] (+ residual)``, then RMSNorm with ``weight`` if given; see
    reduce.py for the math and the memory ordering.

    sources: P tensors [M, N] (same dtype/strides, unit column stride) or a ``PointerTable``. A list
      is turned into a table on every call (a host-to-device copy of P addresses, which a CUDA graph
      cannot capture); build the table once for buffers that persist.
    residual_out: written with the pre-norm sum h (may be ``residual`` itself, for in place).
    wait_flags: int32 [num_chunks] (one flag per chunk) or [P, num_chunks] (per source and chunk);
      chunk c of source p is read only once its flag is >= ``wait_expected``.
    status: an int32 [1] zero word; a wait that times out writes its code there (check it with
      ``raise_on_timeout(status, describe_reduce_timeout(P, num_chunks))`` after synchronizing).
      On CPU the launcher checks it itself.
    spin_limit / timeout_ms: a wait gives up after ``spin_limit`` polls in the interpreter, after
      ``timeout_ms`` of wall-clock time on a GPU.
    num_programs: the most programs the (persistent) kernel runs; default 8 per SM. Cap it to leave
      SMs to kernels that must run beside a waiting reduce.
    Returns ``out`` (allocated like the sources if not given).
    """
    from .gemm_configs import arch_of
    from .reduce import multi_source_reduce_kernel
    from .reduce_configs import choose_reduce_config

    table = _as_table(sources)
    check_backend(table.device, multi_source_reduce_kernel,
                  "pyfused.kernels.reduce_launch.multi_source_reduce")
    out = _check_reduce_tensors(table, out, residual, residual_out, weight)
    (m, n), device, p = table.shape, table.device, len(table)
    chunk_rows = chunk_rows_of(m, num_chunks)
    order = chunk_order_tensor(chunk_order, num_chunks, device)
    check_scope("flag_scope", flag_scope)
    wait = wait_flags is not None
    flag_stride_p = 0
    if wait:
        shape = tuple(wait_flags.shape)
        check_flags("wait_flags", wait_flags, (p, num_chunks) if len(shape) == 2 else (num_chunks,),
                    device)
        flag_stride_p = num_chunks if len(shape) == 2 else 0
        check_wait_args("wait_flags", wait_flags, wait_expected, spin_limit)
    if status is None:
        status = new_status(device)
    else:
        check_flags("status", status, (1,), device)

    cfg = config or choose_reduce_config(m, n, p, table.dtype, arch_of(device), num_chunks,
                                         rmsnorm=weight is not None)
    if weight is not None and cfg.block_n < n:
        raise ValueError(f"config {cfg}: RMSNorm needs block_n >= N ({n})")
    tiles = num_chunks * -(-chunk_rows // cfg.rows_per_prog) * -(-n // cfg.block_n)
    if num_programs is None:
        num_programs = tiles
    if not isinstance(num_programs, int) or num_programs < 1:
        raise ValueError(f"num_programs must be a positive int, got {num_programs!r}")
    dummy = out  # stands in for absent optional pointers; never dereferenced
    with serialized(device):
        preload.launch(
            multi_source_reduce_kernel, (min(tiles, num_programs),),
            table.ptrs, out, residual if residual is not None else dummy,
            residual_out if residual_out is not None else dummy, weight if weight is not None else dummy,
            wait_flags if wait else status, order if order is not None else status, status,
            m, n, chunk_rows, num_chunks, cfg.rows_per_prog,
            table.stride[0], out.stride(0), residual.stride(0) if residual is not None else 0,
            residual_out.stride(0) if residual_out is not None else 0,
            flag_stride_p, int(wait_expected), int(spin_limit), timeout_ns(timeout_ms), float(eps),
            P=p, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, WAIT=wait, HAS_ORDER=order is not None,
            HAS_RESIDUAL=residual is not None, WRITE_RESIDUAL=residual_out is not None,
            RMSNORM=weight is not None, ALIGNED_SRC=table.aligned, FLAG_SCOPE=flag_scope,
            WALL_CLOCK=device.type == "cuda", num_warps=cfg.num_warps,
        )
    if wait and device.type != "cuda":
        raise_on_timeout(status, describe_reduce_timeout(p, num_chunks))
    return out


def describe_reduce_timeout(num_sources: int, num_chunks: int):
    def describe(code: int) -> str:
        p, c = divmod(code - 1, num_chunks)
        return f"the flag of source {p}, chunk {c} (of {num_sources} sources x {num_chunks} chunks)"
    return describe
