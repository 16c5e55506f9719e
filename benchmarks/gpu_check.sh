#!/usr/bin/env bash
# What a machine with a GPU runs: two self-contained device calls (docs/TESTBED.md has the exact
# device-tool invocations) within the session's 15 minutes of device time, start-ups included. Call 1
# installs pyfused._C (the build carried in .gpu_carry/, made on a CPU machine for the device's
# Python and torch; built on the device if none is carried), runs the GPU tests, the single-GPU and
# virtual-rank benchmarks, the two-process NCCL paths and the sanitizers, and returns the Triton
# cache; call 2, after a fix, carries the cache in and runs the rest, or reruns steps (--only).
#
#   bash benchmarks/gpu_check.sh --call 1    # install, tests, virtual ranks, benches, NCCL, sanitizers
#   bash benchmarks/gpu_check.sh --call 2    # overhead, symm-mem probe and smoke, memcheck at W=2
#   bash benchmarks/gpu_check.sh --dry-run [--call N]   # the plan and its worst case; no GPU
#   bash benchmarks/gpu_check.sh --call N --only a,b    # only the named steps (of any call)
#
# Every step runs under its own `timeout`, whatever happened before it (no `set -e`), capped by what
# is left of the call (its timeout_s less RESERVE, kept for `pack` and collecting): a step that
# would start with less than MIN_STEP seconds left is recorded as not run (rc=-), and `pack` always
# runs. After every step -- and on exit, by a trap -- the logs, summary.txt and the results tarball
# are copied to $OUT, so a call killed at its limit still returns everything that ran. The exit
# status is 1 if any step failed or was not run. The sanitizer steps run one process per rank, not
# virtual ranks: a sanitizer may serialize a process's kernel launches, and virtual ranks' kernels
# wait on each other. The adversarial virtual-rank cases run in a step of their own (virtual_adv): a
# kernel that traps ends its process, and the other cases must not go with it. The bench steps
# write each row as it is measured (<suite>.rows.jsonl) and stop their suites (--suite-timeout)
# before the step's limit. Results:
# benchmarks/results/<date>_<gpu>[_<GPU_CHECK_RUN>]/call<N>/ (commit them; GPU_CHECK_RESULTS names
# another root; GPU_CHECK_RUN tells a second run of the day from the first).
set -uo pipefail
cd "$(dirname "$0")/.."

# --- the device tool's limits and what this plan assumes (docs/TESTBED.md) ------------------------
TOOL_MAX=600       # s, the most one command may run
STARTUP=120        # s per call, a fresh machine's start: the device README's "1 to 2 minutes"
BUDGET=900         # s of device time for the session; each call is followed by give_back
SPARE=20           # s the worst case leaves unused
KILL_GRACE=5       # s a step may outlive its limit (timeout --kill-after)
RESERVE=25         # s of a call kept for `pack` and the final collect
MIN_STEP=15        # s: a step is not started with less than this left
MAX_FILES=8        # files the device tool returns from $OUT
CARRY=.gpu_carry   # what a call carries in (ignored by git): the .so and the Triton cache tarball
SO_GLOB="_C.cpython-*.so"
CALLS="1 2"
# The Triton cache sits at one path on every machine, whatever the checkout's: its group files
# hold the absolute paths of their entries, so a cache unpacked at another path is never hit.
TRITON_CACHE=${TMPDIR:-/tmp}/pyfused-triton-cache
PY=${PYTHON:-python3}
PYTEST="$PY -m pytest -q -ra --maxfail=5 -p no:cacheprovider --timeout=60"
BENCH="$PY -m pyfused.bench --no-progress"

call_timeout() {  # the timeout_s each call is run with
  case $1 in 1) echo 440 ;; *) echo 200 ;; esac
}

# --- the plan: per call, "name limit_s command" (a command is one bash -c string) -----------------
# The most valuable steps first: a call cut short loses only what follows.
call_steps() {
  case $1 in
  1) cat <<'EOF'
