"""The scenario suites as an installable pytest package.

Run against any backend::

    pytest --pyargs parity.suites --qwen4exp-backend engine:device=cpu [--qwen4exp-model tiny] [--qwen4exp-level ci]
    pytest --pyargs parity.suites --qwen4exp-backend my_pkg.my_engine:MyBackend [--qwen4exp-page-sizes 16,64]

The options come from the plugin :mod:`parity.suites.plugin`, registered by the installed package's
``pytest11`` entry point (from a checkout that is not installed: add ``-p parity.suites.plugin``).

One test per (scenario, case, page size). A failure message names the failing operation, the
sequence, the worst KL and the first divergence found by tap-diff. ``parity.suites.faults`` holds
the fault-injecting backends used as negative controls.
"""
