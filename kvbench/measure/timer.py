"""The one timing protocol of kvbench: the latency workload and ``benchmarks/`` (the Triton
device check ``benchmarks/triton_decode.py`` included) all time through this module, so their
numbers compare.

Protocol
--------
1. **Threads.**  CPU runs pin the intra-op thread count first (:func:`pin_threads`; the
   benchmarks default to 1: on a shared machine 2+ OpenMP threads spin at barriers and every
   step becomes a multiple of the scheduler's quantum).  The count and the load average
   (``os.getloadavg``) are recorded with every result (:func:`system_state`).
2. **Warm-up.**  Every configuration runs ``warmup`` untimed calls first (allocator, caches,
   ``torch.compile`` specialization), in the same interleaved order as the timed calls.
3. **Interleaving.**  Configurations are timed round by round, one call of each per round, in
   a rotating order (:func:`rotation`: round ``i`` starts at configuration ``i mod n``; for
   two: A B, B A, A B, ...), so drift of a busy machine hits all alike.  Ratios are only
   taken between configurations of the same interleaved run (:func:`ratios`).
4. **One call, one sample.**  CPU: ``time.perf_counter_ns`` immediately around the call.
   CUDA: ``torch.cuda.synchronize()``, then CUDA events recorded around the call, then a
   synchronize; the sample is ``start.elapsed_time(end)``.  Optionally (``cuda_graphs=True``,
   :meth:`Timer.graph`) the call is captured once in a CUDA graph and the replay is timed (no
   host launch overhead; falls back to eager if capture fails, recorded in ``Timer.how`` with
   the first failure's exception).
5. **Statistics.**  Median, p90, p99, mean, min, max of the samples in milliseconds
   (:func:`summarize`), percentiles by :data:`PERCENTILE_RULE`.
6. **Bandwidth reference.**  :func:`contiguous_read` times a read of one contiguous buffer of
   a given size by the same protocol, so an achieved bandwidth (bytes a step must read / its
   time) can be set against what the same machine, thread count and moment allow.

Only ``torch`` and the standard library are imported.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import torch

#: how :func:`percentile` reads a percentile (stated in every result that uses it)
PERCENTILE_RULE = (
    "linear interpolation between order statistics (Hyndman-Fan type 7, numpy's default): "
    "for sorted x[0..n-1], h = (n - 1) q / 100, P_q = x[floor h] + (h - floor h) "
    "(x[floor h + 1] - x[floor h])"
)


def percentile(xs: Sequence[float], q: float) -> float:
    """Percentile ``q`` (0..100) of ``xs`` by :data:`PERCENTILE_RULE`.

    Raises ``ValueError`` for no samples or ``q`` outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside [0, 100]")
    s = sorted(xs)
    if not s:
        raise ValueError("no samples")
    h = (len(s) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (h - lo)


@dataclass(frozen=True)
class Stats:
    """Summary of timing samples (all in milliseconds; ``n`` samples)."""

    n: int
    median: float
    p90: float
    p99: float
    mean: float
    min: float
    max: float

    def as_dict(self, prefix: str = "", suffix: str = "") -> dict[str, float]:
        """``{prefix + field + suffix: value}`` for every field."""
        return {f"{prefix}{k}{suffix}": v for k, v in asdict(self).items()}


def summarize(ms: Sequence[float]) -> Stats:
    """:class:`Stats` of samples ``ms`` (milliseconds).  ``ValueError`` for no samples."""
    if not ms:
        raise ValueError("no samples")
    return Stats(
        n=len(ms),
        median=percentile(ms, 50),
        p90=percentile(ms, 90),
        p99=percentile(ms, 99),
        mean=sum(ms) / len(ms),
        min=min(ms),
        max=max(ms),
    )


def ratios(a: Stats, b: Stats) -> dict[str, float]:
    """``a / b`` for median, p90, p99 and mean (NaN where ``b`` is 0); ``a`` and ``b`` must
    come from the same interleaved run."""
    pairs = {
        "median": (a.median, b.median),
        "p90": (a.p90, b.p90),
        "p99": (a.p99, b.p99),
        "mean": (a.mean, b.mean),
    }
    return {k: (x / y if y else float("nan")) for k, (x, y) in pairs.items()}


def rotation(names: Sequence[str], i: int) -> list[str]:
    """The order of round ``i``: ``names`` rotated left by ``i mod len(names)``."""
    if not names:
        return []
    k = i % len(names)
    return list(names[k:]) + list(names[:k])


class Timer:
    """Milliseconds of one call, by the module's protocol (step 4).

    Parameters
    ----------
    device : where the timed work runs (``cuda``: events + synchronize; else perf_counter).
    cuda_graphs : on CUDA, :meth:`graph` captures calls in a CUDA graph.
    """

    def __init__(self, device: torch.device | str | None = None, cuda_graphs: bool = False):
        self.device = torch.device(device or "cpu")
        self.cuda = self.device.type == "cuda"
        self.cuda_graphs = bool(cuda_graphs and self.cuda)
        self.graph_failures = 0
        #: ``"<exception type>: <message>"`` (one line, at most 200 characters of the message)
        #: of each failed capture, in order
        self.graph_errors: list[str] = []

    @property
    def how(self) -> str:
        """The timing method, for the record."""
        if not self.cuda:
            return "time.perf_counter_ns"
        how = "cuda events (synchronized)"
        if self.cuda_graphs:
            how += ", cuda graph replay"
            if self.graph_failures:
                first = self.graph_errors[0] if self.graph_errors else "?"
                how += f" ({self.graph_failures} capture(s) failed: eager; first: {first})"
        return how

    def __call__(self, fn: Callable[[], object]) -> float:
        """Run ``fn()`` once and return its time in ms."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return float(start.elapsed_time(end))
        t0 = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t0) / 1e6

    def graph(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` captured in a CUDA graph (its replay), or ``fn`` itself when graphs are off,
        on CPU, or when capture fails (counted in ``graph_failures``, the exception kept in
        ``graph_errors`` and named by :attr:`how`).  Capture runs ``fn``
        twice on a side stream first, as CUDA graph capture requires."""
        if not self.cuda_graphs:
            return fn
        try:
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return g.replay
        # anything ``fn`` or the capture raises (a RuntimeError for an operation CUDA graphs
        # cannot capture, most likely): not capturable, so it is timed eagerly; kept in
        # graph_errors and reported in ``how`` (the timing method of the result)
        except Exception as exc:  # noqa: BLE001 - capture errors -> graph_errors, how
            torch.cuda.synchronize(self.device)
            self.graph_failures += 1
            self.graph_errors.append(f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
            return fn


def interleave(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = 0,
    timer: Timer | None = None,
    after: Callable[[str, int, float | None], None] | None = None,
) -> dict[str, list[float]]:
    """Time the configurations ``fns`` by steps 2-4 of the protocol.

    ``warmup`` untimed rounds, then ``rounds`` timed ones; round ``i`` (counting warm-up
    rounds, from 0) calls the configurations in :func:`rotation` ``(names, i)`` order.
    ``after(name, i, ms)``, if given, runs after every call outside the timed region (``ms``
    is ``None`` for warm-up calls), e.g. to inspect the state the call left.  Returns the
    timed samples in ms, per name, in round order.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    timer = timer or Timer()
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + rounds):
        for name in rotation(names, i):
            if i < warmup:
                fns[name]()
                ms = None
            else:
                ms = timer(fns[name])
                out[name].append(ms)
            if after is not None:
                after(name, i, ms)
    return out


@contextlib.contextmanager
def pin_threads(n: int | None) -> Iterator[int]:
    """Set ``torch.set_num_threads(n)`` for the block (``None``: leave it) and restore it;
    yields the count in force."""
    before = torch.get_num_threads()
    if n is not None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"threads={n!r} must be a positive integer")
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def system_state() -> dict[str, list[float] | int | str | None]:
    """What a timing depends on: load average (1, 5, 15 min; ``None`` where the platform has
    none), intra-op threads, CPU count, ``OMP_WAIT_POLICY``, torch version."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        load = None
    return {
        "loadavg": load,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch": torch.__version__,
    }


def contiguous_read(
    nbytes: int,
    device: torch.device | str | None = None,
    reps: int = 20,
    warmup: int = 3,
    timer: Timer | None = None,
) -> dict[str, float]:
    """Read bandwidth of one contiguous buffer of ``nbytes`` (rounded up to float32 elements):
    the median time of ``buf.sum()`` (every byte read once, nothing written but a scalar) over
    ``reps`` calls after ``warmup``.  Returns ``bytes``, ``median_ms`` and ``gbps``
    (bytes / median seconds / 1e9)."""
    if nbytes < 4:
        raise ValueError(f"nbytes={nbytes} must be at least 4")
    timer = timer or Timer(device)
    buf = torch.ones(-(-nbytes // 4), dtype=torch.float32, device=timer.device)
    fn = timer.graph(lambda: buf.sum())
    ms = interleave({"read": fn}, rounds=reps, warmup=warmup, timer=timer)["read"]
    med = percentile(ms, 50)
    return {"bytes": buf.nbytes, "median_ms": med, "gbps": buf.nbytes / (med / 1e3) / 1e9}
