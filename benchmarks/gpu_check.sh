#!/usr/bin/env bash
# What a machine with a GPU runs: three self-contained device calls (docs/TESTBED.md has the exact
# device-tool invocations). A fresh, bare machine per call, at most 10 minutes a call, 30 minutes in
# all: so call 1 builds pyfused._C once and warms the Triton cache, and returns both through $OUT;
# calls 2 and 3 carry them in (.gpu_carry/) and install in seconds with no rebuild.
#
#   bash benchmarks/gpu_check.sh --call 1    # build, single-rank GPU tests, warm the Triton cache
#   bash benchmarks/gpu_check.sh --call 2    # virtual ranks (tests, sanitizer), the symm-mem smoke
#   bash benchmarks/gpu_check.sh --call 3    # benchmarks: virtual ranks, single-GPU kernels
#   bash benchmarks/gpu_check.sh --dry-run [--call N]   # print the plan; checks the limits; no GPU
#
# Every step runs under its own `timeout` (at most STEP_MAX s; a call's steps sum to at most
# CALL_MAX s, under the tool's 600 s), whatever happened before it (no `set -e`), and after every
# step -- and on exit, by a trap -- the logs, summary.txt and the results tarball are copied to
# $OUT, so a call killed at its limit still returns everything that ran. The exit status is 1 if
# any step failed. The sanitizer steps run one process per rank, not virtual ranks: a sanitizer
# may serialize a process's kernel launches, and virtual ranks' kernels wait on each other. Results: benchmarks/results/<date>_<gpu>/call<N>/ (commit them; GPU_CHECK_RESULTS
# names another root).
set -uo pipefail
cd "$(dirname "$0")/.."

STEP_MAX=240      # seconds, any one step
CALL_MAX=480      # seconds, the sum of a call's step limits (8 minutes)
MAX_FILES=8       # files the device tool returns from $OUT
CARRY=.gpu_carry  # what calls 2 and 3 carry in (ignored by git): the .so and the Triton cache
SO_GLOB="_C.cpython-*.so"
PY=${PYTHON:-python3}
PYTEST="$PY -m pytest -q -ra -x -p no:cacheprovider --timeout=120"

# --- the plan: per call, "name limit_s command" (a command is one bash -c string) -----------------
call_steps() {
  case $1 in
  1) cat <<'EOF'
env         15  gpu_env
build       210 gpu_build
ext         15  $PY -c "import pyfused._C, torch; from pyfused.comm.symmetric import check_layout; check_layout(); print('ops:', sorted(n for n in dir(torch.ops.pyfused) if not n.startswith('_')))"
tests_1rank 150 $PYTEST -m gpu tests/test_gemm.py tests/test_reduce.py tests/test_extension.py tests/test_fused_gpu.py -k "not w2 and not w4"
warm        75  $PY benchmarks/bench_virtual_ranks.py --warm
pack        15  gpu_pack_cache
EOF
  ;;
  2) cat <<'EOF'
install     45  gpu_install
env         15  gpu_env
virtual     210 $PYTEST -m gpu tests/test_virtual_ranks.py
symm_probe  40  set -o pipefail; $PY benchmarks/probe_symm_mem.py | tee -a $RES/env.txt
memcheck_w1 40  $SANITIZER --tool memcheck $PY benchmarks/sanitize_fused.py --world 1 --iters 1
memcheck_w2 60  $SANITIZER --tool memcheck $PY benchmarks/sanitize_fused.py --world 2 --iters 1
symm_w2     60  PYFUSED_TEST_BACKEND=nccl $PYTEST -m gpu tests/test_symmetric.py -k w2
EOF
  ;;
  3) cat <<'EOF'
install     45  gpu_install
env         15  gpu_env
bench_vr    240 $PY -m pyfused.bench --suites virtual_ranks --dtype bfloat16 --out $RES/bench_virtual_ranks
bench_1gpu  120 $PY -m pyfused.bench --suites gemm,reduce --out $RES/bench_1gpu
racecheck   60  $SANITIZER --tool racecheck $PY benchmarks/sanitize_fused.py --world 1 --iters 1
EOF
  ;;
  esac
}

call_returns() {  # the files a call leaves under $OUT (the device tool returns at most 8)
  case $1 in
  1) echo "summary.txt env.txt results.tar.gz $SO_GLOB triton_cache.tar.gz" ;;
  *) echo "summary.txt env.txt results.tar.gz" ;;
  esac
}

