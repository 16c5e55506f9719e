"""Every Triton kernel of pyfused compiled for Hopper (sm_90a) without a GPU: registers, spills and
shared memory per variant (ptxas -v of the triton wheel), and the PTX facts the kernels rely on.

    python -m benchmarks.hopper_compile                               # print the table
    python -m benchmarks.hopper_compile --doc docs/PERF_kernels.md    # rewrite this triton's table there
    python -m benchmarks.hopper_compile --json out.json               # one record per variant

Run without TRITON_INTERPRET (the kernels are decorated for compilation only when it is unset).
tests/test_hopper_compile.py runs it in CI and fails on any compile error, spill or uncovered config.

How. Triton's active driver is swapped for one that reports a device of the target's capability, so
nothing needs CUDA. Each variant (benchmarks/hopper_variants.py) calls its real launcher
(``pyfused.kernels.gemm_launch.gemm``, ``pyfused.kernels.reduce_launch.multi_source_reduce``,
``pyfused.dp.bucket_copy.flatten_scale`` / ``unflatten_scale``,
``pyfused.kernels.grouped_gemm_launch.grouped_gemm``) on CPU tensors, with the kernel
replaced by a recorder; the recorded launch is then compiled with ``kernel.warmup(*args, **kwargs)``.
The specializations compiled are therefore exactly the launcher's: its config choice (the chooser
asked for the target's arch), its constexpr flags, and Triton's own specialization of the integer and
pointer arguments (values of 1, divisibility by 16). A GPU launch differs in two points only, set here
as a GPU launch sets them: the launchers' backend check (which refuses CPU tensors outside the
interpreter) is skipped, and WALL_CLOCK (the timed spin) is True. The ahead-of-time ``ASTSource``
compile this replaces had to restate the signature, the divisibility hints and the flags by hand,
and compiled whatever it restated.

Cost: about 1-2 s of CPU per variant on first compile (triton) plus the ptxas -v run; both are
cached (Triton's cache, and ptxas's verdict keyed by the PTX in ``<triton cache>/pyfused_ptxas``), and
variants compile in ``--jobs`` processes (default: up to 2, the CI machine's cores).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import List
from unittest import mock

from benchmarks import hopper_variants as hv

REGISTER_CAP = 255  # registers a thread may use (sm_80, sm_90), below 65536 / threads of a block


def register_cap(num_warps: int) -> int:
    """The most registers a thread of a ``num_warps`` program can have: one block must fit the
    65536 registers of an SM (16 warps: 128, 32 warps: 64)."""
    return min(REGISTER_CAP, 65536 // (32 * num_warps))
SHARED_LIMIT = {80: 166912, 90: 232448}  # bytes of shared memory a block may use (A100, H100)


class TargetDriver:
    """Triton's active driver while compiling for sm_<cc> on a machine without a GPU.

    The device id is the capability itself: Triton caches a kernel's binder (and the target in it)
    per device id, so two targets compiled in one process must not share an id."""

    def __init__(self, cc: int):
        self.cc = cc

    def get_current_device(self) -> int:
        return self.cc

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.cc, 32)


@contextlib.contextmanager
def target_driver(cc: int):
    from triton.runtime.driver import driver

    previous = driver._active  # None until something asked for the default (CUDA) driver
    driver.set_active(TargetDriver(cc))
    try:
        yield
    finally:
        driver.set_active(previous)


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.kernel, grid, args, kwargs))
        return launch


@contextlib.contextmanager
def recorded_launches(cc: int):
    """Inside: the launchers record their kernel launches (into the yielded list) instead of running
    them, accept CPU tensors, and choose configs for sm_<cc>."""
    import pyfused.kernels.bucket as kbucket
    import pyfused.kernels.gemm as kgemm
    import pyfused.kernels.gemm_configs as kconfigs
    import pyfused.kernels.gemm_launch as gemm_launch
    import pyfused.kernels.grouped_gemm as kgrouped
    import pyfused.kernels.grouped_gemm_launch as grouped_launch
    import pyfused.kernels.reduce as kreduce
    import pyfused.kernels.reduce_launch as reduce_launch

    launches: list = []
    with contextlib.ExitStack() as stack:
        for module, name in ((kgemm, "persistent_gemm_kernel"), (kreduce, "multi_source_reduce_kernel"),
                             (kbucket, "segment_copy_scale_kernel"),
                             (kgrouped, "grouped_gemm_kernel")):
            recorder = _Recorder(getattr(module, name), launches)
            stack.enter_context(mock.patch.object(module, name, recorder))
        for module in (gemm_launch, reduce_launch, grouped_launch):
            stack.enter_context(mock.patch.object(module, "check_backend", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(kconfigs, "arch_of", lambda device: hv.ARCH[cc]))
        yield launches


def compile_variant(v: hv.Variant):
    """The launcher's launch of ``v``, compiled for sm_<v.cc>: the CompiledKernel."""
    with recorded_launches(v.cc) as launches:
        hv.LAUNCH[v.kernel](v)
    if len(launches) != 1:
        raise RuntimeError(f"{v.name}: the launcher made {len(launches)} launches, expected 1")
    kernel, grid, args, kwargs = launches[0]
    if "WALL_CLOCK" in kwargs:
        kwargs = dict(kwargs, WALL_CLOCK=True)  # as on a GPU (the launcher sets it by device type)
    with target_driver(v.cc):
        return kernel.warmup(*args, grid=grid, **kwargs)


