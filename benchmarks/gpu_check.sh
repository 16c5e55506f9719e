#!/usr/bin/env bash
# The one command a session with a GPU runs first (see docs/TESTBED.md):
#   build the extension -> GPU tests (1 rank) -> multi-rank op tests with NCCL ranks sharing the
#   GPU -> the benchmark suite. Logs and results go to benchmarks/results/<date>_<gpu>/ (commit
#   them) and a tarball of that folder to $OUT (the device tool brings $OUT back).
# Usage on the device: bash benchmarks/gpu_check.sh        (exit status 1 if any step failed)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

GPU=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))") || {
  echo "no CUDA GPU visible to torch: nothing to check"; exit 1; }
RES=benchmarks/results/$(date -u +%Y-%m-%d)_${GPU}
mkdir -p "$RES"
: > "$RES/summary.txt"
status=0

step() {  # step NAME CMD...: run CMD, log to $RES/NAME.log, record rc and seconds
  local name=$1; shift
  local t0=$(date +%s)
  echo "== $name: $*"
  "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  printf '%-12s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$*" | tee -a "$RES/summary.txt"
  tail -n 3 "$RES/$name.log"
}

{ nvidia-smi; $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"; git rev-parse HEAD; } > "$RES/env.txt" 2>&1

step build env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" \
  $PY -m pip install --no-build-isolation --no-deps --no-index -e .
step ext $PY -c "import pyfused._C, torch; print('pyfused._C ok:', [n for n in dir(torch.ops.pyfused) if not n.startswith('_')])"
step tests_gpu $PY -m pytest -m gpu -q -ra
# The op tests again with NCCL ranks (world sizes 1-4) sharing this one GPU: correctness only,
# the transport is NCCL over sockets here (tests/dist_pool.py sets a host id per rank).
step tests_nccl env PYFUSED_TEST_BACKEND=nccl $PY -m pytest -q -ra \
  tests/test_all_gather_matmul.py tests/test_matmul_reduce_scatter.py tests/test_matmul_all_reduce.py \
  tests/test_validation.py
step bench $PY -m pyfused.bench --out "$RES/bench"

tar czf "$OUT/gpu_check_results.tar.gz" "$RES"
cp "$RES/summary.txt" "$OUT/summary.txt"
echo "== results in $RES (and $OUT/gpu_check_results.tar.gz)"
cat "$RES/summary.txt"
exit $status