call_purpose() {
  case $1 in
  1) echo "build pyfused._C (PYFUSED_REQUIRE_EXT=1, sm_90a), single-rank GPU tests, warm the Triton cache" ;;
  2) echo "virtual ranks at W=2/4/8 (correctness, adversarial modes), memcheck, the symm-mem exchange smoke" ;;
  3) echo "benchmarks: each fused op at W=2/4/8 vs its unfused composition; the single-GPU kernels; racecheck" ;;
  esac
}

dry_run() {  # print the plan of the given calls; exit 1 if a limit is broken
  local bad=0 call name limit cmd total files
  for call in "$@"; do
    total=0
    echo "call $call: $(call_purpose "$call")"
    while read -r name limit cmd; do
      [ -n "$name" ] || continue
      printf '  %-12s %4ss  %s\n' "$name" "$limit" "$cmd"
      total=$((total + limit))
      if [ "$limit" -gt "$STEP_MAX" ]; then echo "  ERROR: step $name's limit $limit s > $STEP_MAX s"; bad=1; fi
    done < <(call_steps "$call")
    files=$(call_returns "$call" | wc -w)
    echo "  total ${total}s of ${CALL_MAX}s; returns ${files} files: $(call_returns "$call")"
    if [ "$total" -gt "$CALL_MAX" ]; then echo "  ERROR: call $call's steps sum to $total s > $CALL_MAX s"; bad=1; fi
    if [ "$files" -gt "$MAX_FILES" ]; then echo "  ERROR: call $call returns $files files > $MAX_FILES"; bad=1; fi
  done
  return $bad
}

# --- arguments -------------------------------------------------------------------------------------
CALL="" DRY=0
while [ $# -gt 0 ]; do
  case $1 in
    --call) CALL=${2:-}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    *) echo "usage: $0 --call 1|2|3 [--dry-run] | --dry-run" >&2; exit 2 ;;
  esac
done
if [ "$DRY" = 1 ]; then
  if [ -n "$CALL" ]; then dry_run "$CALL"; else dry_run 1 2 3; fi
  exit $?
fi
case $CALL in 1|2|3) ;; *) echo "usage: $0 --call 1|2|3 [--dry-run] | --dry-run" >&2; exit 2 ;; esac

# --- the environment every step sees -----------------------------------------------------------------
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The fused kernels' waits give up after 30 s of wall-clock time; torch.distributed's groups wait
# longer (tests/dist_pool.py: 90 s), so a lost flag is reported by the kernel (rank, peer, flag).
export PYFUSED_FUSED_TIMEOUT_MS=${PYFUSED_FUSED_TIMEOUT_MS:-30000}
# torch symmetric memory, for the multi-process smoke only: the CUDA backend (NVSHMEM cannot host
# several ranks on one GPU), and several ranks per device allowed. env.txt records what took.
export TORCH_SYMMMEM=CUDA TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
# The Triton cache travels from call 1 to calls 2 and 3: binaries and metadata only (no IRs), so its
# tarball stays under what a returned file may hold. Its index holds absolute paths: a call whose
# checkout sits elsewhere recompiles (slower, still correct).
export TRITON_CACHE_DIR=$PWD/$CARRY/triton_cache TRITON_STORE_BINARY_ONLY=1
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
SANITIZER="${SANITIZER:-compute-sanitizer} --target-processes all --error-exitcode 9 --print-limit 50"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr ' ' '-')
RES=${GPU_CHECK_RESULTS:-benchmarks/results}/$(date -u +%Y-%m-%d)_${GPU:-no-gpu}/call$CALL
mkdir -p "$RES"
: > "$RES/summary.txt"
export PY PYTEST SANITIZER RES OUT CARRY SO_GLOB
status=0

