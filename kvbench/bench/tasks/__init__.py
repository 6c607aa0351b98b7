"""The task workloads' base class and their model-free parts.

- :mod:`kvbench.bench.tasks.workload`: :class:`~kvbench.bench.tasks.workload.TaskWorkload`,
  the base of the task workloads (``gsm8k``, ``math``, ``ruler``, ...): example selection,
  prompts, per-example records.
- :mod:`kvbench.bench.tasks.extract`: GSM8K (lm-evaluation-harness filters) and MGSM answers.
- :mod:`kvbench.bench.tasks.math_answer`: MATH/AIME/AMC boxed-answer extraction and equivalence.
- :mod:`kvbench.bench.tasks.humaneval`: HumanEval problems, a subprocess test harness, pass@k.
- :mod:`kvbench.bench.tasks.synthetic`: RULER-style long-context generators (needle tasks, variable
  tracking; word-frequency tasks in :mod:`kvbench.bench.tasks.words`) and their scoring, built on
  :mod:`kvbench.bench.tasks.haystack` and :mod:`kvbench.bench.tasks.tokens`.

Submodules are imported on demand; importing this package loads nothing else.
"""
