#!/usr/bin/env bash
# Runs the suite with $TEST_PYTHON (`make test` sets it: .venv-test/bin/python); "no tests
# collected" (pytest exit 5) is a failure, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
"${TEST_PYTHON:-.venv-test/bin/python}" -m pytest -q -ra "$@"
code=$?
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$code"
