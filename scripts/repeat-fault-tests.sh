#!/usr/bin/env bash
# The fault-injection tests, many times in a row: first on the machine as it is, then again with one core kept
# busy by a background load (a loaded CI runner). A test whose fault lands by its timing instead of by
# construction fails here long before it fails a CI run; docs/dev-cluster.md keeps the last result.
#
#   scripts/repeat-fault-tests.sh [--count N] [--busy-only|--idle-only] [TEST ...]
#
# Each test runs N times in one pytest session (pytest-repeat's --count: its engines are started once).
# Without TEST: the tests that inject faults into real engines (FAULT_TESTS below). Needs `make setup`.
set -euo pipefail
cd "$(dirname "$0")/.."
FAULT_TESTS=(
  tests/engine/test_stream_resumption.py
)
COUNT=20
PHASES="idle busy"
TESTS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --count) COUNT=${2:?--count needs a number}; shift 2 ;;
    --busy-only) PHASES=busy; shift ;;
    --idle-only) PHASES=idle; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) TESTS+=("$1"); shift ;;
  esac
done
[ ${#TESTS[@]} -gt 0 ] || TESTS=("${FAULT_TESTS[@]}")
say() { printf '\033[1m[repeat]\033[0m %s\n' "$*" >&2; }

BUSY=
trap '[ -z "$BUSY" ] || kill "$BUSY" 2>/dev/null || true' EXIT
status=0
for phase in $PHASES; do
  if [ "$phase" = busy ]; then
    python3 -c 'while True: pass' &   # one core's worth of CPU taken from the tests, as a busy neighbour
    BUSY=$!
  fi
  say "$COUNT runs of ${TESTS[*]} ($phase machine)"
  start=$(date +%s)
  if .venv/bin/python -m pytest -q -p no:cacheprovider --count "$COUNT" "${TESTS[@]}"; then
    say "$phase: all $COUNT runs passed in $(( $(date +%s) - start )) s"
  else
    status=1
    say "$phase: FAILED (pytest's summary above counts the failed runs) after $(( $(date +%s) - start )) s"
  fi
  if [ -n "$BUSY" ]; then kill "$BUSY"; wait "$BUSY" 2>/dev/null || true; BUSY=; fi
done
exit $status
