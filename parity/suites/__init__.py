"""The scenario suites as an installable pytest package.

Run against any backend::

    pytest --pyargs parity.suites --backend engine:device=cpu [--model fixtures/tiny] [--parity-level ci]
    pytest --pyargs parity.suites --backend my_pkg.my_engine:MyBackend

One test per (scenario, case, page size). A failure message names the failing operation, the
sequence, the worst KL and the first divergence found by tap-diff. ``parity.suites.faults`` holds
the fault-injecting backends used as negative controls.
"""
