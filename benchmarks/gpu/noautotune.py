"""Run a `harts` command with each Triton autotuner's first config that fits the GPU (no
tuning: saves minutes on correctness runs, as the suites' `--no-autotune` does;
`common.no_autotune`).

    python3 benchmarks/gpu/noautotune.py verify --dtype bfloat16 --device cuda ...
"""

import sys

from common import no_autotune

no_autotune()

from harts.cli.main import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
