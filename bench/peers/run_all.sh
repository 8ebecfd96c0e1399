#!/usr/bin/env bash
# Install what the peer benchmarks need (if missing), then run every workload against every peer
# on 127.0.0.1 and print one JSON line per run (a table of them goes to stderr at the end).
#
#   bench/peers/run_all.sh                          # defaults: 200k msgs, 1 KiB and 100 B, e2e 10 s
#   bench/peers/run_all.sh --peers redis --count 50000
#   bench/peers/run_all.sh > peers.jsonl            # keep the JSON lines
#
# PYTHON selects the interpreter (default: the project venv). The clients are installed into it
# with pip but are not project dependencies; the servers come from apt.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
if [[ ! -x "$PY" ]]; then
    echo "no interpreter at $PY: run 'make setup' first or set PYTHON" >&2
    exit 1
fi

"$HERE/install.sh" all

# Run from the repository root so `python -m tidemq.cli.main` finds this checkout.
cd "$ROOT"
exec "$PY" "$HERE/run_all.py" "$@"
