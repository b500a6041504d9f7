#!/bin/bash
# ds41ctl doctor --model DIR: a download checked before it is served, no daemon running.  A
# generated checkpoint (ds41-mkmodel, the Hugging Face layout) passes; copies of it broken the ways
# a real download breaks (a shard missing, a shard cut short, inference/config.json not fetched,
# tokenizer.json missing, weights of another config) each fail with one line naming the file or
# tensor.  The sizing rows for the guide's machines come from the release's config
# (tests/data/config/release) and must be the figures docs/GUIDE.md prints.  The GPU rows: a device
# with its figures, or "GPU: none (reason)" with auto picking the CPU backend.  TAP.
. "$(dirname "$0")/daemon_lib.sh"
# No daemon listens on $sock: its row is a warning, the rest works on the files alone.
ctl() { "$bin/ds41ctl" --socket "$sock" "$@"; }
mk=$bin/ds41-mkmodel
# the model rows doctor --model adds (the machine's rows -- io_uring, O_DIRECT, memlock, cpu -- are
# not the download's business and may differ between hosts)
model_rows='("checkpoint", "tokenizer", "shards", "shard", "tensors", "tensor", "footprint", "budgets", "decode")'

good=$work/good
"$mk" "$good" --quiet >/dev/null || { notok "ds41-mkmodel writes a checkpoint"; finish; exit 0; }
ctl --json doctor --model "$good" --memory 1GiB >"$work/good.json"; rc=$?
check "a good checkpoint: every model row ok (config, tokenizer, shards, tensors, footprint, budgets, decode)" \
    test "$(pyj "[(c['check'], c['status']) for c in o if c['check'] in $model_rows]" "$work/good.json")" = \
    '[["checkpoint", "ok"], ["tokenizer", "ok"], ["shards", "ok"], ["tensors", "ok"], ["footprint", "ok"], ["budgets", "ok"], ["decode", "ok"]]'
check "a good checkpoint: exit 0 unless a row about this machine failed" \
    test "$rc" = "$(pyj "1 if any(c['status'] == 'fail' for c in o) else 0" "$work/good.json")"
note "machine rows: $(pyj "[(c['check'], c['status']) for c in o if c['check'] not in $model_rows]" "$work/good.json")"
ntensors=$(pyj 'len(o["weight_map"])' "$good/model.safetensors.index.json")
check "a good checkpoint: the shards row counts the index's $ntensors tensors, the tensors row the plan's" \
    bash -c "grep -q '\"detail\": \"5 shard files, $ntensors tensors' '$work/good.json' && grep -q 'all $ntensors tensors the config plans' '$work/good.json'"
check "a good checkpoint: budgets for --memory 1GiB, everything resident" \
    grep -q '"detail": "budgets: auto -> experts [0-9.]* KiB resident, Engram [0-9.]* KiB resident (available 1.0 GiB' "$work/good.json"

# The GPU rows: a device with its figures, or "GPU: none (reason)" and the CPU backend for auto
# (no GPU here or in CI; on a machine with one the other branch is checked).
gpu_status=$(pyj "[c['status'] for c in o if c['check'] == 'gpu']" "$work/good.json")
if [ "$gpu_status" = '["ok"]' ]; then
    check "a GPU: its name, compute capability, driver/runtime versions, memory, and measured bandwidths" \
        test "$(pyj "[c['check'] for c in o if c['check'].startswith('gpu') and c['status'] == 'ok' and ('compute capability' in c['detail'] and ', driver ' in c['detail'] and ', runtime ' in c['detail'] and ' free of ' in c['detail'] or 'device memory' in c['detail'] and 'host-to-device' in c['detail'])]" "$work/good.json")" = '["gpu", "gpu bandwidth"]'
else
    check "no usable GPU: one 'GPU: none (reason)' row, a warning" \
        test "$(pyj "[(c['status'], c['detail'].startswith('GPU: none (') and len(c['detail']) > 14) for c in o if c['check'].startswith('gpu')]" "$work/good.json")" = '[["warn", true]]'
    check "no usable GPU: auto picks the CPU backend, saying why" \
        test "$(pyj "[c['detail'].startswith('cpu (no usable GPU: ') for c in o if c['check'] == 'backend auto']" "$work/good.json")" = '[true]'
