"""The transformers bridge: the ``Cache`` subclass, the registered attention function, the
transformers peers, Q/K/V capture and model loading.
"""
