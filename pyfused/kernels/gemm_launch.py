"""Launcher of the persistent Triton GEMM (gemm.py) and its fp32 reference ``gemm_ref``.

``gemm(a, b, bias)`` is ``a @ b + bias`` (fp32 accumulation) with the options the fused collective
ops build on, each off by default:
  * wait (``wait_flags``): all-gather + GEMM consumer -- a tile of chunk c reads A only once
    ``wait_flags[c] >= wait_expected``; ``chunk_order`` says which chunk is computed first.
  * signal (``signal_counters``): GEMM + reduce-scatter / all-reduce producer -- each stored tile of
    chunk c adds 1 to ``signal_counters[c]`` with release semantics; chunk c is complete when its
    counter has grown by ``plan.tiles_per_chunk``.
  * scatter (``out_chunks``): chunk c of C goes to buffer c (e.g. a peer's), not one [M, N] tensor.

Config choice and ranks. The tile shape sets how many tiles a chunk has, which is the count a peer
waits for, so every rank must use the same one. The default config is a pure function of
``(shape, dtype, arch)`` (gemm_configs.py); ``plan_gemm`` exposes it (and the tile counts)
so the other side of a signal computes the same numbers. ``autotune=True`` picks a config by timing
on *this* process, which ranks could resolve differently; it is therefore allowed only for a plain
GEMM (no wait, signal, scatter or chunking) and refused for collective use. A tuned config meant for
collective use must be chosen once (rank 0) and passed as ``config=`` on every rank.

bf16 on CPU. The Triton interpreter's ``tl.dot`` multiplies bf16 bit patterns as integers (triton
3.6 and 3.8: results around 1e11), so under the interpreter bf16 operands go to the kernel as fp32
copies (``_interpreter_dot_operands``): exact, and the products then accumulate in fp32 as on
tensor cores. Compiled launches (a GPU, or CPU tensors compiled ahead of time for a GPU target)
keep their bf16 operands.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import preload
from .reduce_launch import (
    DEFAULT_SPIN_LIMIT,
    DEFAULT_TIMEOUT_MS,
    PointerTable,
    check_backend,
    check_flags,
    check_scope,
    check_wait_args,
    chunk_order_tensor,
    chunk_rows_of,
    interpreter_launches_concurrent,
    new_status,
    raise_on_timeout,
    serialized,
    timeout_ns,
)

B_LAYOUTS = ("kn", "nk")


def gemm_ref(a: Tensor, b: Tensor, bias: Optional[Tensor] = None, b_layout: str = "kn") -> Tensor:
    """fp32 (fp64 for fp64 inputs) reference of ``gemm``: ``a @ b (+ bias)``, with ``b`` [K, N]
    (``b_layout="kn"``) or an nn.Linear weight [N, K] (``"nk"``)."""
    dt = torch.promote_types(a.dtype, torch.float32)
    bm = b.to(dt) if b_layout == "kn" else b.to(dt).t()
    out = a.to(dt) @ bm
    return out + bias.to(dt) if bias is not None else out


@dataclass(frozen=True)
class GemmPlan:
    """The tiling of one GEMM call: what a peer needs to agree on with this rank."""

    config: "object"  # kernels.gemm_configs.GemmConfig
    m: int
    n: int
    num_chunks: int
    chunk_rows: int
    tiles_per_chunk: int

    @property
    def num_tiles(self) -> int:
        return self.num_chunks * self.tiles_per_chunk

    def chunk_bounds(self, c: int) -> Tuple[int, int]:
        """Rows [start, stop) of chunk c."""
        return c * self.chunk_rows, min(self.m, (c + 1) * self.chunk_rows)


def plan_gemm(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *,
              num_chunks: int = 1, config=None, allow_tf32: bool = False) -> GemmPlan:
    """The config and tile counts ``gemm`` uses for these arguments (deterministic; see module doc).
    A pure function of its arguments, so it is computed once per distinct call (a launch asks for
    it on every call)."""
    from .gemm_configs import arch_of

    return _plan_gemm(m, n, k, dtype, arch_of(torch.device(device)), num_chunks, config,
                      bool(allow_tf32))


@functools.lru_cache(maxsize=1024)
def _plan_gemm(m: int, n: int, k: int, dtype: torch.dtype, arch: str, num_chunks: int, config,
               allow_tf32: bool) -> GemmPlan:
    from .gemm_configs import choose_gemm_config

    chunk_rows = chunk_rows_of(m, num_chunks)
    cfg = config or choose_gemm_config(m, n, k, dtype, arch, num_chunks, allow_tf32)
    tm, tn = cfg.tiles(chunk_rows, n)
    return GemmPlan(cfg, m, n, num_chunks, chunk_rows, tm * tn)


def describe_gemm_timeout(code: int) -> str:
    return f"the wait flag of chunk {code - 1}"


_autotuned: Dict[Tuple[str, str], object] = {}
AUTOTUNE_K_MULTIPLE = 64


def _autotuned_kernel(arch: str, dtype: torch.dtype, allow_tf32: bool):
    """``triton.autotune`` over the table's candidates, for the plain GEMM only (module docstring)."""
    import triton

    from .gemm import persistent_gemm_kernel
    from .gemm_configs import autotune_candidates, dtype_class

    key = (arch, dtype_class(dtype, allow_tf32))
    if key not in _autotuned:
        candidates = autotune_candidates(arch, dtype, allow_tf32)
        if any(AUTOTUNE_K_MULTIPLE % c.block_k for c in candidates):
            raise ValueError(f"autotune candidates must have BLOCK_K dividing {AUTOTUNE_K_MULTIPLE}")
        configs = [triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                                  "GROUP_M": c.group_m}, num_warps=c.num_warps,
                                 num_stages=c.num_stages)
                   for c in candidates]
        _autotuned[key] = triton.autotune(
            configs=configs, key=["M", "N", "K", "stride_ak", "stride_bk", "stride_bn"],
        )(persistent_gemm_kernel)
    return _autotuned[key]


