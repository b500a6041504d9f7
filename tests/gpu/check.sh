#!/bin/bash
# tests/gpu/check.sh: the CUDA backend checked on a GPU in one call (issue 15; tests/gpu/README.md).
#
# Run from anywhere inside the working tree that travelled to the device machine:
#   tests/gpu/check.sh                       build there, then every step on --backend cuda
#   tests/gpu/check.sh --dry-run             print the plan (each step, its time limit, its command)
#   tests/gpu/check.sh --backend cuda-emu --no-build --only opcheck,forward
#                                            the steps that run on a host, on the emulated kernels
# Options:
#   --backend B     cuda (default), cuda-emu or cpu: what every step checks
#   --budget S      seconds for all steps together (default 480); each step's limit is its own
#                   (below) or what is left of the budget, whichever is smaller; a step that
#                   would start with under 10 s left is skipped
#   --only A,B      only these steps (env, build, opcheck, forward, layers, bench, release)
#   --no-build      use the build tree as it is (DS41_BUILD_DIR or build-gpu)
#   --arch CC       gpu_archs for the build (default: the device's compute capability, else 90)
#   --quick         opcheck on the tiny shapes only, the layer check on its tiny checkpoints
# Output: everything to $OUT/check.log (OUT: the device tool's folder; ./gpu-check-out when unset),
# one line per step on stdout, and last "gpu-check: N passed, N failed[, N skipped]".
# Exit status: 0 every step that ran passed, 1 one failed, 77 none ran (all skipped), 2 bad usage.
set -u
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD

BACKEND=cuda
BUDGET=480
ONLY=
BUILD=1
ARCH=
DRY=0
QUICK=0
ALL_STEPS="env build opcheck forward layers bench release"
# Test only (tests/gpu/test_check_script.sh): DS41_GPU_CHECK_TEST_STEP is a command run as a first
# step named `test` (limit 60 s), to show the counting and the time limit on something that takes
# a known time.
[ -n "${DS41_GPU_CHECK_TEST_STEP:-}" ] && ALL_STEPS="test $ALL_STEPS"
while [ $# -gt 0 ]; do
    case "$1" in
    --backend) BACKEND=${2:?}; shift 2 ;;
    --budget) BUDGET=${2:?}; shift 2 ;;
    --only) ONLY=${2:?}; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --arch) ARCH=${2:?}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --quick) QUICK=1; shift ;;
    -h | --help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "check.sh: unknown argument '$1' (--help)" >&2; exit 2 ;;
    esac
done
case "$BACKEND" in cuda | cuda-emu | cpu) ;; *) echo "check.sh: --backend cuda, cuda-emu or cpu" >&2; exit 2 ;; esac
case "$BUDGET" in '' | *[!0-9]*) echo "check.sh: --budget takes whole seconds" >&2; exit 2 ;; esac
for s in ${ONLY//,/ }; do
    case " $ALL_STEPS " in *" $s "*) ;; *) echo "check.sh: unknown step '$s' ($ALL_STEPS)" >&2; exit 2 ;; esac
done

OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT" || exit 2
LOG=$OUT/check.log
: >"$LOG"
B=${DS41_BUILD_DIR:-$ROOT/build-gpu}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ds41-gpu-check-XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
PASSED=0 FAILED=0 SKIPPED=0
SUMMARY=()

log() { printf '%s\n' "$*" >>"$LOG"; }
say() { printf '%s\n' "$*"; log "$*"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
wanted() { [ -z "$ONLY" ] || case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# step NAME LIMIT CMD...: run CMD (a bash snippet) under `timeout`, output to the log.  Exit 0 is a
# pass; 77 is a skip for the emulated backend (it may not be in this tree) and the cpu backend,
# and a failure for cuda (on a GPU nothing may skip); anything else, and a timeout, a failure.
step() {
    local name=$1 limit=$2 cmd=$3 rem rc t0 dt
    wanted "$name" || return 0
    rem=$(left)
    [ "$limit" -gt "$rem" ] && limit=$rem
    log ""
    log "=== step $name (limit ${limit} s): $cmd"
    if [ "$DRY" = 1 ]; then
        say "plan: $name (limit ${limit} s): $cmd"
        return 0
    fi
    if [ "$limit" -lt 10 ]; then
        SKIPPED=$((SKIPPED + 1))
        say "skip: $name (the budget of $BUDGET s is spent)"
        SUMMARY+=("$name skipped (budget)")
        return 0
    fi
    t0=$(date +%s)
    timeout --kill-after=5 "$limit" bash -c "$cmd" >>"$LOG" 2>&1
    rc=$?
    dt=$(($(date +%s) - t0))
    if [ $rc = 0 ]; then
        PASSED=$((PASSED + 1))
        say "pass: $name (${dt} s)"
    elif [ $rc = 77 ] && [ "$BACKEND" != cuda ]; then
        SKIPPED=$((SKIPPED + 1))
        say "skip: $name: backend $BACKEND not available in this tree (${dt} s)"
    elif [ $rc = 124 ] || [ $rc = 137 ]; then
        FAILED=$((FAILED + 1))
        say "FAIL: $name timed out after ${limit} s"
    else
        FAILED=$((FAILED + 1))
        say "FAIL: $name (exit $rc, ${dt} s; see $LOG)"
    fi
    SUMMARY+=("$name exit $rc ${dt}s")
}

# The device's compute capability as gpu_archs wants it (9.0 -> 90).
device_arch() {
    local cc
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    case "$cc" in '' | *[!0-9]*) echo 90 ;; *) echo "$cc" ;; esac
}
[ -n "$ARCH" ] || ARCH=$( [ "$BACKEND" = cuda ] && device_arch || echo 90)
NPROC=$(nproc 2>/dev/null || echo 4)
if [ "$BACKEND" = cuda ]; then PY=python3; else PY=$(command -v /usr/bin/python3 || command -v python3); fi
OPSHAPES=tiny,release
[ "$QUICK" = 1 ] && OPSHAPES=tiny

