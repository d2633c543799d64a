#!/usr/bin/env bash
# The budget curve's cells on a lent GPU (issue 41), after bench/device/ship.py's `put` calls (bench/device/README.md).
#
#     ELSA_COMMIT=<sha> bench/device/quality.sh start BUDGET_S [WAIT_S]
#         install the kit's wheels, join + check + build the shipped model, start bench/device/curve.py detached
#         (setsid: it outlives this call, while the machine is held) with what is left of BUDGET_S seconds (counted from
#         this call's start) for its cells, then follow it WAIT_S seconds [BUDGET_S + 8: to its end] and copy its
#         cells.jsonl and log to $OUT
#     bench/device/quality.sh wait [WAIT_S]
#         the next call, sent in the same message as the start (a reply in between can outlast the ~30 s the machine
#         stays warm: then this finds a bare machine): follow the runner WAIT_S more seconds, copy
#     bench/device/quality.sh --dry-run start ...   here, on CPU: no install, the caller's ELSA_SHIP / ELSA_MODELS, and
#         CURVE_ARGS (tiny cells) passed to curve.py; tests/test_device_ship.py runs it
#
# Each cell's line is in $OUT/cells.jsonl as soon as it ends; a cut call still returns the finished ones.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && { DRY=1; shift; }
MODE="${1:-}"
OUT="${OUT:-$ROOT/out/quality_gpu}"
SITE="${SITE:-/tmp/elsa_ds_site}"
SHIP="${ELSA_SHIP:-/tmp/elsa_ship}"
MODELS="${ELSA_MODELS:-/tmp/elsa_models}"
RUNS="${ELSA_CURVE:-/tmp/elsa_curve}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false ELSA_SHIP="$SHIP"
mkdir -p "$OUT" "$RUNS"
cd "$ROOT"

if (( ! DRY )); then
    export DS_ACCELERATOR=cuda PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
fi

copy_back() {
    cp "$RUNS/log" "$OUT/curve.log" 2>/dev/null
    cp "$RUNS/cells.jsonl" "$OUT/cells.jsonl" 2>/dev/null
    cp "$SHIP/put.log" "$OUT/put.log" 2>/dev/null
    # each cell's own log (where its time went), in one file: at most 8 files come back from $OUT
    (cd "$RUNS/work" 2>/dev/null && compgen -G "*.log" > /dev/null && tar -czf "$OUT/cell_logs.tgz" ./*.log)
    return 0
}

follow() {  # follow WAIT_S: print the runner's log until it exits or WAIT_S pass; 0 when it has ended
    local pid
    pid="$(cat "$RUNS/pid" 2>/dev/null)"
    [[ -n "$pid" ]] || { echo "no runner was started on this machine (a fresh one is bare: ship again)" >&2; return 2; }
    timeout "$1" tail --pid="$pid" -n +1 -f "$RUNS/log"
    kill -0 "$pid" 2>/dev/null && { echo "=== the runner goes on (pid $pid): call 'bench/device/quality.sh wait' at once"; return 3; }
    echo "=== the runner has ended"
    return 0
}

case "$MODE" in
start)
    BUDGET="${2:?start needs BUDGET_S: the seconds the cells may take}"
    WAIT="${3:-$((BUDGET + 8))}"
    T0=$SECONDS
    if (( ! DRY )); then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            bench/device/wheels/*.whl || exit 1
    fi
    "$PY" bench/device/ship.py join --dest "$SHIP" --model_out "$MODELS/gemma3-270m" | tee "$OUT/join.log" || exit 2
    [[ -f "$RUNS/pid" ]] && kill -0 "$(cat "$RUNS/pid")" 2>/dev/null && { echo "a runner is already going: use wait" >&2; exit 2; }
    LEFT=$((BUDGET - (SECONDS - T0)))
    : > "$RUNS/log"  # made here: the runner's own redirection may come after follow's tail looks for it (it then quit)
    # shellcheck disable=SC2086
    setsid nohup "$PY" bench/device/curve.py --model "$MODELS/gemma3-270m" --corpora "$SHIP/payload/corpora" \
        --budget_s "$LEFT" --out "$RUNS" --work "$RUNS/work" ${CURVE_ARGS:-} >> "$RUNS/log" 2>&1 < /dev/null &
    echo $! > "$RUNS/pid"
    echo "=== runner started (pid $!), $LEFT s for its cells"
    follow $((WAIT - (SECONDS - T0)))
    rc=$?
    ;;
wait)
    follow "${2:-560}"
    rc=$?
    ;;
*)
    echo "usage: bench/device/quality.sh [--dry-run] start BUDGET_S [WAIT_S] | wait [WAIT_S]" >&2
    exit 2
    ;;
esac
copy_back
exit "$rc"
