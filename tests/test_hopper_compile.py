"""Every Triton kernel compiled for Hopper (sm_90a) without a GPU, as its launcher launches it:
benchmarks/hopper_compile.py over the variants of benchmarks/hopper_variants.py (every config the
launchers can pick, the dtypes, hidden sizes and odd shapes the ops accept), with this machine's
triton and the ptxas of its wheel.

Fails on a compile or ptxas error, a register spill, shared memory past the device's limit, a config
a chooser can return that no variant compiles, and PTX without what the kernels rely on: 16-byte
vector accesses where the data is aligned, tensor cores, the acquire / release flag instructions and
the wall-clock bound of the waits. A register count at the cap is reported (a warning here, bold in
docs/PERF_kernels.md's table), not failed.

Cost: about 80 variants at 1-2 s of CPU each on a first run, in 2 processes (about a minute on the
2-core CI machine); Triton's cache and the ptxas cache make a repeated run take seconds.
"""
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from benchmarks import hopper_compile as hc, hopper_variants as hv

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "PERF_kernels.md"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """One record per variant, compiled in a fresh interpreter without TRITON_INTERPRET (the kernels
    are decorated for compilation only when it is unset)."""
    out = tmp_path_factory.mktemp("hopper") / "records.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.hopper_compile", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert out.exists(), f"the check did not run (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _failures(records, bad):
    return "\n".join(f"  {r['name']} [{r.get('config', '?')}]: {bad(r)}" for r in records if bad(r))


def test_every_variant_compiles_without_spills(records):
    def bad(r):
        if r["error"]:
            return r["error"].splitlines()[0]
        if r["ptxas_rc"]:
            return f"ptxas failed: {r['ptxas_error'][-300:]}"
        if r["spill_stores"]:
            return f"{r['spill_stores']} bytes of spill stores at {r['registers']} registers"
        if r["shared"] > hc.SHARED_LIMIT[r["cc"]]:
            return f"{r['shared']} bytes of shared memory"
        return ""

    assert not _failures(records, bad), "variants that fail on Hopper:\n" + _failures(records, bad)


def test_registers_are_read_and_the_cap_is_reported(records):
    """Every record has ptxas's register count (so the spill check above read a real report); those
    at the cap are reported."""
    compiled = [r for r in records if not r["error"]]
    assert compiled and all(r["registers"] > 0 for r in compiled), [r["name"] for r in compiled
                                                                     if r["registers"] <= 0]
    at_cap = [f"{r['name']}: {r['registers']}" for r in compiled
              if r["registers"] >= hc.register_cap(r["num_warps"])]
    if at_cap:
        warnings.warn("variants at the register cap: " + "; ".join(at_cap))
    assert "(cap)" in hc.table([dict(compiled[0], registers=hc.REGISTER_CAP)])
    assert (hc.register_cap(4), hc.register_cap(8), hc.register_cap(32)) == (255, 255, 64)


def test_every_config_a_chooser_can_return_is_compiled():
    assert hv.uncovered_configs(hv.all_variants()) == {}


def test_gemm_chooser_returns_only_selectable_configs():
    """``selectable_configs`` (what the compile check covers) holds every config the chooser returns."""
    from pyfused.kernels.gemm_configs import choose_gemm_config, selectable_configs

    for arch in ("sm_90", "sm_80"):
        for dtype, tf32 in ((torch.bfloat16, False), (torch.float32, True), (torch.float32, False)):
            allowed = selectable_configs(arch, dtype, tf32)
            for m in (1, 64, 97, 512, 2048, 4096, 8192, 16384):
                for n, k in ((1280, 8192), (8192, 1024), (7168, 8192), (8192, 3584), (1025, 259),
                             (4096, 4100), (4104, 4096)):
                    for chunks in (1, 8):
                        if m >= chunks:
                            assert choose_gemm_config(m, n, k, dtype, arch, chunks, tf32) in allowed


def _aligned(r):
    return all(x % 16 == 0 for x in r["shape"][:3])


