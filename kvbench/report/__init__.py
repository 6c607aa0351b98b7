"""Reporting: Markdown tables, plots, the regression gate (``compare``) and paper comparisons.

``kvbench.report`` re-exports :mod:`kvbench.report.tables` (its old flat location).
"""

from kvbench.report.tables import *  # noqa: F401,F403
from kvbench.report.tables import add_arguments, label_of, main, summary_table  # noqa: F401
