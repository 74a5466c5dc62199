#!/usr/bin/env bash
# A new user's README commands, timed: a fresh clone of this repository, a fresh venv, no pip cache.
#   bash benchmarks/first_hour.sh serve   # command 1: install, `ember serve` to the first completion
#   bash benchmarks/first_hour.sh tests   # command 2: install the test extras, the fast tier
# Work happens in a temporary directory (removed after); the numbers are printed last. Run it on an idle
# machine: everything here is CPU-bound.
set -euo pipefail
mode=${1:?usage: first_hour.sh serve|tests}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/ember-first-hour.XXXXXX)
trap 'kill %1 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
git clone -q "$repo" "$work/ember" && cd "$work/ember"
python3 -m venv .venv && . .venv/bin/activate
export PIP_NO_CACHE_DIR=1 XDG_RUNTIME_DIR="$work/run"
mkdir -m 700 "$work/run"
now() { date +%s.%N; }
t0=$(now)
if [ "$mode" = serve ]; then
    pip install -q -e . >/dev/null 2>&1
    t1=$(now)
    { ember serve 2>ember.log & }
    ember generate --wait 900 "def fibonacci(n):" > completion.txt
    t2=$(now)
    cat completion.txt
    echo "install $(echo "$t1 - $t0" | bc) s; ember serve to the completion $(echo "$t2 - $t1" | bc) s; in all $(echo "$t2 - $t0" | bc) s"
else
    pip install -q -e ".[test,hf]" >/dev/null 2>&1
    t1=$(now)
    python -m pytest -q -p no:cacheprovider | tail -1
    t2=$(now)
    echo "install $(echo "$t1 - $t0" | bc) s; tests $(echo "$t2 - $t1" | bc) s; in all $(echo "$t2 - $t0" | bc) s"
fi
