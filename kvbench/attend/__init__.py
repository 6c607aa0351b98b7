"""Attention over a layer cache: the reference (dequantize-and-softmax) math and the CPU
code-domain backend.  The Triton backend lives in ``kvbench.kernels``.
"""
