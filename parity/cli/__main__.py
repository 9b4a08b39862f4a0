"""``python -m parity.cli ...``: the ``qwen4exp`` command (ci/gpu and ci/gpu_bench.sh call it this way)."""
import sys

from parity.cli import console_main

sys.exit(console_main())
