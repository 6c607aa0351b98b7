"""Model-free parts of the task suites.

- :mod:`kvbench.tasks.extract`: GSM8K (lm-evaluation-harness filters), MGSM and, re-exported
  from :mod:`kvbench.tasks.math_answer`, MATH/AIME/AMC boxed-answer extraction and equivalence.
- :mod:`kvbench.tasks.humaneval`: HumanEval problems, a subprocess test harness, pass@k.
- :mod:`kvbench.tasks.synthetic`: RULER-style long-context generators (needle tasks, variable
  tracking; word-frequency tasks in :mod:`kvbench.tasks.words`) and their scoring, built on
  :mod:`kvbench.tasks.haystack` and :mod:`kvbench.tasks.tokens`.

Submodules are imported on demand; importing this package loads nothing else.
"""
