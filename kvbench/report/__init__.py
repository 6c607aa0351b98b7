"""Reporting: Markdown tables (:mod:`~kvbench.report.tables`, the ``kvbench report`` command),
plots, the headline table, the regression gate (:mod:`~kvbench.report.compare`) and the export of
a result folder.  Import the submodule you need; this package defines nothing."""
