"""Integrations at the edge: lm-evaluation-harness (:mod:`.lm_eval`), Ray sweeps
(:mod:`.ray`) and the papers' tables and pair studies (:mod:`.paper`).

The core (``kvbench.cache``, ``kvbench.attention``, ``kvbench.bench``, ``kvbench.report``, ...)
never imports this package; ``kvbench.cli`` and the entry points reach it.
"""