fi

# broken copies; each: its message, exit 1
breaks() { rm -rf "$work/$1"; cp -r "$good" "$work/$1"; }
shard2=model-00002-of-00005.safetensors
breaks noshard
rm "$work/noshard/$shard2"
ctl doctor --model "$work/noshard" >"$work/noshard.txt"; rc=$?
check "a shard missing: 'shard fail DIR/$shard2: No such file' naming a tensor the index maps to it, exit 1" \
    bash -c "test $rc -eq 1 && grep -q '^shard *fail *$work/noshard/$shard2: No such file or directory (the index maps [^ ]* and others to it' '$work/noshard.txt' &&
             grep -q '^shards *fail *1 of 5 shard files missing or damaged' '$work/noshard.txt'"

breaks cut
size=$(stat -c %s "$work/cut/$shard2")
truncate -s $((size - 100)) "$work/cut/$shard2"
ctl doctor --model "$work/cut" >"$work/cut.txt"; rc=$?
check "a shard cut short: its size and the size its header implies, exit 1" \
    bash -c "test $rc -eq 1 && grep -q '^shard *fail *$work/cut/$shard2: $((size - 100)) bytes, its header implies $size: truncated' '$work/cut.txt'"
truncate -s 20 "$work/cut/$shard2"
ctl doctor --model "$work/cut" >"$work/cut2.txt"; rc=$?
check "a shard cut inside its header: said so, exit 1" \
    bash -c "test $rc -eq 1 && grep -q '^shard *fail *$work/cut/$shard2: 20 bytes, shorter than its [0-9]*-byte header: truncated' '$work/cut2.txt'"

breaks noinf
rm -r "$work/noinf/inference"
ctl doctor --model "$work/noinf" >"$work/noinf.txt"; rc=$?
check "inference/config.json not downloaded (root config.json kept): what is missing and where it comes from, exit 1" \
    bash -c "test $rc -eq 1 && grep -q '^checkpoint *fail *not a ds41 checkpoint: $work/noinf/inference/config.json is missing; the root config.json is not enough: ds41 reads inference/config.json, which deepseek-ai/DeepSeek-V4.1-Flash ships in its inference/ folder' '$work/noinf.txt'"
check "inference/config.json missing: the shards are still checked (one run lists every problem)" \
    grep -q '^shards *ok' "$work/noinf.txt"

breaks notok
rm "$work/notok/tokenizer.json"
ctl doctor --model "$work/notok" >"$work/notok.txt"; rc=$?
check "tokenizer.json missing: named, exit 1" \
    bash -c "test $rc -eq 1 && grep -q '^tokenizer *fail *$work/notok/tokenizer.json: No such file or directory' '$work/notok.txt' &&
             grep -q '^tensors *ok' '$work/notok.txt'"

# weights of another config: a config that plans 12 routed experts over the 8-expert shards
"$mk" "$work/more" --quiet --set n_routed_experts=12 >/dev/null
breaks plan
cp "$work/more/inference/config.json" "$work/plan/inference/config.json"
ctl --json doctor --model "$work/plan" >"$work/plan.json"; rc=$?
check "a tensor the plan needs is not in the checkpoint: one row naming it, exit 1" \
    bash -c "test $rc -eq 1 && test \"\$1\" = True" _ \
    "$(pyj "any(c['check'] == 'tensor' and c['status'] == 'fail' and c['detail'].startswith('layers.') and '.ffn.experts.8.w1.weight: missing (inference/config.json needs it' in c['detail'] for c in o)" "$work/plan.json")"
check "plan mismatch: the tensors row counts the missing tensors, the shards themselves are fine" \
    test "$(pyj "[(c['status'], c['detail'].split(':')[0]) for c in o if c['check'] in ('tensors', 'shards')]" "$work/plan.json")" = \
    '[["ok", "5 shard files, '"$ntensors"' tensors, 5.4 MB of weights; every size matches its header"], ["fail", "the checkpoint does not match inference/config.json"]]'
