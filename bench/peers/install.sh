#!/usr/bin/env bash
# Install what the peer benchmarks need, if missing: the servers with apt (root or sudo), the
# Python clients with pip into the project venv (PYTHON picks another interpreter). They are not
# tidemq dependencies.
#
#   bench/peers/install.sh            # redis-server + redis-py/hiredis (what `tidemq bench app` needs)
#   bench/peers/install.sh all        # also rabbitmq-server + rstream (bench/peers/run_all.sh)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WHAT="${1:-redis}"

as_root() {
    if [[ $(id -u) -eq 0 ]]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else echo "need root for: $*" >&2; return 1
    fi
}

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
if [[ "$WHAT" == all ]]; then
    [[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]] || missing+=(rabbitmq-server)
fi
if (( ${#missing[@]} )); then
    echo "installing ${missing[*]} (apt)" >&2
    # Debian starts the packages' system services on install (where a service manager runs);
    # the benchmarks do not use them: they start their own servers on free loopback ports.
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 \
      || { as_root apt-get update -q >&2 \
           && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2; }
fi

mods='import redis, hiredis'
pkgs=('redis>=5' 'hiredis>=2')
if [[ "$WHAT" == all ]]; then mods="$mods, rstream"; pkgs+=('rstream>=1.1,<2'); fi
if ! "$PY" -c "$mods" 2>/dev/null; then
    echo "installing ${pkgs[*]} into $PY (pip)" >&2
    "$PY" -m pip install -q "${pkgs[@]}" >&2
fi