say "gpu-check: backend $BACKEND, budget $BUDGET s, build $B, gpu_archs $ARCH, log $LOG"

[ -n "${DS41_GPU_CHECK_TEST_STEP:-}" ] && step test 60 "$DS41_GPU_CHECK_TEST_STEP"

# 1. What the machine is (not a check of the backend: nvidia-smi must answer for cuda).
step env 30 "
    set -x
    uname -a; nproc; free -g | head -2
    if [ '$BACKEND' = cuda ]; then
        nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,clocks.max.sm,power.limit --format=csv || exit 1
        nvidia-smi | head -20
    fi
    command -v nvcc && nvcc --version | tail -2
    for t in meson ninja pkg-config cc $PY; do command -v \$t || echo \"missing: \$t\"; done
    $PY -c 'import numpy; print(\"numpy\", numpy.__version__)'
    true"

# 2. Build (dependencies from the carried .gpudeps/ when the machine lacks them: README.md).
[ "$BUILD" = 1 ] && step build 240 "
    set -e
    . tests/gpu/deps_env.sh '$ROOT' '$WORK'
    if [ ! -f '$B/build.ninja' ]; then
        \$MESON setup '$B' -Dgpu_archs=$ARCH $( [ "$BACKEND" = cuda ] && echo -Dcuda=enabled )
    fi
    \$NINJA -C '$B' -j $NPROC daemon/ds41-eval daemon/ds41-mkmodel daemon/ds41-bench tests/ds41-opcheck tests/test_fast_forward"
[ "$BUILD" = 1 ] || SUMMARY+=("build not run (--no-build)")

ENVSRC=". tests/gpu/deps_env.sh '$ROOT' '$WORK' >/dev/null; export DS41_BUILD_DIR='$B' DS41_SOURCE_DIR='$ROOT' TMPDIR='$WORK'"

# 3. Every op against the reference at the tiny and release shapes (tests/gpu/op_check.c).
step opcheck 150 "$ENVSRC; '$B/tests/ds41-opcheck' --backend $BACKEND --shapes $OPSHAPES --reps 5"

# 4. The forward pass: prefill = chunks of 7 = token by token, batches of 4 and 16 = alone, bit for
#    bit; a snapshot saved on the CPU restored on the backend and continued (tests/test_fast_forward.c).
step forward 150 "$ENVSRC; DS41_TEST_BACKEND=$BACKEND '$B/tests/test_fast_forward'"

# 5. Layer by layer against the numpy reference with the decision contract: the regression fixture,
#    mkmodel tiny x3 and long x2, gen_ckpt wide (tests/reference/test_layer_check.py).
step layers 200 "$ENVSRC; DS41_CHECK_BACKEND=$BACKEND PYTHONUNBUFFERED=1 $PY tests/reference/test_layer_check.py"

# 6. Throughput on the bench preset: decode tok/s at batch 1/4/16 with bytes/token against the
#    measured bandwidth, prefill FLOP/s against the peak (ds41-bench; the figures go to the log).
step bench 150 "$ENVSRC; set -e
    '$B/daemon/ds41-mkmodel' '$WORK/bench' --preset bench --quiet
    '$B/daemon/ds41-bench' --model '$WORK/bench' --backend $BACKEND --batches 1,4,16 --steps 16
    rm -rf '$WORK/bench'"

# 7. A release-shaped slice (the release's layer dimensions; two layers, 64 experts each, a 32k
#    vocabulary, a smaller Engram table: about 2.5 GB) resident, then with the routed experts streamed
#    through a slot pool of about half their bytes: the same figures and the experts' copy bandwidth.
step release 180 "$ENVSRC; set -e
    '$B/daemon/ds41-mkmodel' '$WORK/rel' --preset release-slice --set n_layers=2 --set 'compress_ratios=[2, 1]' \
        --set 'kv_source_layers=[0, 1]' --set 'index_source_layers=[0, 1]' --set candidate_source_layer=1 \
        --set 'engram_layer_ids=[1]' --set 'engram_num_embeddings=[1]' --set engram_vocab_size=20000 \
        --set n_routed_experts=64 --set vocab_size=32768 --quiet
    '$B/daemon/ds41-bench' --model '$WORK/rel' --backend $BACKEND --batches 1,4,16 --steps 8 --prompt 128
    '$B/daemon/ds41-bench' --model '$WORK/rel' --backend $BACKEND --batches 1,4 --steps 8 --prompt 64 \
        --expert-cache-bytes 600MiB
    rm -rf '$WORK/rel'"

if [ "$DRY" = 1 ]; then
    say "gpu-check: dry run, nothing ran"
    say "gpu-check: 0 passed, 0 failed"
    exit 0
fi
log ""
log "=== steps: ${SUMMARY[*]}"
log "=== total $(($(date +%s) - START)) s"
# The figures worth reading first, gathered from the log.
grep -E '^not ok|^(pass|FAIL|skip):|tok/s|GB/s|GFLOP|TFLOP|bandwidth' "$LOG" | head -80 >"$OUT/figures.txt" || true
if [ "$SKIPPED" -gt 0 ]; then
    say "gpu-check: $PASSED passed, $FAILED failed, $SKIPPED skipped"
else
    say "gpu-check: $PASSED passed, $FAILED failed"
fi
[ "$FAILED" -gt 0 ] && exit 1
[ "$PASSED" = 0 ] && exit 77
exit 0
