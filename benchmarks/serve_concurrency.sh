#!/usr/bin/env bash
# The serve concurrency table in one run: localspec serve at --parallel 1, 2, 4 (plain and auto) against native llama-server
# -np 4 (plain and --spec-type ngram-simple), same model, same threads, BF16 KV and flash attention on both sides,
# each server alone on the machine, 1/2/4 clients (benchmarks/serve_concurrency.py).
# Usage: benchmarks/serve_concurrency.sh [TARGET.gguf]   (env: BIN=dir of native tools, N=64, REQUESTS=2, THREADS=2,
#   CTX=4096 per slot, PORT=8090, CONFIGS="1:none 2:none 4:none 1:auto 2:auto 4:auto", NATIVE="plain ngram-simple"
#   (NATIVE=none: no native server; a config "4:auto:split" runs that server with --kv-layout split, default auto), CLIENTS=1,2,4, ROUNDS=1: the whole list again, interleaved, to see the drift,
#   SCHEMA=1: every request asks for a json_schema answer, LOCALSPEC="localspec": the command that serves, e.g.
#   "env PYTHONPATH=/other/checkout python -m localspec" for an older checkout, WARM=1: keep the suffix cache across
#   server starts)
set -u
here=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-$HOME/.cache/localspec-anchor/build/bin}
T=${1:-$HOME/.cache/localspec-test-models/qwen2.5-coder-1.5b-instruct.gguf}
N=${N:-64}; REQUESTS=${REQUESTS:-2}; THREADS=${THREADS:-2}; CTX=${CTX:-4096}; PORT=${PORT:-8090}
CONFIGS=${CONFIGS:-"1:none 2:none 4:none 1:auto 2:auto 4:auto"}
NATIVE=${NATIVE:-"plain ngram-simple"}; [ "$NATIVE" = none ] && NATIVE=""
CLIENTS=${CLIENTS:-1,2,4}; ROUNDS=${ROUNDS:-1}
PY=${PYTHON:-python3}
read -r -a LS <<<"${LOCALSPEC:-localspec}"
SCHEMA_FLAG=(); [ "${SCHEMA:-0}" = 1 ] && SCHEMA_FLAG=(--json-schema)
# each server starts without the suffix cache of an earlier start (the same prompts every round); WARM=1 keeps it
persist=0; [ "${WARM:-0}" = 1 ] && persist=1
pid=""
stop() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; pid=""; fi; }
trap stop EXIT
wait_up() {
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}
bench() { "$PY" "$here/serve_concurrency.py" --url "http://127.0.0.1:$PORT" --clients "$CLIENTS" -n "$N" --requests "$REQUESTS" --label "$1" "${SCHEMA_FLAG[@]}"; }
for round in $(seq "$ROUNDS"); do
for cfg in $CONFIGS; do
  IFS=: read -r np method layout <<<"$cfg"
  LOCALSPEC_SUFFIX_CACHE=$persist "${LS[@]}" serve -m "$T" --method "$method" --parallel "$np" --kv-layout "${layout:-auto}" --threads "$THREADS" \
    -c "$CTX" --port "$PORT" 2>"/tmp/serve_concurrency.$np.$method.log" &
  pid=$!
  label="localspec --parallel $np $method${layout:+ $layout}"
  if wait_up; then bench "$label"; else echo "$label did not start"; fi
  stop
done
for kind in $NATIVE; do
  spec=(); [ "$kind" = plain ] || spec=(--spec-type "$kind")
  "$BIN/llama-server" -m "$T" -np 4 -c $((CTX * 4)) -t "$THREADS" -fa on -ctk bf16 -ctv bf16 --port "$PORT" \
    "${spec[@]}" >"/tmp/serve_concurrency.native.$kind.log" 2>&1 &
  pid=$!
  if wait_up; then bench "llama-server -np 4 $kind"; else echo "llama-server $kind did not start"; fi
  stop
done
done
