#!/usr/bin/env bash
# Runs the suite; "no tests collected" (pytest exit 5) is a failure, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q -ra "$@"
code=$?
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$code"
