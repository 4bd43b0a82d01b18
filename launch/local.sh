#!/usr/bin/env bash
# Local entry point: creates .venv and installs glm5-jax on first use, then runs
#   main   the tiny end-to-end job on CPU
#   test   the default test suite (fast; what CI runs), its files spread over
#          $TEST_WORKERS processes (default 2; 1 runs them in this process)
#   slow   the slow tests
#   aot    run the rest of the line in .venv-aot, a second venv that adds libtpu (and
#          Triton) so that the kernels compile for TPU / GPU targets on this host
#   any other arguments: run them inside the venv, e.g. `launch/local.sh python -m experiments.model_summary`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = aot ]; then
  # libtpu would make every jax import on this host probe for a TPU, so it lives
  # in its own venv; jax[tpu] pins the libtpu that matches the installed jax.
  shift
  if [ ! -x .venv-aot/bin/python ]; then
    "$PY" -m venv .venv-aot
  fi
  . .venv-aot/bin/activate
  stamp=".venv-aot/.installed-$(cat setup.py launch/local.sh | sha1sum | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    pip install -q --upgrade pip
    pip install -q -e ".[aot,test]"
    touch "$stamp"
  fi
  export PYTHONUNBUFFERED=1 TPU_SKIP_MDS_QUERY=1
  exec "$@"
fi
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
    workers=${TEST_WORKERS:-2}
    if [ "$workers" = 1 ]; then
      python -m pytest -q -m "not slow and not aot" "$@"
    else
      python -m pytest -q -m "not slow and not aot" -n "$workers" --dist loadfile "$@"
    fi ;;
  slow)
    shift
    python -m pytest -q -m "slow and not aot" "$@" ;;
  *)
    exec "$@" ;;
esac
