"""The full-precision parts of the CPU code-domain attention (residual, sinks, ``full``'s whole
cache) are cast to float32 chunk by chunk along T (kvbench.kernels.cpu.codedomain.dense_logits /
dense_output); checked against a float64 matmul, with the chunk small enough that a part spans
several chunks and a shorter last one."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels.cpu import codedomain as cpu


def _parts(t: int, dtype=torch.float16):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 4, 16, generator=g)
    part = torch.randn(2, 3, t, 16, generator=g).to(dtype)
    return q, part


@pytest.mark.parametrize("t", [1, 5, 37, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_chunked_dense_parts_equal_float64(t, dtype, monkeypatch):
    # 2 x 3 x 16 float32 = 384 bytes per token: 5 tokens per chunk, so 37 tokens are 8 chunks
    monkeypatch.setattr(cpu, "DENSE_CHUNK_BYTES", 5 * 384)
    q, part = _parts(t, dtype)
    ref = torch.matmul(q.double(), part.double().transpose(-1, -2))
    lg = cpu.dense_logits(q, part)
    assert lg.dtype == torch.float32 and lg.shape == (2, 3, 4, t)
    torch.testing.assert_close(lg.double(), ref, rtol=1e-6, atol=1e-5)
    p = torch.softmax(lg, -1)
    out = cpu.dense_output(p, part)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 4, 16)
    torch.testing.assert_close(out.double(), torch.matmul(p.double(), part.double()),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


def test_the_pieces_fit_the_scratch(monkeypatch):
    monkeypatch.setattr(cpu, "DENSE_CHUNK_BYTES", 5 * 384)  # 5 tokens of [2, 3, ., 16]
    part = torch.randn(2, 3, 12, 16).half()
    pieces = [(t0, t1, x.shape, x.dtype) for t0, t1, x in cpu._float_pieces(part)]
    shape = lambda n: torch.Size([2, 3, n, 16])  # noqa: E731
    assert pieces == [
        (0, 5, shape(5), torch.float32),
        (5, 10, shape(5), torch.float32),
        (10, 12, shape(2), torch.float32),
    ]
    monkeypatch.setattr(cpu, "DENSE_CHUNK_BYTES", 1)  # never below one token
    assert [t1 - t0 for t0, t1, _ in cpu._float_pieces(part)] == [1] * 12
    # float32 parts are read as they are, in one piece
    assert [(t0, t1) for t0, t1, _ in cpu._float_pieces(part.float())] == [(0, 12)]


def test_a_long_part_allocates_one_chunk_not_a_float32_copy(monkeypatch):
    """The transient of the chunked logits: the output and one scratch chunk, far below the
    float32 copy of the part the one-matmul form makes (profiler allocator events)."""
    from kvbench.measure.peak import transient_peak

    chunk = 64 * 384  # bytes of one float32 chunk of 64 tokens
    monkeypatch.setattr(cpu, "DENSE_CHUNK_BYTES", chunk)
    q, part = _parts(4096)
    whole_copy = part.numel() * 4  # what part.float() would allocate: 1.5 MiB
    logits_bytes = 2 * 3 * 4 * 4096 * 4
    peak, _ = transient_peak(lambda: cpu.dense_logits(q, part), torch.device("cpu"))
    # the output, the scratch and one chunk's matmul result (<= a chunk)
    assert logits_bytes <= peak <= logits_bytes + 2 * chunk < whole_copy
    p = torch.rand(2, 3, 4, 4096)
    peak, _ = transient_peak(lambda: cpu.dense_output(p, part), torch.device("cpu"))
    assert chunk <= peak <= 2 * chunk < whole_copy / 8
