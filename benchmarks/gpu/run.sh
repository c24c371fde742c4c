#!/usr/bin/env bash
# Run GPU benchmark suites on a device machine, each under its own time limit.
#
#   bash benchmarks/gpu/run.sh SUITE... # e.g. run.sh step "attention pairs" tests
#
# A SUITE is a suite name, optionally followed by its own arguments in the same (quoted)
# word: "step --schemes treestep --steps 3". Suites: step baselines attention kda conv fidelity
# op_profile calib moe windows window_anatomy window_suite compile_ab chains sim_calibrate checkpoints revisions (benchmarks/gpu/<name>.py), and tests (the GPU correctness
# tests: python3 -m pytest -q -m cuda tests/cuda, with each Triton autotuner's first config that
# fits unless HARTS_TEST_NO_AUTOTUNE=0: tuning fla's KDA kernels takes minutes on a fresh machine).
# Each writes under $OUT/<name>/ (default /tmp/out) and runs under `timeout` (TIMEOUT_<name>
# seconds, else the default below).
#
# Wheels carried in .whl/ (fla-core, einops, nvidia-cudnn-frontend, ortools, ...) are
# installed first into /tmp/site, as the device machines have no package index.
set -o pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
declare -A LIMIT=([step]=420 [baselines]=560 [attention]=150 [kda]=200 [conv]=100 [fidelity]=90 [op_profile]=200 [calib]=150
                  [moe]=60 [windows]=540 [window_anatomy]=560 [window_suite]=560 [compile_ab]=560 [chains]=480 [sim_calibrate]=560 [checkpoints]=560 [revisions]=540 [tests]=540)
[ $# -gt 0 ] || { echo "usage: $0 SUITE... (${!LIMIT[*]})" >&2; exit 2; }
rc=0
for spec in "$@"; do
  read -r name args <<< "$spec"
  [ -n "${LIMIT[$name]}" ] || { echo "unknown suite: $name (${!LIMIT[*]})" >&2; exit 2; }
  var="TIMEOUT_$name"; limit=${!var:-${LIMIT[$name]}}
  mkdir -p "$OUT/$name"
  echo "### $spec (limit ${limit}s)"
  if [ "$name" = tests ]; then
    # shellcheck disable=SC2086
    HARTS_TEST_NO_AUTOTUNE=${HARTS_TEST_NO_AUTOTUNE:-1} timeout "$limit" python3 -m pytest -q -p no:cacheprovider \
      -m cuda tests/cuda $args \
      --junitxml="$OUT/tests/junit.xml" 2>&1 | tee "$OUT/tests/pytest.log" | tail -40
  else
    # shellcheck disable=SC2086
    timeout "$limit" python3 "benchmarks/gpu/$name.py" $args --out "$OUT/$name" 2>&1 | tee "$OUT/$name/log.txt" | tail -60
  fi
  s=$?; [ $s -eq 0 ] || { echo "### $name: exit $s"; rc=$s; }
done
exit $rc
