#!/usr/bin/env bash
# The README's command-line walkthrough, end to end on one machine (127.0.0.1 only):
# a control plane, a run with one published version, a CPU reference engine with its
# agent, and one generation routed through the control plane.
#
#   docs/walkthrough.sh [WORK_DIR]     # default: a new temporary folder
#
# Ports come from CP_PORT (8700, the server's default), ENGINE_PORT (30000) and
# AGENT_PORT (30001). Every process it starts is stopped when it exits. A test
# (tests/test_walkthrough.py) runs it on every `make test`.
set -euo pipefail

WORK=${1:-$(mktemp -d)}
CP_PORT=${CP_PORT:-8700}
ENGINE_PORT=${ENGINE_PORT:-30000}
AGENT_PORT=${AGENT_PORT:-30001}
CP=http://127.0.0.1:$CP_PORT
mkdir -p "$WORK"
cd "$WORK"

# One database and one store for every command below: the server, `token create` and
# `store publish` read the same TETHER_* settings when no flag is given.
export TETHER_DB_URL="sqlite:///$WORK/tether.db"
export TETHER_STORE="$WORK/store"

started=()
stop_all() {
    for pid in "${started[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${started[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_all EXIT

# wait_for URL WHAT [SECONDS]: poll until URL answers 2xx, or fail naming WHAT.
wait_for() {
    local deadline=$((SECONDS + ${3:-120}))
    until curl -sf -o /dev/null "${@:4}" "$1"; do
        if ((SECONDS > deadline)); then
            echo "walkthrough: $2 did not answer at $1; logs in $WORK" >&2
            exit 1
        fi
        sleep 0.5 # polling interval, bounded by the deadline
    done
}

tether controlplane migrate
ADMIN=$(tether token create --role admin --name walkthrough)
TRAINER=$(tether token create --role trainer)
ENGINE=$(tether token create --role engine)
CLIENT=$(tether token create --role client)

tether controlplane serve --port "$CP_PORT" >controlplane.log 2>&1 &
started+=($!)
wait_for "$CP/readyz" "the control plane"

tether model init-tiny --out ./tiny
tether store publish --run my-run --checkpoint ./tiny --control-plane "$CP" --token "$TRAINER"

tether engine reference --model ./tiny --port "$ENGINE_PORT" >engine.log 2>&1 &
started+=($!)
tether agent run --engine-url "http://127.0.0.1:$ENGINE_PORT" --precision bf16 \
    --boot-model ./tiny --port "$AGENT_PORT" \
    --control-plane "$CP" --token "$ENGINE" --store ./store --run my-run >agent.log 2>&1 &
started+=($!)
wait_for "$CP/v1/route?run_id=my-run&min_version=0" "a routable engine" 180 \
    -H "Authorization: Bearer $CLIENT"

curl -sf "$CP/v1/generate" -H "Authorization: Bearer $CLIENT" \
    -H "Content-Type: application/json" \
    -d '{"run_id": "my-run", "text": "1+1=", "sampling_params": {"max_new_tokens": 4},
         "weight_version": {"min_version": 0}}'
echo
tether store ls --store ./store --run my-run
curl -sf "$CP/v1/engines" -H "Authorization: Bearer $ADMIN" >/dev/null
echo "walkthrough: ok"
