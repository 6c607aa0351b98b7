"""Measurement: the one timing protocol of kvbench (:mod:`kvbench.measure.timer`), the
flush-aware split of decode steps (:mod:`kvbench.measure.window`), and the memory workload's
readings: the transient peak of a call (:mod:`kvbench.measure.peak`), allocator and heap
readings (:mod:`kvbench.measure.memstat`, :mod:`kvbench.measure.heap`).

``timer`` and ``window`` import only ``torch`` and the standard library, so ``benchmarks/``
uses them too.  Import the submodule you need; this package defines nothing.
"""
