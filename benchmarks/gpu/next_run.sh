#!/usr/bin/env bash
# The device runs the open GPU targets need next (issue 8), as four calls of the device
# tool (each under its 10-minute limit; ~25 minutes of device time in all). Needs the
# fla-core 0.6.0 and einops 0.8.2 wheels in .whl/ (see .library/device/README.md: pip
# download ... -d .whl fla-core==0.6.0 einops==0.8.2), carried with the call.
#
#   bash benchmarks/gpu/next_run.sh check   # fp32 correctness: sparse KDA states (dh0 of
#                                            # empty sequences), Flex/varlen vs float64
#   bash benchmarks/gpu/next_run.sh kernels # fused conv vs gather form; autotuned KDA at
#                                            # 16/64 sequences; fidelity with the repacked baseline
#   bash benchmarks/gpu/next_run.sh step    # update step with the fused conv kernels
#   bash benchmarks/gpu/next_run.sh calib   # per-op profile at several sizes for
#                                            # `harts sim fit` (simulated vs measured step)
#
# Each writes its JSON under $OUT (at most 8 files come back; two folders deep).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
case "$1" in
  check)   TRITON_F32_DEFAULT=ieee timeout 560 python3 benchmarks/gpu/h200_run.py env kda flex --no-autotune --out "$OUT" ;;
  kernels) timeout 560 python3 benchmarks/gpu/h200_run.py conv ops fidelity --out "$OUT" ;;
  step)    HARTS_CONV=triton timeout 560 python3 benchmarks/gpu/h200_run.py step profile --no-autotune --out "$OUT" ;;
  calib)   timeout 560 python3 benchmarks/gpu/h200_run.py calib --out "$OUT" ;;
  *) echo "usage: $0 check|kernels|step|calib" >&2; exit 2 ;;
esac