def test_gemm_instructions(records):
    """Aligned operands load as 16-byte cp.async; 16-bit inputs use tensor cores (wgmma on sm_90a,
    mma.sync on sm_80); a waiting call has the acquire load of its flag, bounded by the wall clock,
    a signalling one the release add of its counter, and no call has what it does not ask for."""
    gemm = [r for r in records if r["kernel"] == "gemm" and not r["error"]]
    assert gemm
    for r in gemm:
        what = f"{r['name']}: {r['ops']}"
        if _aligned(r):
            assert r["cp_async_16B"] > 0, f"{what}: loads not vectorized"
        if r["dtype"] in ("bf16", "fp16"):
            mma = "wgmma.mma_async" if r["cc"] == 90 else "mma.sync"
            assert any(op.startswith(mma) for op in r["ops"]), f"{what}: no {mma}"
        wait = r["call"] in ("all", "all-gather")
        signal = {"all": "gpu", "reduce-scatter": "sys"}.get(r["call"])
        acquire = any(re.match(r"(ld|atom)\.global\.sys\.acquire", op) for op in r["ops"])
        releases = {m.group(1) for op in r["ops"]
                    if (m := re.match(r"atom\.global\.(\w+)\.release\.add", op))}
        assert acquire == wait and r["globaltimer"] == wait, what
        assert releases == ({signal} if signal else set()), what


def test_reduce_instructions(records):
    """Aligned sources load as 16-byte vectors; waits are acquire loads bounded by the wall clock."""
    reduce = [r for r in records if r["kernel"] == "reduce" and not r["error"]]
    assert reduce
    for r in reduce:
        what = f"{r['name']}: {r['ops']}"
        if r["shape"][1] % 16 == 0:
            assert r["ld_16B"] > 0, f"{what}: loads not vectorized"
        wait = r["call"] in ("rmsnorm", "reduce-scatter")
        acquire = any(re.match(r"(ld|atom)\.global\.sys\.acquire", op) for op in r["ops"])
        assert acquire == wait and r["globaltimer"] == wait, what


def test_grouped_instructions(records):
    """The grouped GEMM: aligned operands load as 16-byte cp.async, 16-bit inputs use wgmma; the
    dispatch call acquire-waits on its flags, bounded by the wall clock; the combine call counts
    tiles with an acq_rel add and sets each chunk's word with a release exchange, at system scope,
    and does not wait."""
    grouped = [r for r in records if r["kernel"] == "grouped" and not r["error"]]
    assert {r["call"] for r in grouped} == set(hv.GROUPED_CALLS)
    for r in grouped:
        what = f"{r['name']}: {r['ops']}"
        if all(x % 16 == 0 for x in r["shape"]):
            assert r["cp_async_16B"] > 0, f"{what}: loads not vectorized"
        if r["dtype"] in ("bf16", "fp16"):
            assert any(op.startswith("wgmma.mma_async") for op in r["ops"]), f"{what}: no wgmma"
        wait = r["call"] == "dispatch"
        acquire = any(re.match(r"(ld|atom)\.global\.sys\.acquire", op) for op in r["ops"])
        signals = {op for op in r["ops"] if re.match(r"atom\.global\.\w+\.(acq_rel|release)\.", op)}
        assert acquire == wait and r["globaltimer"] == wait, what
        assert signals == (set() if wait else {"atom.global.sys.acq_rel.add.u32",
                                               "atom.global.sys.release.exch.b32"}), what


def test_bucket_copy_uses_16_byte_vectors(records):
    """Segments of 16-element multiples at aligned addresses copy with 16-byte loads and stores, in
    every dtype pair; odd segments compile to the element-wise form."""
    bucket = [r for r in records if r["kernel"] == "bucket" and not r["error"]]
    assert {r["dtype"] for r in bucket} >= {f"{s}>{d}" for s, d in hv.BUCKET_DTYPES}
    for r in bucket:
        vectors = r["ld_16B"] > 0 and r["st_16B"] > 0
        aligned = r["shape"] == list(hv.ALIGNED_SEGMENTS)
        assert vectors == aligned, f"{r['name']}: {r['ld_16B']} 16-byte loads, {r['st_16B']} stores"