check "plan mismatch: at most 20 tensor rows, then a count of the rest" \
    test "$(pyj "(sum(c['check'] == 'tensor' for c in o) <= 21, any(c['detail'].startswith('... ') and 'more tensor problems' in c['detail'] for c in o))" "$work/plan.json")" = "(True, True)"

ctl doctor --memory 1GiB >/dev/null 2>"$work/usage.err"; rc=$?
check "doctor --memory without --model: exit 1 with a message" \
    bash -c "test $rc -eq 1 && grep -q 'size the tiers of --model DIR' '$work/usage.err'"
ctl doctor --model "$good" --memory lots >/dev/null 2>"$work/usage2.err"; rc=$?
check "doctor --memory with a bad size: exit 1 naming the option" \
    bash -c "test $rc -eq 1 && grep -q \"doctor: --memory 'lots'\" '$work/usage2.err'"

# The guide's sizing figures: every "budgets:" and "one token reads" line docs/GUIDE.md quotes is
# what doctor prints for the release's config with the options the guide gives on the line above
# it (a `ds41ctl doctor ...` command in the same code block).
guide=$(dirname "$0")/../docs/GUIDE.md
release=$(dirname "$0")/data/config/release
"$py" - "$guide" >"$work/guide_cmds" <<'EOF'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
# code blocks holding a doctor command on the release followed by the rows it prints
for block in re.findall(r"```sh\n(.*?)```", text, re.S):
    lines = block.splitlines()
    for i, l in enumerate(lines):
        m = re.match(r"\$ ds41ctl doctor --model \S+ (.*)$", l)
        if not m:
            continue
        want = [x.strip() for x in lines[i + 1:] if x.startswith(("budgets", "decode", "footprint"))]
        cut = next((j for j, x in enumerate(lines[i + 1:]) if x.startswith("$ ")), None)
        if cut is not None:
            want = [x.strip() for x in lines[i + 1:i + 1 + cut] if x.startswith(("budgets", "decode", "footprint"))]
        print(m.group(1) + "\t" + "\x1f".join(want))
EOF
nblocks=$(wc -l <"$work/guide_cmds")
check "docs/GUIDE.md quotes doctor's sizing rows for the three machines and the alternatives (got $nblocks)" test "$nblocks" -ge 3
i=0
while IFS=$'\t' read -r args want; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    ctl doctor --model "$release" $args | grep -E '^(budgets|decode|footprint) ' | sed 's/  */ /g' >"$work/got$i"
    IFS=$'\x1f' read -r -a rows <<<"$want"
    printf '%s\n' "${rows[@]}" | sed 's/  */ /g' >"$work/want$i"
    check "docs/GUIDE.md: 'ds41ctl doctor $args' prints the rows the guide shows" \
        bash -c "test -s '$work/want$i' && grep -qxFf '$work/want$i' '$work/got$i' && test \$(grep -cxFf '$work/got$i' '$work/want$i') = \$(wc -l <'$work/want$i')"
done <"$work/guide_cmds"

# The guide's ds41d.yaml model entry, on top of the test daemon's settings, with the path of the
# generated checkpoint: what a start checks (except binding) passes.
cfgf=$work/guide.yaml
write_config "$cfgf"
"$py" - "$guide" "$good" >>"$cfgf" <<'EOF'
import re, sys
blocks = re.findall(r"```yaml\n(.*?)```", open(sys.argv[1], encoding="utf-8").read(), re.S)
print(blocks[0].replace("/srv/models/DeepSeek-V4.1-Flash", sys.argv[2]), end="")
EOF
"$ds41d" --config "$cfgf" --check-config >"$work/check.txt" 2>&1; rc=$?
check "docs/GUIDE.md: its ds41d.yaml model entry passes ds41d --check-config" \
    bash -c "test $rc -eq 0 && grep -q 'name: deepseek-v4.1-flash' '$work/check.txt' && grep -q 'path: $good' '$work/check.txt'"
check "docs/GUIDE.md: the practice commands are the ones run here" \
    bash -c "grep -qxF 'ds41-mkmodel /tmp/ds41-practice --quiet' '$guide' && grep -qxF 'ds41ctl doctor --model /tmp/ds41-practice --memory 1GiB' '$guide'"

finish