def ptxas_verbose(ptx: str, cc: int) -> str:
    """``ptxas -v`` of the triton wheel on ``ptx``: its report (stderr), cached by PTX and ptxas."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    gpu = f"sm_{cc}{'a' if cc >= 90 else ''}"
    key = hashlib.sha256(f"{ptxas.stat().st_size}:{gpu}:{ptx}".encode()).hexdigest()
    cache = Path(triton.knobs.cache.dir) / "pyfused_ptxas"
    hit = cache / f"{key}.txt"
    if hit.exists():
        return hit.read_text()
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / f"{key}.{os.getpid()}.ptx"
    src.write_text(ptx)
    try:
        proc = subprocess.run([str(ptxas), "-v", f"--gpu-name={gpu}", str(src), "-o", os.devnull],
                              capture_output=True, text=True)
    finally:
        src.unlink()
    report = f"rc={proc.returncode}\n{proc.stderr}"
    if proc.returncode == 0:
        tmp = hit.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(report)
        os.replace(tmp, hit)
    return report


def _ints(pattern: str, text: str) -> int:
    return max([int(x) for x in re.findall(pattern, text)] or [0])


def summarize(v: hv.Variant, compiled) -> dict:
    """Registers, spills, shared memory, and the instructions the kernels' docstrings rely on."""
    ptx = compiled.asm["ptx"]
    report = ptxas_verbose(ptx, v.cc)
    ops = re.findall(r"\b((?:ld|st|atom|cp\.async|wgmma\.mma_async|mma\.sync)[\w.:]*)", ptx)
    vector16 = r"\.global[\w.]*\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b"
    return dict(
        ptxas_rc=_ints(r"rc=(-?\d+)", report), ptxas_error="" if "rc=0" in report else report[-2000:],
        registers=_ints(r"Used (\d+) registers", report),
        spill_stores=_ints(r"(\d+) bytes spill stores", report),
        spill_loads=_ints(r"(\d+) bytes spill loads", report),
        stack=_ints(r"(\d+) bytes stack frame", report),
        shared=compiled.metadata.shared,  # Triton's dynamic shared memory (ptxas sees only static)
        num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages,
        ops=sorted(set(ops)), globaltimer="%globaltimer" in ptx,
        cp_async_16B=len(re.findall(r"cp\.async\.cg\.shared\.global \[[^\]]*\], \[[^\]]*\], 0x10", ptx)),
        ld_16B=len(re.findall(r"\bld" + vector16, ptx)), st_16B=len(re.findall(r"\bst" + vector16, ptx)),
    )