def test_doc_table_lists_every_variant(records):
    """docs/PERF_kernels.md holds the generated table of this triton version, one row per variant
    (regenerate it with the command written there)."""
    import triton

    text = DOC.read_text()
    begin = hc.BEGIN.format(triton.__version__)
    if begin not in text:
        pytest.skip(f"no table for triton {triton.__version__} in {DOC.name}")
    block = text[text.index(begin):text.index(hc.END.format(triton.__version__))]
    names = re.findall(r"^\| ((?:gemm|reduce|bucket|grouped) [^|]*?) \|", block, re.M)
    assert names == [r["name"] for r in records], \
        "regenerate it: python -m benchmarks.hopper_compile --doc docs/PERF_kernels.md"


# ---------------------------------------------------------------------------------------------------
# The bucket copy's alignment claim (on CPU: the launch is recorded, or run in the interpreter)
# ---------------------------------------------------------------------------------------------------

def _recorded_align(srcs, flat):
    from pyfused.dp.bucket_copy import CopyPlan, flatten_scale

    plan = CopyPlan([s.numel() for s in srcs], torch.device("cpu"),
                    max(srcs[0].element_size(), flat.element_size()), interpret=False)
    with hc.recorded_launches(90) as launches:
        flatten_scale(srcs, flat, 0.5, plan)
    (_, _, _, kwargs), = launches
    return kwargs["ALIGN"]


def test_bucket_copy_claims_alignment_only_when_it_holds():
    """ALIGN (16-byte vectors) needs every address aligned and every segment a multiple of 16 bytes
    of the narrower dtype; anything else takes the element-wise form."""
    f32, bf16 = torch.float32, torch.bfloat16
    assert _recorded_align([torch.empty(64, dtype=f32), torch.empty(32, dtype=f32)],
                           torch.empty(96, dtype=bf16)) == 8
    assert _recorded_align([torch.empty(64, dtype=f32)], torch.empty(64, dtype=f32)) == 4
    f64 = torch.float64
    assert _recorded_align([torch.empty(8, dtype=f64)], torch.empty(8, dtype=f64)) == 2
    # a length of 4 fp32 is 16 bytes, but only 8 of bf16: not a whole vector on the bf16 side
    assert _recorded_align([torch.empty(4, dtype=f32)], torch.empty(4, dtype=bf16)) == 1
    assert _recorded_align([torch.empty(97, dtype=f32)], torch.empty(97, dtype=f32)) == 1
    shifted = torch.empty(65, dtype=f32)[1:]  # 4 bytes past an aligned address
    assert _recorded_align([shifted], torch.empty(64, dtype=f32)) == 1
    assert _recorded_align([torch.empty(64, dtype=f32)], torch.empty(65, dtype=f32)[1:]) == 1


@pytest.mark.interpreter
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "shifted"])
def test_bucket_copy_vector_and_scalar_forms_match_reference(offset):
    """Both forms of the kernel (ALIGN 8 and 1) against the torch reference, in the interpreter."""
    from pyfused.dp.bucket_copy import CopyPlan, flatten_scale, flatten_scale_ref

    g = torch.Generator().manual_seed(5)
    sizes = (4096, 48, 1024 * 5)
    srcs = [torch.randn(n + offset, generator=g)[offset:] for n in sizes]
    plan = CopyPlan(list(sizes), torch.device("cpu"), 4, interpret=True)
    flat = torch.zeros(sum(sizes), dtype=torch.bfloat16)
    ref = flat.clone()
    flatten_scale(srcs, flat, 0.25, plan)
    flatten_scale_ref(srcs, ref, 0.25)
    # the interpreter truncates fp32 -> bf16 where torch rounds to nearest: one unit in the last place
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs()
    assert ((flat.float() - ref.float()).abs() <= ulp).all()