# --- step bodies (functions run by name, in a child bash) ---------------------------------------------
gpu_env() {  # first-10-second facts
  { date -u; git rev-parse HEAD 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.total,clocks.max.sm --format=csv
    $PY - <<'PYEOF'
import os
def fact(name, get):  # one line per fact; a failing probe is a fact too
    try:
        print(f"{name}: {get()}")
    except Exception as e:
        print(f"{name}: unknown ({type(e).__name__}: {e})")
import torch, triton, numpy
fact("versions", lambda: f"torch {torch.__version__} cuda {torch.version.cuda} triton {triton.__version__} "
     f"numpy {numpy.__version__} nccl {torch.cuda.nccl.version()}")
fact("device", lambda: (lambda p: f"{p.name}, {p.multi_processor_count} SMs, cc {p.major}.{p.minor}")(
     torch.cuda.get_device_properties(0)))
from torch.distributed import _symmetric_memory as sm
fact("TORCH_SYMMMEM", lambda: os.environ.get("TORCH_SYMMMEM"))
fact("symmetric-memory backend for cuda:0 (torch's get_backend)", lambda: sm.get_backend("cuda:0"))
fact("NVSHMEM available", lambda: sm.is_nvshmem_available())
lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
fact("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", lambda: f"{os.environ.get('TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES')}"
     f" (named in libtorch_cuda: {b'TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES' in open(lib, 'rb').read()}; "
     f"honoured: see the symm-mem probe line, call 2 step symm_probe)")
PYEOF
    command -v compute-sanitizer || echo "compute-sanitizer: $SANITIZER"
  } > "$RES/env.txt" 2>&1
  cat "$RES/env.txt"
}

gpu_build() {  # a build that skips the extension fails (PYFUSED_REQUIRE_EXT=1)
  mkdir -p "$CARRY"
  PYFUSED_REQUIRE_EXT=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=${MAX_JOBS:-16} \
    $PY -m pip install --no-build-isolation --no-deps --no-index -e . || return 1
  local so; so=$(ls pyfused/$SO_GLOB) || return 1
  ls -l "$so"
  cp "$so" "$OUT/"
}

gpu_pack_cache() {  # the Triton cache, for calls 2 and 3 (a returned file may have 16 MiB)
  tar czf "$OUT/triton_cache.tar.gz" -C "$CARRY" triton_cache || return 1
  local bytes; bytes=$(stat -c %s "$OUT/triton_cache.tar.gz")
  echo "triton_cache.tar.gz: $bytes bytes"
  [ "$bytes" -lt $((15 << 20)) ] || { echo "over 15 MiB: it would not come back"; return 1; }
}

gpu_install() {  # the carried extension and cache; pip only maps the package (no CUDA build)
  local so; so=$(ls $CARRY/$SO_GLOB 2>/dev/null | head -n 1)
  [ -n "$so" ] || { echo "no $CARRY/$SO_GLOB: copy call 1's returned files into $CARRY/"; return 1; }
  cp "$so" pyfused/
  [ ! -f "$CARRY/triton_cache.tar.gz" ] || tar xzf "$CARRY/triton_cache.tar.gz" -C "$CARRY"
  PYFUSED_SKIP_CUDA_BUILD=1 $PY -m pip install --no-build-isolation --no-deps --no-index -e . -q || return 1
  $PY -c "import pyfused._C; from pyfused.comm.symmetric import check_layout; check_layout(); print('pyfused._C ok')"
  echo "triton cache entries: $(ls "$TRITON_CACHE_DIR" 2>/dev/null | wc -l)"
}
export -f gpu_env gpu_build gpu_pack_cache gpu_install

collect() {  # logs, summary and the results tarball to $OUT (after every step and on exit)
  cp "$RES/summary.txt" "$OUT/summary.txt" 2>/dev/null
  cp "$RES/env.txt" "$OUT/env.txt" 2>/dev/null
  tar czf "$OUT/results.tar.gz.part" "$RES" 2>/dev/null && mv "$OUT/results.tar.gz.part" "$OUT/results.tar.gz"
}
trap 'echo "exit: collecting"; collect' EXIT
trap 'exit 143' TERM INT  # the EXIT trap then still collects

run_step() {  # run_step NAME LIMIT CMD: time-limited, logged, recorded, collected
  local name=$1 limit=$2 cmd=$3 t0 rc
  t0=$(date +%s)
  echo "== $name (limit ${limit}s): $cmd"
  timeout --kill-after=10 "$limit" bash -c "$cmd" < /dev/null > "$RES/$name.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "(timed out after ${limit}s)" >> "$RES/$name.log"
  printf '%-12s rc=%-3s %4ss of %4ss  %.150s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" "$cmd" \
    | tee -a "$RES/summary.txt"
  tail -n 5 "$RES/$name.log"
  collect
}

echo "call $CALL: $(call_purpose "$CALL")" | tee -a "$RES/summary.txt"
while read -r name limit cmd; do
  [ -n "$name" ] && run_step "$name" "$limit" "$cmd"
done < <(call_steps "$CALL")
cat "$RES/summary.txt"
exit $status
