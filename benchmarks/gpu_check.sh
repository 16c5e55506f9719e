#!/usr/bin/env bash
# The one command a session with a GPU runs first (see docs/TESTBED.md):
#   build the extension -> GPU tests (1 rank) -> the fused method at world sizes 1, 2 and 4 on this
#   one GPU -> multi-rank op tests with NCCL ranks sharing the GPU -> compute-sanitizer (memcheck,
#   racecheck) on the fused kernels -> the benchmark suite (+ the all-reduce + RMSNorm suite at
#   world 2 and 4). Logs and results go to benchmarks/results/<date>_<gpu>/ (commit them) and a
#   tarball of that folder to $OUT (the device tool brings back at most 8 files from $OUT: the
#   tarball and summary.txt).
# Every step runs whatever happened before (no `set -e`), under its own time limit, and is
# recorded with its exit status and seconds in summary.txt; the script's exit status is 1 if any
# step failed.
#   bash benchmarks/gpu_check.sh                 # everything
#   STEPS="build ext fused_w1" bash benchmarks/gpu_check.sh   # only the named steps
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# Several ranks share this one GPU: torch symmetric memory must allow it (docs/TESTBED.md), and a
# device-side wait on a peer may take many time slices, so the fused kernels get a longer timeout.
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
export PYFUSED_FUSED_TIMEOUT_MS=${PYFUSED_FUSED_TIMEOUT_MS:-180000}
STEP_TIMEOUT=${STEP_TIMEOUT:-1500}  # seconds per step; the device tool allows 600 s per call, so
                                    # a call runs a few steps (STEPS=...) at a time
STEPS=${STEPS:-all}

GPU=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))" 2>/dev/null) || GPU=""
if [ -z "$GPU" ]; then
  echo "no CUDA GPU visible to torch: nothing to check" | tee "$OUT/summary.txt"; exit 1
fi
RES=benchmarks/results/$(date -u +%Y-%m-%d)_${GPU}
mkdir -p "$RES"
touch "$RES/summary.txt"
status=0

wanted() { [ "$STEPS" = all ] || [[ " $STEPS " == *" $1 "* ]]; }

step() {  # step NAME CMD...: run CMD (time-limited), log to $RES/NAME.log, record rc and seconds
  local name=$1; shift
  wanted "$name" || return 0
  local t0=$(date +%s)
  echo "== $name: $*"
  timeout --kill-after=30 "$STEP_TIMEOUT" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  [ $rc -eq 124 ] && echo "(timed out after ${STEP_TIMEOUT}s)" >> "$RES/$name.log"
  local cmd="$*"; cmd=${cmd//$'\n'/ }
  printf '%-16s rc=%-3s %5ss  %.150s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$cmd" | tee -a "$RES/summary.txt"
  tail -n 3 "$RES/$name.log"
}

{ nvidia-smi; $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())";
  $PY -m pip list 2>/dev/null | grep -iE '^(setuptools|wheel|ninja|numpy|pytest|hypothesis|transformers) ';
  git rev-parse HEAD;
  command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer || echo "no compute-sanitizer";
  } > "$RES/env.txt" 2>&1

FUSED_TESTS="tests/test_fused.py tests/test_fused_gpu.py tests/test_symmetric.py tests/test_all_reduce_add_rmsnorm.py"
step build env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" \
  $PY -m pip install --no-build-isolation --no-deps --no-index -e .
