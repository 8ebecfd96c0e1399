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

as_root() {
    if [[ $(id -u) -eq 0 ]]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else echo "need root for: $*" >&2; return 1
    fi
}

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
[[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]] || missing+=(rabbitmq-server)
if (( ${#missing[@]} )); then
    echo "installing ${missing[*]} (apt)" >&2
    # Debian starts the packages' system services on install (where a service manager runs);
    # the benchmark does not use them: it starts its own servers on free loopback ports.
    as_root apt-get update -q >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
fi

if ! "$PY" -c 'import redis, hiredis, rstream' 2>/dev/null; then
    echo "installing redis-py, hiredis, rstream into $PY (pip)" >&2
    "$PY" -m pip install -q 'redis>=5' 'hiredis>=2' 'rstream>=1.1,<2' >&2
fi

# Run from the repository root so `python -m tidemq.cli.main` finds this checkout.
cd "$ROOT"
exec "$PY" "$HERE/run_all.py" "$@"
