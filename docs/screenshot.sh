#!/usr/bin/env bash
# Screenshot of a real flow run's page in the Prefect UI, as shown in the README (docs/prefect-run.png).
#
# Starts a throwaway Prefect server on 127.0.0.1, deploys prefect.yaml, starts a process worker, adds the
# shipped sample as dataset "sample" with `layertap add` (whose rows-added event triggers embed-new-rows),
# waits for that run, and photographs its Artifacts tab with headless Chromium (Debian: apt-get install
# chromium) driven by docs/photograph.py. Everything but the PNG lives in a temporary folder that is
# removed at the end.
#
#   docs/screenshot.sh [OUTPUT.png]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-$ROOT/.venv}
OUT=${1:-docs/prefect-run.png}
CHROMIUM=${CHROMIUM:-chromium}
WORK=$(mktemp -d)
PORT=$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export PREFECT_HOME=$WORK/prefect PREFECT_API_URL=http://127.0.0.1:$PORT/api PREFECT_CLI_PROMPT=false
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_WORKER_QUERY_SECONDS=2 VLLM_LOGGING_LEVEL=WARNING
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || true; done; sleep 2; rm -rf "$WORK"; }
trap cleanup EXIT

setsid "$VENV/bin/prefect" server start --host 127.0.0.1 --port "$PORT" >"$WORK/server.log" 2>&1 & PIDS+=($!)
until curl -sf "$PREFECT_API_URL/health" >/dev/null; do sleep 1; done
"$VENV/bin/prefect" work-pool create layertap --type process >/dev/null
"$VENV/bin/prefect" deploy --all --prefect-file prefect.yaml >/dev/null
setsid "$VENV/bin/prefect" worker start --pool layertap --type process >"$WORK/worker.log" 2>&1 & PIDS+=($!)

"$VENV/bin/layertap" add --dataset sample --input layertap/data/sample.csv --store "$WORK/store" --layers 0,2,-1

RUN=$("$VENV/bin/python" - <<'PY'
import os, time, httpx
api = os.environ["PREFECT_API_URL"]
for _ in range(600):
    runs = httpx.post(f"{api}/flow_runs/filter", json={"deployments": {"name": {"any_": ["embed-new-rows"]}}}).json()
    if runs and runs[0]["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED"):
        print(runs[0]["id"]); break
    time.sleep(1)
else:
    raise SystemExit("no finished run")
PY
)
sleep 3  # the UI reads artifacts and logs the worker flushed last
CHROMIUM=$CHROMIUM "$VENV/bin/python" docs/photograph.py "http://127.0.0.1:$PORT/runs/flow-run/$RUN" Artifacts "$OUT" 1400 960
echo "wrote $OUT (flow run $RUN)"
