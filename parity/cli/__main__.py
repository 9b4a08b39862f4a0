"""``python -m parity.cli``: the ``qwen4exp`` command line (:func:`parity.cli.main`)."""
import sys

from parity.cli import main

sys.exit(main())
