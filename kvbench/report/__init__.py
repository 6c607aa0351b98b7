"""Reporting: Markdown tables, plots, the regression gate (``compare``) and exports."""
