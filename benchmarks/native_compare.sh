#!/usr/bin/env bash
# Same-run comparison with native llama.cpp built from the same source (../shared/tools/native-llama-cpp.sh):
# native plain and `llama-lookup` (k=3) vs localspec plain, auto at `bit` and auto at `lossless` (k<=8), on held-out
# prompts (benchmarks/heldout_prompts.json), 128 tokens, 2 threads, BF16 KV, flash attention on both sides.
# The native tools get the prompt in Qwen's ChatML template (what localspec renders for the Qwen pair).
# Usage: benchmarks/native_compare.sh [TARGET.gguf] [DRAFT.gguf]   (env: BIN=dir of native tools, REPS=2, N=128,
#   PROMPTS=a prompts JSON file (default heldout_prompts.json; auto_prompts.json has six kinds of prompt where lookup pays),
#   CONFIGS="METHOD:EXACTNESS:K ..." for localspec (default "none:auto:8 auto:bit:8 auto:lossless:8"; auto:auto:8 is
#   `auto` as shipped), OLD=a checkout of an older localspec to run beside it (same venv) as old-METHOD-EXACTNESS, WARM=1: keep the
#   suffix cache across runs and rounds (default: each run starts without one))
set -u
here=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-$HOME/.cache/localspec-anchor/build/bin}
M=$HOME/.cache/localspec-test-models
T=${1:-$M/qwen2.5-coder-1.5b-instruct.gguf}; D=${2:-$M/qwen2.5-coder-0.5b-instruct.gguf}
N=${N:-128}; REPS=${REPS:-2}
PY=${PYTHON:-python3}
work=$(mktemp -d)
PROMPTS=${PROMPTS:-$here/heldout_prompts.json}
persist=0; [ "${WARM:-0}" = 1 ] && persist=1
CONFIGS=${CONFIGS:-"none:auto:8 auto:bit:8 auto:lossless:8"}
ids=$($PY -c "import json,sys; print(' '.join(p['id'] for p in json.load(open(sys.argv[1]))))" "$PROMPTS")
for id in $ids; do
  $PY - "$PROMPTS" "$id" "$work" <<'PYEOF'
import json, sys
p = next(x["prompt"] for x in json.load(open(sys.argv[1])) if x["id"] == sys.argv[2])
open(f"{sys.argv[3]}/{sys.argv[2]}.prompt", "w").write(p)
open(f"{sys.argv[3]}/{sys.argv[2]}.txt", "w").write(
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n")
PYEOF
done
native=(-m "$T" -n "$N" --temp 0 -t 2 -fa on -ctk bf16 -ctv bf16 -c 2048)
for rep in $(seq "$REPS"); do
  for id in $ids; do
    f=$work/$id.txt
    r=$("$BIN/llama-completion" "${native[@]}" -f "$f" -no-cnv --no-display-prompt 2>&1 | grep "eval time" | grep -v prompt | grep -oE "[0-9.]+ tokens per second")
    echo "$rep $id native-plain $r"
    r=$("$BIN/llama-lookup" "${native[@]}" -f "$f" --spec-draft-n-max 3 2>&1 | grep -oE "speed: +[0-9.]+ t/s" | head -2 | tail -1)
    echo "$rep $id native-lookup3 $r"
    for cfg in $CONFIGS; do
      IFS=: read -r method exactness k <<<"$cfg"
      for side in new ${OLD:+old}; do
        dir=$here/..; [[ $side == old ]] && dir=$OLD
        # every run drafts as a first request would: no suffix cache kept from an earlier round (WARM=1 keeps it)
        r=$(cd "$dir" && LOCALSPEC_SUFFIX_CACHE=$persist $PY -m localspec run -m "$T" -d "$D" --method "$method" --exactness "$exactness" -k "$k" -n "$N" --threads 2 --json "$(cat "$work/$id.prompt")" 2>/dev/null \
            | $PY -c "import json,sys; d=json.load(sys.stdin); print(round(d['tokens_per_second'], 2), 'tok/s', d['steps_by_method'], d['exactness'])")
        label=localspec; [[ $side == old ]] && label=old
        echo "$rep $id $label-$method-$exactness-k$k $r"
      done
    done
  done
done
rm -rf "$work"
