"""The parity harness: logit-KL comparison (``kl``), the scenario suites (``scenarios``), failure
location, reports and snapshot files. Drives backends only through :mod:`parity.backends`."""
