"""Benchmarks are not part of ``make test``; ``make bench-micro`` runs them."""
