"""Launch configs of the persistent GEMM (gemm.py), as data.

The config of a call is a pure function of ``(shape, dtype, arch)``: ``choose_gemm_config`` reads a
fixed table for the device's architecture and picks between a large and a medium tile by a
wave-quantization rule that uses the *nominal* SM count of the architecture (never the runtime
count, never a timing). So every rank of a tensor-parallel group with the same GPU model picks the
same tile shape, and therefore the same number of output tiles per chunk -- the count a consumer of
the ``signal`` counters waits for (see ``pyfused.kernels.gemm_launch.plan_gemm``).

The table's entries are starting points taken from the usual Triton GEMM configs for these
architectures (the Triton matmul tutorials' sm_80 / sm_90 sets); none has been measured in this
repository yet (docs/PERF_kernels.md lists the GPU runs that will check them).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # output tiles of GROUP_M row-blocks are visited column-major, for L2 reuse of B
    num_warps: int = 4
    num_stages: int = 3

    def tiles(self, chunk_rows: int, n: int) -> Tuple[int, int]:
        """(row tiles per chunk, column tiles)."""
        return -(-chunk_rows // self.block_m), -(-n // self.block_n)


# Nominal SM counts (A100 / H100 SXM). The config choice uses these, not the runtime count, so that
# two ranks whose devices report different counts (MIG, a mixed node) still agree on the tiles.
NOMINAL_SMS = {"sm_80": 108, "sm_90": 132, "interpreter": 4}

# arch -> dtype class -> (large, medium, small-M, unaligned) tile.
# * 16-bit: fp16/bf16 through tensor cores.  sm_90: 128x256x64, 3 stages = 144 KiB of shared memory
#   (of 227); sm_80: BLOCK_K 32 keeps 3 stages of 128x256 in 72 KiB (of 164).
# * tf32: fp32 inputs with allow_tf32; ieee: exact fp32 (FMA path, small tiles).
# * unaligned: K or N not a multiple of ALIGN_ELEMS (see choose_gemm_config).
_UNALIGNED = GemmConfig(64, 64, 16, 8, 4, 3)
_TABLE: Dict[str, Dict[str, Tuple[GemmConfig, GemmConfig, GemmConfig, GemmConfig]]] = {
    "sm_90": {
        "16bit": (GemmConfig(128, 256, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 4),
                  GemmConfig(64, 128, 64, 8, 4, 4), _UNALIGNED),
        "tf32": (GemmConfig(128, 128, 32, 8, 8, 3), GemmConfig(128, 64, 32, 8, 4, 4),
                 GemmConfig(64, 64, 32, 8, 4, 4), _UNALIGNED),
        "ieee": (GemmConfig(64, 64, 32, 8, 4, 3),) * 3 + (_UNALIGNED,),
    },
    "sm_80": {
        "16bit": (GemmConfig(128, 256, 32, 8, 8, 3), GemmConfig(128, 128, 32, 8, 4, 4),
                  GemmConfig(64, 64, 32, 8, 4, 4), _UNALIGNED),
        "tf32": (GemmConfig(128, 128, 32, 8, 8, 3), GemmConfig(128, 64, 32, 8, 4, 4),
                 GemmConfig(64, 64, 32, 8, 4, 4), _UNALIGNED),
        "ieee": (GemmConfig(64, 64, 32, 8, 4, 3),) * 3 + (_UNALIGNED,),
    },
    # CPU tensors run in the Triton interpreter: big tiles mean fewer (slow) interpreted steps.
    "interpreter": {
        "16bit": (GemmConfig(64, 64, 64, 4),) * 4,
        "tf32": (GemmConfig(64, 64, 64, 4),) * 4,
        "ieee": (GemmConfig(64, 64, 64, 4),) * 4,
    },
}

SMALL_M = 64  # chunks of at most this many rows use the small-M tile
# Rows of A [M, K] and of a weight [N, K] (or of B [K, N] and C [M, N]) start 16-byte aligned, as
# far as Triton can tell, only when K (N) is a multiple of 16 elements: it then loads them as 16-byte
# cp.async vectors. Otherwise each element is loaded on its own, with its own 64-bit address kept in
# registers across the K loop, and the table's tiles reach the 255-register cap and spill (ptxas,
# sm_90a, triton 3.8: 1024 bytes at 128x256x64, 472 at 64x128x64). The unaligned tile holds few
# elements per thread (64x64x16: 118-168 registers, no spill on sm_80 / sm_90a, triton 3.6 / 3.8).
ALIGN_ELEMS = 16


def arch_of(device: torch.device) -> str:
    """The config table a device uses: "sm_90" (Hopper and newer), "sm_80" (Ampere/Ada and older
    GPUs), or "interpreter" for CPU tensors."""
    if device.type != "cuda":
        return "interpreter"
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> str:
    """``arch_of`` of cuda:``index``, asked once per device (launches ask on every call)."""
    major, _ = torch.cuda.get_device_capability(index)
    return "sm_90" if major >= 9 else "sm_80"


def dtype_class(dtype: torch.dtype, allow_tf32: bool) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        return "16bit"
    if dtype == torch.float32:
        return "tf32" if allow_tf32 else "ieee"
    raise ValueError(f"the Triton GEMM supports float16, bfloat16 and float32 inputs, got {dtype}")


def _wave_efficiency(tiles: int, sms: int) -> float:
    return tiles / (-(-tiles // sms) * sms)


def choose_gemm_config(m: int, n: int, k: int, dtype: torch.dtype, arch: str, num_chunks: int = 1,
                       allow_tf32: bool = False) -> GemmConfig:
    """The table's config for this call; deterministic in its arguments (see the module docstring).

    Rule: K or N not a multiple of ALIGN_ELEMS takes the unaligned tile; chunks of <= SMALL_M rows
    take the small tile. Otherwise the large tile, unless its last wave of tiles would leave more
    than a quarter of the (nominal) SMs idle and the medium tile fills the waves better."""
    if arch not in _TABLE:
        raise ValueError(f"no GEMM config table for arch {arch!r}; known: {sorted(_TABLE)}")
    large, medium, small, unaligned = _TABLE[arch][dtype_class(dtype, allow_tf32)]
    if k % ALIGN_ELEMS or n % ALIGN_ELEMS:
        return unaligned
    chunk_rows = -(-m // num_chunks)
    if chunk_rows <= SMALL_M:
        return small
    sms = NOMINAL_SMS[arch]

    def waves(cfg: GemmConfig) -> float:
        tm, tn = cfg.tiles(chunk_rows, n)
        return _wave_efficiency(num_chunks * tm * tn, sms)

    if waves(large) >= 0.75 or waves(medium) <= waves(large):
        return large
    return medium


def selectable_configs(arch: str, dtype: torch.dtype, allow_tf32: bool = False) -> List[GemmConfig]:
    """Every config ``choose_gemm_config`` can return for this arch and dtype (the compile check,
    benchmarks/hopper_compile.py, compiles each)."""
    return list(dict.fromkeys(_TABLE[arch][dtype_class(dtype, allow_tf32)]))


def autotune_candidates(arch: str, dtype: torch.dtype, allow_tf32: bool = False) -> List[GemmConfig]:
    """Configs ``triton.autotune`` times for the plain (non-collective) GEMM: the table's entries for
    the arch plus two common alternatives."""
    cls = dtype_class(dtype, allow_tf32)
    out = list(dict.fromkeys(_TABLE[arch][cls][:3]))  # the unaligned tile only serves unaligned K, N
    if cls == "16bit" and arch != "interpreter":
        bk = 64 if arch == "sm_90" else 32
        out += [GemmConfig(256, 128, bk, 8, 8, 3), GemmConfig(128, 128, bk, 8, 4, 3)]
    return list(dict.fromkeys(out))