step ext $PY -c "import pyfused._C, torch; print('pyfused._C ok:', [n for n in dir(torch.ops.pyfused) if not n.startswith('_')]);
from pyfused.comm.symmetric import check_layout; check_layout();
from pyfused.ops import _fused; print('fused probe:', _fused.local_probe(), sorted(_fused.IMPLS))"
step tests_gpu $PY -m pytest -m gpu -q -ra
# The fused method, one world size per step: 1 rank in-process, then 2 and 4 NCCL ranks sharing
# this GPU (symmetric memory over one device; correct, not fast: the ranks time-slice the GPU).
step fused_w1 $PY -m pytest -m gpu -q -ra $FUSED_TESTS -k w1
step fused_w2 env PYFUSED_TEST_BACKEND=nccl $PY -m pytest -m gpu -q -ra $FUSED_TESTS -k w2
step fused_w4 env PYFUSED_TEST_BACKEND=nccl $PY -m pytest -m gpu -q -ra $FUSED_TESTS -k w4
# The op tests again with NCCL ranks (world sizes 1-4) sharing this one GPU: correctness only,
# the transport is NCCL over sockets here (tests/dist_pool.py sets a host id per rank).
step tests_nccl env PYFUSED_TEST_BACKEND=nccl $PY -m pytest -q -ra \
  tests/test_all_gather_matmul.py tests/test_matmul_reduce_scatter.py tests/test_matmul_all_reduce.py \
  tests/test_all_reduce_add_rmsnorm.py tests/test_validation.py \
  tests/test_ddp.py tests/test_ddp_sharded.py tests/test_ddp_kernels.py tests/test_clip_grad.py
# The same checks over a group with per-device backends: tensors over NCCL, the ops' input
# validation over gloo (no GPU sync; pyfused/comm/validate.py).
step tests_mixed env PYFUSED_TEST_BACKEND="cpu:gloo,cuda:nccl" $PY -m pytest -q -ra \
  tests/test_validation.py tests/test_matmul_all_reduce.py tests/test_ddp.py
# compute-sanitizer over every fused kernel (driver: benchmarks/sanitize_fused.py). memcheck: out
# of bounds / misaligned accesses, including through peers' mappings; racecheck: shared-memory
# hazards (the block reductions, the barrier's CTA syncs).
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
SAN="${SANITIZER:-compute-sanitizer} --target-processes all --error-exitcode 9 --print-limit 50"
step sanitize_mem_w1 $SAN --tool memcheck $PY benchmarks/sanitize_fused.py --world 1
step sanitize_mem_w2 $SAN --tool memcheck $PY benchmarks/sanitize_fused.py --world 2
step sanitize_race_w1 $SAN --tool racecheck $PY benchmarks/sanitize_fused.py --world 1 --iters 1
step sanitize_race_w2 $SAN --tool racecheck $PY benchmarks/sanitize_fused.py --world 2 --iters 1
step bench $PY -m pyfused.bench --out "$RES/bench"
# The op suites with 2 NCCL ranks on this one GPU: rows are labelled nccl-socket (a correctness
# transport, ~GB/s): the fused rows' baseline there is torch symmetric memory, never these.
# The speed table of docs/PERF.md: each fused op at Llama-3 70B TP=8 layer shapes (each rank's GEMM
# is a TP=8 rank's, benchmarks/shapes.py) in bf16, 2 and 4 ranks on this GPU. Every op row also
# has torch symmetric-memory rows (collective alone, GEMM-then-collective, torch's async-TP op);
# the fused rows' speedup and overlap efficiency are computed against those (same transport).
OPS3=all_gather_matmul,matmul_reduce_scatter,matmul_all_reduce
step bench_w2 $PY -m pyfused.bench --world 2 --backend nccl --suites $OPS3 --dtype bfloat16 \
  --shapes llama3-70b@tp8 --out "$RES/bench_w2"
step bench_w4 $PY -m pyfused.bench --world 4 --backend nccl --suites $OPS3 --dtype bfloat16 \
  --shapes llama3-70b@tp8 --out "$RES/bench_w4"
step bench_mlp_w2 $PY -m pyfused.bench --world 2 --backend nccl --suites tp_mlp --out "$RES/bench_mlp_w2"
step bench_arn_w2 $PY -m pyfused.bench --suites all_reduce_add_rmsnorm --world 2 --backend nccl \
  --out "$RES/bench_arn_w2"
step bench_arn_w4 $PY -m pyfused.bench --suites all_reduce_add_rmsnorm --world 4 --backend nccl \
  --out "$RES/bench_arn_w4"

tar czf "$OUT/gpu_check_results.tar.gz" "$RES"
cp "$RES/summary.txt" "$OUT/summary.txt"
echo "== results in $RES (and $OUT/gpu_check_results.tar.gz)"
cat "$RES/summary.txt"
exit $status
