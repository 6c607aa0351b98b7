"""The cache data model: quantizer, stored blocks and layouts, flush schedules, the layer cache,
the method interface and the method registry.  Imports nothing from the rest of kvbench.
"""
