#!/bin/bash
# The CUDA backend's memory in /metrics and `ds41ctl cache`, shown with the test mode
# engine.backend: cuda-emu (the CUDA backend with its kernels emulated on the host, on any
# machine): ds41_device_memory_bytes by tier and the device-*/pinned-host tiers of /admin/cache,
# the weights placed in device memory and the KV pool there; and a daemon on engine.backend: cpu
# has neither.  Skipped, saying why, while the emulated backend cannot load the model (a build
# without it).  TAP.
. "$(dirname "$0")/daemon_lib.sh"
ctl() { "$bin/ds41ctl" --socket "$sock" "$@"; }
cfg=$work/ds41d.yaml
tiers='["device-weights", "device-pool", "device-experts", "device-scratch", "device-other", "pinned-host"]'

# backend: on top of the test daemon's settings
config_backend() {
    write_config "$cfg"
    sed -i "s/^  mode: fast\$/  mode: fast\n  backend: $1/; s/^  admin_group: null\$/  admin_group: \"$(id -gn)\"/" "$cfg"
}

# start: 0 = serving; 1 = the model failed to load on the backend (reason in $work/why)
start() {
    "$ds41d" --config "$cfg" >"$work/daemon.log" 2>&1 &
    daemon_pid=$!
    local i
    for i in $(seq 1 600); do
        if [ -S "$sock" ] && [ "$(curl -s -o /dev/null -w '%{http_code}' --unix-socket "$sock" http://ds41/health)" = 200 ]; then
            return 0
        fi
        if grep -q 'engine.backend' "$work/daemon.log" && ! grep -q 'model ds41-tiny: backend ' "$work/daemon.log"; then
            grep -m1 'engine.backend' "$work/daemon.log" >"$work/why"
            return 1
        fi
        kill -0 "$daemon_pid" 2>/dev/null || break
        sleep 0.1
    done
    sed 's/^/# daemon: /' "$work/daemon.log" | tail -20
    grep -m1 'engine.backend' "$work/daemon.log" >"$work/why"
    return 1
}

# ---- the CPU backend: no device lines ----------------------------------------------------------
config_backend cpu
if ! start; then notok "ds41d starts on engine.backend: cpu ($(cat "$work/why"))"; finish; exit 0; fi
check "engine.backend: cpu is logged as the choice" grep -q 'model ds41-tiny: backend cpu' "$work/daemon.log"
curl -s --unix-socket "$sock" http://ds41/metrics >"$work/cpu.metrics"
check "cpu: /metrics has the device family's HELP but no samples" \
    bash -c "grep -q '^# HELP ds41_device_memory_bytes ' '$work/cpu.metrics' && ! grep -q '^ds41_device_memory_bytes{' '$work/cpu.metrics'"
ctl --json cache >"$work/cpu.cache"
check "cpu: ds41ctl cache lists no device tier" \
    test "$(pyj "[t['name'] for t in o['cache']['tiers'] if t['name'].startswith(('device-', 'pinned-'))]" "$work/cpu.cache")" = "[]"
stop_daemon

# ---- the emulated CUDA backend ------------------------------------------------------------------
config_backend cuda-emu
if ! start; then
    why=$(cat "$work/why" 2>/dev/null)
    if grep -q 'backend cuda-emu' "$work/why" 2>/dev/null; then
        skip "engine.backend: cuda-emu cannot load the model in this build: ${why#*engine.backend: }"
    else
        notok "ds41d starts on engine.backend: cuda-emu ($why)"
    fi
    stop_daemon
    finish
    exit 0
fi
check "engine.backend: cuda-emu is logged as the choice" grep -q 'model ds41-tiny: backend cuda-emu' "$work/daemon.log"
chat='{"model":"ds41-tiny","messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"seed":1}'
st=$(api POST /v1/chat/completions "$chat")
check "cuda-emu: a chat completes (got $st)" test "$st" = 200
curl -s --unix-socket "$sock" http://ds41/metrics >"$work/emu.metrics"
check "cuda-emu: /metrics has ds41_device_memory_bytes for each of the six tiers" \
    test "$(grep -c '^ds41_device_memory_bytes{model="ds41-tiny",tier="\(device-weights\|device-pool\|device-experts\|device-scratch\|device-other\|pinned-host\)"} [0-9]*$' "$work/emu.metrics")" = 6
check "cuda-emu: the weights and the KV pool are in device memory (non-zero)" \
    bash -c "grep -q '^ds41_device_memory_bytes{model=\"ds41-tiny\",tier=\"device-weights\"} [1-9]' '$work/emu.metrics' &&
             grep -q '^ds41_device_memory_bytes{model=\"ds41-tiny\",tier=\"device-pool\"} [1-9]' '$work/emu.metrics'"
ctl --json cache >"$work/emu.cache"
check "cuda-emu: ds41ctl cache lists the six device tiers" \
    test "$(pyj "[t['name'] for t in o['cache']['tiers'] if t['name'].startswith(('device-', 'pinned-'))]" "$work/emu.cache")" = "$tiers"
check "cuda-emu: ds41ctl cache's device tiers agree with /metrics" \
    test "$(pyj "[t['used_bytes'] for t in o['cache']['tiers'] if t['name'] == 'device-weights']" "$work/emu.cache")" = \
    "[$(sed -n 's/^ds41_device_memory_bytes{model="ds41-tiny",tier="device-weights"} //p' "$work/emu.metrics")]"
ctl cache >"$work/emu.cache.txt"
check "cuda-emu: the text table shows device-weights with capacity '-'" grep -qE '^device-weights +[0-9.]+ [kMGTP]?B +- ' "$work/emu.cache.txt"
stop_daemon
finish
