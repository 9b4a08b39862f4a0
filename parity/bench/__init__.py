"""Benchmarks for ``qwen4exp bench``: synthetic real-width checkpoints (:mod:`.synthetic`), the
measurements run in worker processes (:mod:`.measure`), timing statistics (:mod:`.stats`), and the
planning/comparison/JSON/table layer (:mod:`.runner`). Speeds are reported, never asserted."""