def _check_inputs(a: Tensor, b: Tensor, bias: Optional[Tensor], b_layout: str) -> Tuple[int, int, int]:
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise TypeError("a and b must be tensors")
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"b_layout must be one of {B_LAYOUTS}, got {b_layout!r}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"a and b must share a dtype among float16, bfloat16, float32; got "
                         f"a {a.dtype}, b {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got a {a.device}, b {b.device}")
    m, k = a.shape
    kb, n = b.shape if b_layout == "kn" else (b.shape[1], b.shape[0])
    if kb != k:
        what = "b [K, N]" if b_layout == "kn" else "weight [N, K]"
        raise ValueError(f"K mismatch: a is {tuple(a.shape)}, {what} is {tuple(b.shape)}")
    if 0 in (m, n, k):
        raise ValueError(f"empty GEMM not supported: M={m}, N={n}, K={k}")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.device != a.device):
        raise ValueError(f"bias must have shape ({n},) on {a.device}, got {tuple(bias.shape)} on "
                         f"{bias.device}")
    return m, n, k


def _interpreter_dot_operands(a: Tensor, b: Tensor, wait: bool) -> Tuple[Tensor, Tensor]:
    """The operands an interpreted kernel multiplies (see "bf16 on CPU" in the module docstring):
    fp32 copies of bf16 ones. A copy taken at the launch holds what the kernel would read because
    on CPU every flag a wait reads is set before the launch (``check_wait_args``), except where
    other threads' launches may still write ``a`` during the wait
    (``concurrent_interpreter_launches``): there the interpreter must multiply bf16 itself."""
    if a.dtype != torch.bfloat16:
        return a, b
    if wait and interpreter_launches_concurrent():
        problem = interpreter_bf16_dot_problem()
        if problem:
            raise RuntimeError(f"pyfused.kernels.gemm_launch.gemm: a bf16 GEMM that waits on "
                               f"flags set by concurrent launches reads a as it arrives, so it "
                               f"cannot take an fp32 copy of it at the launch, and {problem} "
                               f"(pyfused/testing/interpreter.py widens bf16 dots for the "
                               f"threaded-rank tests)")
        return a, b
    return a.float(), b.float()


def interpreter_bf16_dot_problem() -> Optional[str]:
    """Why the Triton interpreter's bf16 ``tl.dot`` is wrong here (None: it is right), found by
    running one: ones(16, 16) @ ones(16, 16) must be 16 everywhere."""
    ones = torch.ones(16, 16, dtype=torch.bfloat16)
    out = torch.zeros(16, 16, dtype=torch.float32)
    _bf16_dot_probe()[(1,)](ones, out)
    if not bool((out == 16).all()):
        return (f"the Triton interpreter's bf16 tl.dot computes {out.flatten()[0].item():.4g} "
                f"instead of 16 for ones(16, 16) @ ones(16, 16)")
    return None


@functools.lru_cache(maxsize=None)
def _bf16_dot_probe():
    import triton
    import triton.language as tl

    @triton.jit
    def probe(a_ptr, out_ptr):
        offs = tl.arange(0, 16)
        a = tl.load(a_ptr + offs[:, None] * 16 + offs[None, :])
        tl.store(out_ptr + offs[:, None] * 16 + offs[None, :], tl.dot(a, a))
    return probe