def run_variant(v: hv.Variant) -> dict:
    """One variant's record: the variant, its config, and its summary or its compile error."""
    import triton

    record = dict(asdict(v), name=v.name, triton=triton.__version__, error="")
    try:
        cfg = hv.config_of(v)
        record["config"] = hv.config_str(cfg)
        record.update(summarize(v, compile_variant(v)))
    except Exception as e:  # noqa: BLE001 -- a compile error is a result (the test reports it)
        record["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    return record


def run_all(variants: List[hv.Variant], jobs: int) -> List[dict]:
    if jobs <= 1:
        return [run_variant(v) for v in variants]
    # fork: the workers inherit the imported modules; nothing has been compiled in this process
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(run_variant, variants, chunksize=1))


# ---------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------

def ptxas_version() -> str:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    out = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True).stdout
    return (re.findall(r"release [\d.]+, V[\d.]+", out) or ["?"])[0]


def table(records: List[dict]) -> str:
    rows = ["| variant | config | warps | stages | registers | spill stores (B) | shared (B) |",
            "|---|---|---|---|---|---|---|"]
    for r in records:
        if r["error"]:
            rows.append(f"| {r['name']} | {r.get('config', '?')} | | | compile error | | |")
            continue
        at_cap = r["registers"] >= register_cap(r["num_warps"])
        regs = f"**{r['registers']} (cap)**" if at_cap else str(r["registers"])
        spill = f"**{r['spill_stores']}**" if r["spill_stores"] else "0"
        rows.append(f"| {r['name']} | {r['config']} | {r['num_warps']} | {r['num_stages']} | {regs} "
                    f"| {spill} | {r['shared']} |")
    return "\n".join(rows)


def doc_block(records: List[dict]) -> str:
    import triton

    failed = [r for r in records if r["error"] or r["spill_stores"] or r["ptxas_rc"]]
    at_cap = [r for r in records if not r["error"] and r["registers"] >= register_cap(r["num_warps"])]
    head = (f"triton {triton.__version__}, ptxas {ptxas_version()}: {len(records)} variants, "
            f"{len(failed)} with a compile error or spills, {len(at_cap)} at the register cap.")
    version = triton.__version__
    return f"{BEGIN.format(version)}\n{head}\n\n{table(records)}\n{END.format(version)}"


BEGIN = ("<!-- hopper-compile table, triton {}: generated by "
         "`python -m benchmarks.hopper_compile --doc docs/PERF_kernels.md`; do not edit by hand -->")
END = "<!-- end of hopper-compile table, triton {} -->"
TABLES_END = "<!-- end of hopper-compile tables -->"


def update_doc(path: Path, records: List[dict]) -> None:
    """Replace this triton version's table in ``path`` (or add it before TABLES_END)."""
    import triton

    text, block = path.read_text(), doc_block(records)
    begin, end = BEGIN.format(triton.__version__), END.format(triton.__version__)
    if begin in text:
        start, stop = text.index(begin), text.index(end) + len(end)
        text = text[:start] + block + text[stop:]
    elif TABLES_END in text:
        text = text.replace(TABLES_END, f"{block}\n\n{TABLES_END}")
    else:
        raise SystemExit(f"{path} has neither this triton's table nor the line {TABLES_END!r}")
    path.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, help="rewrite this triton version's table in this file")
    parser.add_argument("--json", type=Path, help="write one record per variant to this file")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--only", default="", help="compile only variants whose name contains this")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    variants = [v for v in hv.all_variants() if args.only in v.name]
    records = run_all(variants, args.jobs)
    if args.json:
        args.json.write_text(json.dumps(records))
    if args.doc:
        update_doc(args.doc, records)
    print(doc_block(records))
    return 1 if any(r["error"] or r["spill_stores"] or r["ptxas_rc"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
