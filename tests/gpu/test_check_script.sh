#!/bin/bash
# TAP: tests/gpu/check.sh's own logic on a host (meson test gpu_check_script), with the build tree
# of the suite (--no-build) and a small budget:
#  - --dry-run prints every step with its time limit and the summary line, and runs nothing;
#  - steps that pass are counted as passed (the cpu backend: opcheck and the forward checks);
#  - --backend cuda on a host without a GPU fails (a device check never passes by skipping);
#  - a step past its time limit is killed and counted as failed;
#  - the emulated CUDA backend's steps pass, or skip (77) where this tree cannot open it.
set -u
cd "$(dirname "$0")/../.." || exit 1
: "${DS41_BUILD_DIR:?DS41_BUILD_DIR names the build tree}"
export DS41_BUILD_DIR
n=0
failed=0
tap() { # tap OK WHAT [DETAIL]
    n=$((n + 1))
    if [ "$1" = 0 ]; then echo "ok $n - $2"; else
        echo "not ok $n - $2"
        failed=1
        [ -n "${3:-}" ] && printf '%s\n' "$3" | sed 's/^/# /' | tail -30
    fi
}
skip() { n=$((n + 1)); echo "ok $n - $1 # SKIP $2"; }
T=$(mktemp -d "${TMPDIR:-/tmp}/ds41-check-script-XXXXXX")
trap 'rm -rf "$T"' EXIT

# 1. The plan.
OUT=$T/dry tests/gpu/check.sh --dry-run >"$T/dry.out" 2>&1
rc=$?
ok=1
[ $rc = 0 ] && ok=0
for s in env build opcheck forward layers bench release; do grep -q "^plan: $s (limit [0-9]* s)" "$T/dry.out" || ok=1; done
grep -q -- "--backend cuda --shapes tiny,release" "$T/dry.out" || ok=1
grep -q "DS41_CHECK_BACKEND=cuda" "$T/dry.out" || ok=1
tail -1 "$T/dry.out" | grep -qx "gpu-check: 0 passed, 0 failed" || ok=1
[ -f "$T/dry/check.log" ] || ok=1
tap $ok "--dry-run: every step planned with its limit (opcheck on cuda at both shapes, the layer check with DS41_CHECK_BACKEND), the summary line, the log under \$OUT, exit 0" "$(cat "$T/dry.out")"

# 2. Passing steps on the cpu backend.
OUT=$T/cpu tests/gpu/check.sh --backend cpu --no-build --quick --only opcheck,forward --budget 400 >"$T/cpu.out" 2>&1
rc=$?
ok=1
[ $rc = 0 ] && grep -q '^pass: opcheck' "$T/cpu.out" && grep -q '^pass: forward' "$T/cpu.out" &&
    tail -1 "$T/cpu.out" | grep -qx "gpu-check: 2 passed, 0 failed" && grep -q '^ok .* linear wq_a' "$T/cpu/check.log" && ok=0
tap $ok "--backend cpu --only opcheck,forward: both run, pass, \"gpu-check: 2 passed, 0 failed\", the TAP in the log" \
    "$(cat "$T/cpu.out"; tail -20 "$T/cpu/check.log")"

# 3. No GPU: cuda fails, it does not skip.
if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
    skip "--backend cuda without a GPU fails" "this host has a GPU"
else
    OUT=$T/nogpu tests/gpu/check.sh --backend cuda --no-build --only env,opcheck --budget 120 >"$T/nogpu.out" 2>&1
    rc=$?
    ok=1
    [ $rc = 1 ] && grep -q '^FAIL: env' "$T/nogpu.out" && grep -q '^FAIL: opcheck' "$T/nogpu.out" &&
        tail -1 "$T/nogpu.out" | grep -qx "gpu-check: 0 passed, 2 failed" && ok=0
    tap $ok "--backend cuda on a host without a GPU: nvidia-smi and the op check fail (a skip is no pass), exit 1" \
        "$(cat "$T/nogpu.out")"
fi

# 4. The time limit (a test step of a known length: DS41_GPU_CHECK_TEST_STEP), and its child killed
#    with it.
t0=$(date +%s)
DS41_GPU_CHECK_TEST_STEP="sleep 97.5 & wait" OUT=$T/slow \
    tests/gpu/check.sh --backend cpu --no-build --only test,opcheck --quick --budget 12 >"$T/slow.out" 2>&1
rc=$?
dt=$(($(date +%s) - t0))
ok=1
sleep 1
[ $rc = 1 ] && [ $dt -lt 60 ] && ! pgrep -fx "sleep 97.5" >/dev/null && grep -Eq '^FAIL: test timed out after 1[0-2] s' "$T/slow.out" &&
    grep -q '^skip: opcheck (the budget of 12 s is spent)' "$T/slow.out" &&
    tail -1 "$T/slow.out" | grep -qx "gpu-check: 0 passed, 1 failed, 1 skipped" && ok=0
tap $ok "a step that outlives what is left of the budget (12 s) is killed with its children and counted as failed, the next step skipped (${dt} s)" \
    "$(cat "$T/slow.out")"

# 5. The emulated CUDA backend (a skip until this tree has it).
OUT=$T/emu tests/gpu/check.sh --backend cuda-emu --no-build --quick --only opcheck --budget 400 >"$T/emu.out" 2>&1
rc=$?
if [ $rc = 77 ] && tail -1 "$T/emu.out" | grep -qx "gpu-check: 0 passed, 0 failed, 1 skipped"; then
    skip "--backend cuda-emu --only opcheck" "cuda-emu cannot be opened in this tree"
else
    ok=1
    [ $rc = 0 ] && tail -1 "$T/emu.out" | grep -qx "gpu-check: 1 passed, 0 failed" && ok=0
    tap $ok "--backend cuda-emu --only opcheck: every op of the emulated kernels on the host" \
        "$(cat "$T/emu.out"; grep -E '^not ok|^#' "$T/emu/check.log" | head -20)"
fi
echo "1..$n"
exit $failed
