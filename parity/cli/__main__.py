"""``python -m parity.cli ...``: the qwen4exp CLI from a checkout (same as the installed ``qwen4exp`` script)."""
import sys

from parity.cli import main

sys.exit(main())
