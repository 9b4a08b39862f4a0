"""``python -m parity.cli``: the ``qwen4exp`` command line run from a source tree."""
import sys

from parity.cli import main

sys.exit(main())
