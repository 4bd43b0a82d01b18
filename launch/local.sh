#!/usr/bin/env bash
# Local entry point: creates .venv and installs glm5-jax on first use, then runs
#   main   the tiny end-to-end job on CPU
#   test   the default test suite (fast; what CI runs)
#   slow   the slow tests
#   any other arguments: run them inside the venv, e.g. `launch/local.sh python -m experiments.model_summary`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.installed-$(sha1sum setup.py | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  pip install -q --upgrade pip
  pip install -q -e ".[test,hf]"
  touch "$stamp"
fi
export PYTHONUNBUFFERED=1
cmd=${1:-main}
case "$cmd" in
  main)
    shift || true
    python -m experiments.main_job --workdir="${WORKDIR:-workdir/main}" "$@" ;;
  test)
    shift
    python -m pytest -q -m "not slow" "$@" ;;
  slow)
    shift
    python -m pytest -q -m slow "$@" ;;
  *)
    exec "$@" ;;
esac