def _out_table(out_chunks, plan: GemmPlan, dtype: torch.dtype, device: torch.device) -> PointerTable:
    """Validate the scatter targets: chunk c's buffer holds at least its rows x N."""
    if isinstance(out_chunks, PointerTable):
        table = out_chunks
        if table.shape[0] < plan.chunk_rows or table.shape[1] != plan.n:
            raise ValueError(f"out_chunks buffers must be ({plan.chunk_rows}, {plan.n}), got {table.shape}")
    else:
        out_chunks = list(out_chunks)
        for c, t in enumerate(out_chunks):
            lo, hi = plan.chunk_bounds(c)
            if t.dim() != 2 or t.shape[0] < hi - lo or t.shape[1] != plan.n:
                raise ValueError(f"out_chunks[{c}] must hold chunk {c}'s {hi - lo} rows x {plan.n}, "
                                 f"got {tuple(t.shape)}")
        table = PointerTable.of(out_chunks, shape=(plan.chunk_rows, plan.n))
    if len(table) != plan.num_chunks:
        raise ValueError(f"out_chunks needs one buffer per chunk ({plan.num_chunks}), got {len(table)}")
    if table.dtype != dtype or table.device != device:
        raise ValueError(f"out_chunks must be {dtype} on {device}, got {table.dtype} on {table.device}")
    return table


def _check_options(autotune, config, device, num_chunks, chunk_order, wait_flags, wait_expected,
                   signal_counters, scatter, spin_limit, flag_scope, signal_scope) -> None:
    collective = (wait_flags is not None or signal_counters is not None or scatter
                  or num_chunks != 1 or chunk_order is not None)
    if autotune and (collective or config is not None):
        raise ValueError("autotune=True times configs on this process only, so ranks could pick "
                         "different tiles (and different tile counts per chunk); it is allowed only "
                         "for a plain GEMM without config, wait, signal, scatter or chunking. Pick a "
                         "config once (rank 0) and pass config= on every rank instead.")
    if autotune and device.type != "cuda":
        raise ValueError("autotune=True needs a GPU (the interpreter's timings mean nothing)")
    check_scope("flag_scope", flag_scope)
    check_scope("signal_scope", signal_scope)
    for name, flags in (("wait_flags", wait_flags), ("signal_counters", signal_counters)):
        if flags is not None:
            check_flags(name, flags, (num_chunks,), device)
    if wait_flags is not None:
        check_wait_args("wait_flags", wait_flags, wait_expected, spin_limit)