env         10  gpu_env
install     150 gpu_install
queues      40  CUDA_DEVICE_MAX_CONNECTIONS=1 $PY benchmarks/probe_stream_queues.py --streams 8 --expect-one-queue && $PY benchmarks/probe_stream_queues.py
tests_kernels 90 $PYTEST -m gpu tests/test_gemm.py tests/test_reduce.py
tests_ops   75  $PYTEST -m gpu tests/test_extension.py tests/test_fused_gpu.py tests/test_ddp_kernels.py tests/test_all_reduce_add_rmsnorm.py -k "not w2 and not w4"
virtual     100 $PYTEST -m gpu --capture=sys tests/test_virtual_ranks.py -k "not moe and not fp16 and not adversarial"
virtual_adv 60  $PYTEST -m gpu --capture=sys tests/test_virtual_ranks.py -k "adversarial"
virtual_moe 40  PYFUSED_FUSED_TIMEOUT_MS=10000 $PYTEST -m gpu --capture=sys tests/test_virtual_ranks.py -k "moe and 2-bf16" --timeout=30
bench_1gpu  100 $BENCH --suites gemm,reduce --timeout 30 --suite-timeout 35 --out $RES/bench_1gpu
nccl_paths  45  gpu_nccl_paths
memcheck_w1 35  $SANITIZER --tool memcheck $PY benchmarks/sanitize_fused.py --world 1 --iters 1
racecheck   35  $SANITIZER --tool racecheck $PY benchmarks/sanitize_fused.py --world 1 --iters 1
bench_vr    150 $BENCH --suites virtual_ranks --dtype bfloat16 --timeout 25 --suite-timeout 120 --out $RES/bench_virtual_ranks
bench_vc    90  $BENCH --suites virtual_crossover --dtype bfloat16 --timeout 25 --suite-timeout 60 --out $RES/bench_virtual_crossover
pack        10  gpu_pack_cache
EOF
  ;;
  2) cat <<'EOF'
env         10  gpu_env
install     60  gpu_install
cache       10  gpu_unpack_cache
overhead_w1 100 $BENCH --suites overhead --world 1 --timeout 30 --suite-timeout 70 --out $RES/overhead
bench_vr8   70  PYFUSED_VR_WORLDS=8 $BENCH --suites virtual_ranks --dtype bfloat16 --timeout 25 --suite-timeout 40 --out $RES/bench_virtual_ranks_w8
virtual_fp16 60 $PYTEST -m gpu --capture=sys tests/test_virtual_ranks.py -k "not moe and fp16"
symm_probe  25  set -o pipefail; $PY benchmarks/probe_symm_mem.py | tee -a $RES/env.txt
symm_w2     40  PYFUSED_TEST_BACKEND=nccl $PYTEST -m gpu tests/test_symmetric.py -k w2
memcheck_w2 100 $SANITIZER --tool memcheck $PY benchmarks/sanitize_fused.py --world 2 --iters 1
pack        10  gpu_pack_cache
EOF
  ;;
  esac
}

call_returns() {  # the files a call leaves under $OUT (the device tool returns at most 8)
  echo "summary.txt env.txt results.tar.gz $SO_GLOB triton_cache.tar.gz"
}

call_purpose() {
  case $1 in
  1) echo "install pyfused._C (carried, else built: PYFUSED_REQUIRE_EXT=1, sm_90a), single-rank GPU tests, virtual ranks at W=2/4/8, the single-GPU benches, the NCCL paths on 2 processes, memcheck and racecheck at W=1, the virtual-rank benches and the one-shot/two-shot crossover" ;;
  2) echo "the overhead suite's host time, the symm-mem probe and exchange smoke, memcheck at W=2; reruns with --only" ;;
  esac
}

call_carry() {  # the device tool's carry argument of a call
  echo ", carry=[\"$CARRY\"]"
}

all_steps() {  # every call's steps, each name once
  local call
  for call in $CALLS; do call_steps "$call"; done | awk '!seen[$1]++'
}

selected_steps() {  # call N's steps, or with --only the named steps (of any call) in that order
  local name
  if [ -z "$ONLY" ]; then call_steps "$1"; return; fi
  for name in ${ONLY//,/ }; do all_steps | grep "^$name "; done
}

dry_run() {  # print the plan of the given calls and their worst case; exit 1 if a limit is broken
  local bad=0 call name limit cmd steps n files worst total=0 timeout last
  echo "Triton cache: $TRITON_CACHE (one path on every machine; TMPDIR sets its root)"
  for call in "$@"; do
    steps=0 n=0 timeout=$(call_timeout "$call")
    echo "call $call: $(call_purpose "$call")"
    echo "  run(command=\"bash benchmarks/gpu_check.sh --call $call\"$(call_carry "$call"), timeout_s=$timeout)"
    while read -r name limit cmd; do
      printf '  %-12s %4ss  %s\n' "$name" "$limit" "$cmd"
      steps=$((steps + limit)) n=$((n + 1)) last=$name
    done < <(call_steps "$call")
    files=$(call_returns "$call" | wc -w)
    echo "  steps: ${steps}s of limits, each capped by what is left of $((timeout - RESERVE))s" \
         "(timeout_s=${timeout}s less ${RESERVE}s kept for pack and collecting)"
    echo "  returns ${files} files: $(call_returns "$call")"
    worst=$((STARTUP + timeout))
    total=$((total + worst))
    echo "  worst case: ${STARTUP}s start-up + ${timeout}s timeout_s, then give_back = ${worst}s"
    if [ "$timeout" -gt "$TOOL_MAX" ]; then echo "  ERROR: timeout_s over the tool's ${TOOL_MAX}s"; bad=1; fi
    if [ "$last" != pack ]; then echo "  ERROR: call $call does not end with pack"; bad=1; fi
    if [ "$files" -gt "$MAX_FILES" ]; then echo "  ERROR: call $call returns $files files > $MAX_FILES"; bad=1; fi
  done
  echo "worst case: ${total}s of device time for $# call(s) (start-up assumed ${STARTUP}s a call:" \
       "the device README's 1 to 2 minutes) vs the budget ${BUDGET}s less ${SPARE}s spare" \
       "= $((BUDGET - SPARE))s: $([ "$total" -le $((BUDGET - SPARE)) ] && echo fits || echo 'DOES NOT FIT')"
  [ "$total" -le $((BUDGET - SPARE)) ] || bad=1
  return $bad
}

usage() { echo "usage: $0 --call 1|2 [--only STEP,...] [--timeout S] | --dry-run [--call 1|2]" >&2; exit 2; }

# --- arguments -------------------------------------------------------------------------------------
CALL="" DRY=0 ONLY="" TIMEOUT=""
while [ $# -gt 0 ]; do
  case $1 in
    --call) CALL=${2:-}; shift 2 || usage ;;
    --only) ONLY=${2:-}; shift 2 || usage ;;
    --timeout) TIMEOUT=${2:-}; shift 2 || usage ;;  # the timeout_s the call runs with, if not its own
    --dry-run) DRY=1; shift ;;
    *) usage ;;
  esac
