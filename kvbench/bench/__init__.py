"""The run harness: suite parsing, the runner (suite -> runs -> records), atomic records with
resume, and the manifest; the workloads (:mod:`kvbench.bench.workloads`, one module per
registered type) and what they share: metric computations and directions
(:mod:`kvbench.bench.metrics`), padded batches (:mod:`kvbench.bench.batching`), decoding
through a model with a method's cache (:mod:`kvbench.bench.decoding`), synthetic Q/K/V
(:mod:`kvbench.bench.synthetic_kv`) and the task workloads' base and helpers
(:mod:`kvbench.bench.tasks`).
"""