def gemm(a: Tensor, b: Tensor, bias: Optional[Tensor] = None, *, b_layout: str = "kn",
         out: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
         num_chunks: int = 1, chunk_order: Optional[Sequence[int]] = None,
         wait_flags: Optional[Tensor] = None, wait_expected: int = 1,
         signal_counters: Optional[Tensor] = None,
         out_chunks: Union[None, PointerTable, Sequence[Tensor]] = None,
         status: Optional[Tensor] = None, spin_limit: int = DEFAULT_SPIN_LIMIT,
         timeout_ms: int = DEFAULT_TIMEOUT_MS, flag_scope: str = "sys", signal_scope: str = "gpu",
         config=None, autotune: bool = False,
         num_programs: Optional[int] = None, allow_tf32: Optional[bool] = None
         ) -> Union[Tensor, PointerTable, List[Tensor]]:
    """``C = a @ b (+ bias)`` with the persistent Triton kernel; see the module docstring.

    a: [M, K]; b: [K, N] (``b_layout="kn"``) or an nn.Linear weight [N, K] (``"nk"``); any strides.
    out / out_dtype: the [M, N] result (default: a new tensor of a's dtype).
    num_chunks, chunk_order: rows are cut into ``num_chunks`` chunks of ceil(M / num_chunks) rows,
      computed in ``chunk_order`` (a permutation of range(num_chunks); default 0, 1, ...).
    wait_flags: int32 [num_chunks]; chunk c's tiles read a only once ``wait_flags[c] >=
      wait_expected`` (acquire at ``flag_scope``: "sys" when peers or the host set the flags).
    signal_counters: int32 [num_chunks]; +1 per stored tile of chunk c (release at ``signal_scope``:
      "gpu" for a consumer on this GPU, "sys" for one on a peer GPU).
    out_chunks: one buffer per chunk (tensors [>= rows of chunk c, N] sharing strides, or a
      ``PointerTable``, built once for persistent buffers: a list costs a host-to-device copy per
      call); chunk c of C is written there instead of to ``out``.
    status: int32 [1] zero word; a wait that gives up (after ``timeout_ms`` of wall-clock time on a
      GPU, after ``spin_limit`` polls in the interpreter) writes 1 + chunk
      there (check with ``raise_on_timeout(status, describe_gemm_timeout)`` after synchronizing; on
      CPU the launcher checks itself).
    allow_tf32: fp32 inputs only; default ``torch.backends.cuda.matmul.allow_tf32``.
    Returns ``out``, or ``out_chunks`` when scattering.
    """
    from .gemm import persistent_gemm_kernel
    from .gemm_configs import NOMINAL_SMS

    m, n, k = _check_inputs(a, b, bias, b_layout)
    device = a.device
    interpreted = check_backend(device, persistent_gemm_kernel, "pyfused.kernels.gemm_launch.gemm")
    if allow_tf32 is None:
        allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    allow_tf32 = allow_tf32 and a.dtype == torch.float32
    wait, signal, scatter = wait_flags is not None, signal_counters is not None, out_chunks is not None
    _check_options(autotune, config, device, num_chunks, chunk_order, wait_flags, wait_expected,
                   signal_counters, scatter, spin_limit, flag_scope, signal_scope)
    plan = plan_gemm(m, n, k, a.dtype, device, num_chunks=num_chunks, config=config,
                     allow_tf32=allow_tf32)
    order = chunk_order_tensor(chunk_order, num_chunks, device)
    if status is None:
        status = new_status(device)
    else:
        check_flags("status", status, (1,), device)

    out_dtype = out_dtype or (out.dtype if out is not None else a.dtype)
    if scatter:
        if out is not None:
            raise ValueError("give either out or out_chunks, not both")
        table = _out_table(out_chunks, plan, out_dtype, device)
        # The kernel takes C's element type from its c argument; with raw addresses any tensor of
        # the type will do.
        c_arg = (table.keep_alive[0] if table.keep_alive
                 else torch.empty(1, dtype=out_dtype, device=device))
        c_strides = table.stride
    else:
        if out is None:
            out = torch.empty((m, n), dtype=out_dtype, device=device)
        if tuple(out.shape) != (m, n) or out.device != device or out.dtype != out_dtype:
            raise ValueError(f"out must be ({m}, {n}) {out_dtype} on {device}, got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")
        table, c_arg, c_strides = None, out, out.stride()
    if num_programs is None:
        num_programs = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else NOMINAL_SMS["interpreter"])
    if not isinstance(num_programs, int) or num_programs < 1:
        raise ValueError(f"num_programs must be a positive int, got {num_programs!r}")

    if interpreted:
        a, b = _interpreter_dot_operands(a, b, wait)
    dummy = status  # stands in for absent optional pointers; never dereferenced
    stride_bk, stride_bn = (b.stride(0), b.stride(1)) if b_layout == "kn" else (b.stride(1), b.stride(0))
    args = (a, b, c_arg, bias if bias is not None else dummy, table.ptrs if scatter else dummy,
            wait_flags if wait else dummy, signal_counters if signal else dummy,
            order if order is not None else dummy, status,
            m, n, k, plan.chunk_rows, num_chunks,
            a.stride(0), a.stride(1), stride_bk, stride_bn, *c_strides,
            int(wait_expected), int(spin_limit), timeout_ns(timeout_ms))
    flags = dict(WAIT=wait, SIGNAL=signal, SCATTER=scatter, HAS_BIAS=bias is not None,
                 HAS_ORDER=order is not None, ALIGNED_OUT=bool(scatter and table.aligned),
                 INPUT_PRECISION="tf32" if a.dtype != torch.float32 or allow_tf32 else "ieee",
                 FLAG_SCOPE=flag_scope, SIGNAL_SCOPE=signal_scope, WALL_CLOCK=device.type == "cuda")
    if autotune:
        _launch_autotuned(args, flags, m, n, k, a.dtype, allow_tf32, device, num_programs)
    else:
        cfg = plan.config
        with serialized(device):
            preload.launch(
                persistent_gemm_kernel, (min(num_programs, plan.num_tiles),),
                *args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0, **flags,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if wait and device.type != "cuda":
        raise_on_timeout(status, describe_gemm_timeout)
    return out_chunks if scatter else out


def _launch_autotuned(args, flags, m, n, k, dtype, allow_tf32, device, num_programs) -> None:
    from .gemm_configs import arch_of

    kernel = _autotuned_kernel(arch_of(device), dtype, allow_tf32)

    def grid(meta):
        return (min(num_programs, -(-m // meta["BLOCK_M"]) * -(-n // meta["BLOCK_N"])),)

    # EVEN_K must hold for whichever BLOCK_K wins: every candidate's BLOCK_K divides
    # AUTOTUNE_K_MULTIPLE (checked in _autotuned_kernel), so K being a multiple of it suffices.
    kernel[grid](*args, EVEN_K=k % AUTOTUNE_K_MULTIPLE == 0, **flags)