done
if [ "$DRY" = 1 ]; then
  if [ -n "$CALL" ]; then dry_run "$CALL"; else dry_run $CALLS; fi
  exit $?
fi
case $CALL in 1|2) ;; *) usage ;; esac
[[ "$TIMEOUT" =~ ^[0-9]*$ ]] || usage
for name in ${ONLY//,/ }; do
  all_steps | grep -q "^$name " || { echo "--only: no call has a step $name" >&2; exit 2; }
done

# --- the environment every step sees -----------------------------------------------------------------
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The fused kernels' waits give up after 15 s of wall-clock time (a lost flag costs little of the
# call); torch.distributed's groups wait longer (tests/dist_pool.py: 90 s), so a lost flag is
# reported by the kernel (rank, peer, flag).
export PYFUSED_FUSED_TIMEOUT_MS=${PYFUSED_FUSED_TIMEOUT_MS:-15000}
# Eager CUDA module loading in every step: with lazy loading, CUDA's default, a kernel's first
# launch waits for the context's running kernels, so a launch queued behind a kernel that spins on
# a flag it would set stalls until the fused timeout traps (seen on the first GPU run, where a
# two-stream extension test's producer launch waited out the consumer's 60 s wait).
export CUDA_MODULE_LOADING=EAGER
# A hardware work queue per stream of the virtual ranks (CUDA's default is 8): streams that share a
# queue run in one order, so a rank's kernel could wait behind a peer's spinning one
# (pyfused/testing/virtual_ranks.py, push_streams_per_rank).
export CUDA_DEVICE_MAX_CONNECTIONS=32
# torch symmetric memory, for the multi-process smoke only: the CUDA backend (NVSHMEM cannot host
# several ranks on one GPU), and several ranks per device allowed. env.txt records what took.
export TORCH_SYMMMEM=CUDA TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
# The Triton cache travels from call 1 to call 2: binaries and metadata only (no IRs), so its
# tarball stays under what a returned file may hold.
export TRITON_CACHE_DIR=$TRITON_CACHE TRITON_STORE_BINARY_ONLY=1
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
SANITIZER="${SANITIZER:-compute-sanitizer} --target-processes all --error-exitcode 9 --print-limit 50"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr ' ' '-')
# A second run of a day on the same GPU names itself (GPU_CHECK_RUN=run2: <date>_<gpu>_run2), so its
# files do not mix with the committed first run's.
RUN=${GPU_CHECK_RESULTS:-benchmarks/results}/$(date -u +%Y-%m-%d)_${GPU:-no-gpu}
if [ -n "${GPU_CHECK_RUN:-}" ]; then RUN=${RUN}_$GPU_CHECK_RUN; fi
RES=$RUN/call$CALL
mkdir -p "$RES"
: > "$RES/summary.txt"
export PY PYTEST BENCH SANITIZER RES OUT CARRY
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
fact("CUDA_DEVICE_MAX_CONNECTIONS", lambda: os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
fact("CUDA_MODULE_LOADING", lambda: os.environ.get("CUDA_MODULE_LOADING"))
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

extension_name() {  # the file name of pyfused._C for this Python (its tag: _C.cpython-312-...so)
  local suffix
  suffix=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX") or "")' 2>/dev/null)
  [ -n "$suffix" ] || { echo "cannot ask $PY for its extension suffix" >&2; return 1; }
  echo "_C$suffix"
}

check_extension() {  # the extension loads and agrees with the Python side's layout
  $PY -c "import pyfused._C, torch; from pyfused.comm.symmetric import check_layout; check_layout(); print('pyfused._C ok; ops:', sorted(n for n in dir(torch.ops.pyfused) if not n.startswith('_')))"
}

gpu_build() {  # a build that skips the extension fails (PYFUSED_REQUIRE_EXT=1)
  local so; so=pyfused/$(extension_name) || return 1
  PYFUSED_REQUIRE_EXT=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=${MAX_JOBS:-16} \
    $PY -m pip install --no-build-isolation --no-deps --no-index -e . || return 1
  ls -l "$so" || return 1
  cp "$so" "$OUT/"
  check_extension
}

gpu_pack_cache() {  # the Triton cache, for call 2 (a returned file may have 16 MiB)
  tar czf "$OUT/triton_cache.tar.gz" -C "$TRITON_CACHE_DIR" . || return 1
  local bytes; bytes=$(stat -c %s "$OUT/triton_cache.tar.gz")
  echo "triton_cache.tar.gz: $bytes bytes, $(ls "$TRITON_CACHE_DIR" | wc -l) entries"
  [ "$bytes" -lt $((15 << 20)) ] || { echo "over 15 MiB: it would not come back"; return 1; }
}

gpu_unpack_cache() {  # call 1's Triton cache at the path it was made at
  [ -f "$CARRY/triton_cache.tar.gz" ] || {
    echo "no $CARRY/triton_cache.tar.gz: the kernels compile again (slower, still correct)"; return 1; }
  mkdir -p "$TRITON_CACHE_DIR" && tar xzf "$CARRY/triton_cache.tar.gz" -C "$TRITON_CACHE_DIR" || return 1
  echo "triton cache entries: $(ls "$TRITON_CACHE_DIR" | wc -l) in $TRITON_CACHE_DIR"
}

gpu_install() {  # the carried extension built for this Python (pip only maps the package), else a build
  local name; name=$(extension_name) || return 1
  if [ -f "$CARRY/$name" ]; then
    echo "carried extension: $CARRY/$name"
    cp "$CARRY/$name" pyfused/ || return 1
    PYFUSED_SKIP_CUDA_BUILD=1 $PY -m pip install --no-build-isolation --no-deps --no-index -e . -q \
      && check_extension && return 0
    echo "the carried extension does not install or load here: building"
    rm -f "pyfused/$name"
  else
    echo "no $CARRY/$name (for $($PY -V 2>&1)); $CARRY holds: $(ls "$CARRY" 2>/dev/null | tr '\n' ' '): building"
  fi
  gpu_build
}

gpu_nccl_paths() {  # the NCCL training paths, 2 processes on the one GPU (a correctness transport)
  $PY -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gpu_nccl_paths.py \
    --device cuda --backend nccl --group-timeout 20 --out "$RES/nccl_paths"
}
export -f gpu_env extension_name check_extension gpu_build gpu_pack_cache gpu_unpack_cache gpu_install \
  gpu_nccl_paths

collect() {  # logs, summary and the results tarball to $OUT (after every step and on exit)
  cp "$RES/summary.txt" "$OUT/summary.txt" 2>/dev/null
  cp "$RES/env.txt" "$OUT/env.txt" 2>/dev/null
  tar czf "$OUT/results.tar.gz.part" "$RES" 2>/dev/null && mv "$OUT/results.tar.gz.part" "$OUT/results.tar.gz"
}
trap 'echo "exit: collecting"; collect' EXIT
trap 'exit 143' TERM INT  # the EXIT trap then still collects

DEADLINE=$(( $(date +%s) + ${TIMEOUT:-$(call_timeout "$CALL")} - RESERVE ))  # steps but pack end by then

run_step() {  # run_step NAME LIMIT CMD: time-limited (capped by the call's deadline), logged, recorded
  local name=$1 limit=$2 cmd=$3 t0 rc left
  t0=$(date +%s) left=$((DEADLINE - t0))
  if [ "$name" != pack ] && [ "$left" -lt "$limit" ]; then
    if [ "$left" -lt "$MIN_STEP" ]; then
      status=1
      printf '%-12s rc=-   not run: %ss of the call left  %.150s\n' "$name" "$left" "$cmd" \
        | tee -a "$RES/summary.txt"
      return
    fi
    limit=$left
  fi
  echo "== $name (limit ${limit}s): $cmd"
  timeout --kill-after=$KILL_GRACE "$limit" bash -c "$cmd" < /dev/null > "$RES/$name.log" 2>&1
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
done < <(selected_steps "$CALL")
cat "$RES/summary.txt"
exit $status
