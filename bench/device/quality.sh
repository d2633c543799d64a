#!/usr/bin/env bash
# The budget curve's cells on a lent GPU (issue 41), after bench/device/ship.py's `put` calls (bench/device/README.md).
#
#     ELSA_COMMIT=<sha> [LOAN_S=<B>] bench/device/quality.sh start BUDGET_S [WAIT_S]
#         install the kit's wheels, join + check + build the shipped model, start bench/device/curve.py detached
#         (setsid: it outlives this call, while the machine is held) with what is left of BUDGET_S seconds (counted from
#         this call's start) for its cells, then follow it WAIT_S seconds [BUDGET_S + 8: to its end] and copy its
#         cells.jsonl and log to $OUT. LOAN_S: the device time the loan had before its first call (B); the cells then
#         also end LOAN_END_S before B runs out counted from the first put (put.log), should the puts have been slow
#     bench/device/quality.sh wait [WAIT_S]
#         the next call, sent in the same message as the start (a reply in between can outlast the ~30 s the machine
#         stays warm: then this finds a bare machine): follow the runner WAIT_S more seconds [to its deadline], copy
#     bench/device/quality.sh --dry-run start ...   here, on CPU: no install, the caller's ELSA_SHIP / ELSA_MODELS, and
#         CURVE_ARGS (tiny cells) passed to curve.py; tests/test_device_ship.py runs it
#
# The finished cells' lines and the log are copied to $OUT every few seconds while a call follows the runner: a call
# the device tool cuts (its limit, the loan's end) still returns every cell that had ended.
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

copy_cells() {  # the finished cells' lines and the log as they stand, each replaced whole (never half a line)
    local src dst
    for pair in "cells.jsonl:cells.jsonl" "log:curve.log"; do
        src="$RUNS/${pair%%:*}" dst="$OUT/${pair##*:}"
        [[ -f "$src" ]] && cp "$src" "$dst.part" 2>/dev/null && mv -f "$dst.part" "$dst"
    done
    return 0
}

copy_back() {
    copy_cells
    cp "$SHIP/put.log" "$OUT/put.log" 2>/dev/null
    # each cell's own log (where its time went), in one file: at most 8 files come back from $OUT
    (cd "$RUNS/work" 2>/dev/null && compgen -G "*.log" > /dev/null && tar -czf "$OUT/cell_logs.tgz" ./*.log)
    return 0
}

follow() {  # follow WAIT_S: print the runner's log until it exits or WAIT_S pass; 0 when it has ended
    local pid
    pid="$(cat "$RUNS/pid" 2>/dev/null)"
    [[ -n "$pid" ]] || { echo "no runner was started on this machine (a fresh one is bare: ship again)" >&2; return 2; }
    local end=$((SECONDS + $1))
    tail --pid="$pid" -n +1 -f "$RUNS/log" &
    TAILER=$!
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < end )); do
        sleep 2
        copy_cells
    done
    kill -0 "$pid" 2>/dev/null && kill "$TAILER" 2>/dev/null
    wait "$TAILER" 2>/dev/null  # tail --pid ends itself within a second of the runner
    kill -0 "$pid" 2>/dev/null && { echo "=== the runner goes on (pid $pid): call 'bench/device/quality.sh wait' at once"; return 3; }
    echo "=== the runner has ended"
    return 0
}

TAILER=""
trap '[[ -n "$TAILER" ]] && kill "$TAILER" 2>/dev/null; copy_back; exit 143' TERM INT  # cut: what has ended comes back
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
    DEADLINE=$(( $(date +%s) + BUDGET - (SECONDS - T0) ))
    FIRST_PUT="$("$PY" -c 'import json,sys; print(int(json.loads(open(sys.argv[1]).readline())["epoch"]))' "$SHIP/put.log" 2>/dev/null)"
    if [[ -n "${LOAN_S:-}" && -n "$FIRST_PUT" ]]; then  # the loan's end, counted from its first put (the machine's start before)
        LOAN_END=$(( FIRST_PUT - ${MACHINE_START_S:-35} + LOAN_S - ${LOAN_END_S:-70} ))
        (( LOAN_END < DEADLINE )) && { echo "=== the puts took longer than planned: the cells end with the loan"; DEADLINE=$LOAN_END; }
    fi
    echo "$DEADLINE" > "$RUNS/deadline"
    LEFT=$(( DEADLINE - $(date +%s) ))
    : > "$RUNS/log"  # made here: the runner's own redirection may come after follow's tail looks for it (it then quit)
    # shellcheck disable=SC2086
    setsid nohup "$PY" bench/device/curve.py --model "$MODELS/gemma3-270m" --corpora "$SHIP/payload/corpora" \
        --budget_s "$LEFT" --deadline "$DEADLINE" --out "$RUNS" --work "$RUNS/work" ${CURVE_ARGS:-} >> "$RUNS/log" 2>&1 < /dev/null &
    echo $! > "$RUNS/pid"
    echo "=== runner started (pid $!), $LEFT s for its cells"
    follow $((WAIT - (SECONDS - T0)))
    rc=$?
    ;;
wait)
    # to the runner's deadline and its kill window (bench/device/curve.py: 15 s), unless told
    follow "${2:-$(( $(cat "$RUNS/deadline" 2>/dev/null || date +%s) - $(date +%s) + 30 ))}"
    rc=$?
    ;;
*)
    echo "usage: bench/device/quality.sh [--dry-run] start BUDGET_S [WAIT_S] | wait [WAIT_S]" >&2
    exit 2
    ;;
esac
copy_back
exit "$rc"
