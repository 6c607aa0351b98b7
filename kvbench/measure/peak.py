"""The transient peak of one call: bytes allocated during it above the level before it
(:func:`transient_peak`; the memory workload's ``peak_step_bytes``, docs/design.md#memory).

CUDA reads the caching allocator's peak counter; CPU replays the allocation and free events of
a ``torch.profiler`` memory profile (:func:`cpu_allocator_events`, :func:`live_peak`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbench.measure.stderr_filter import drop_stderr_lines


def transient_peak(fn: Callable[[], object], device: torch.device) -> tuple[float, str]:
    """Run ``fn()`` and return (peak bytes allocated during it above the level before it, how).

    CUDA: ``max_memory_allocated()`` after ``reset_peak_memory_stats()`` minus
    ``memory_allocated()`` before.  CPU: the running sum of the CPU allocator's allocation and
    free events recorded by ``torch.profiler`` (``profile_memory=True``), a free counted only
    when it releases a block allocated inside the call (paired by address, not by the size the
    profiler reports, which for an older block may be stale: docs/design.md#memory): frees of
    blocks allocated before the call are left out, so the figure is the peak of the call's own
    live allocations.  Without the profiler's memory events the peak is NaN and ``how`` says why.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        m0 = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - m0, "torch.cuda.max_memory_allocated"
    from torch.profiler import ProfilerActivity, profile

    # the allocator logs the (uncounted) free of a block from before the profile: dropped
    with drop_stderr_lines():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    try:
        events = cpu_allocator_events(prof)
    except (AttributeError, RuntimeError) as exc:  # a torch without allocation events
        return float("nan"), f"unavailable ({type(exc).__name__}: {exc})"
    return live_peak(events), (
        "torch.profiler CPU allocator events (profile_memory=True), frees paired by address"
    )


def cpu_allocator_events(prof: torch.profiler.profile) -> list[tuple[int, int, int]]:
    """``(time ns, address, signed bytes)`` of every CPU allocation (+) and free (-) a finished
    ``torch.profiler.profile(profile_memory=True)`` recorded, in time order.  Raises
    ``AttributeError``/``RuntimeError`` where the torch build has no allocation events."""
    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        f = e.extra_fields
        if hasattr(f, "alloc_size") and str(f.device).startswith("cpu"):
            out.append((e.start_time_ns, f.ptr, f.alloc_size))
    out.sort()
    return out


def live_peak(events: list[tuple[int, int, int]]) -> int:
    """Peak of the running sum of ``(time, address, signed bytes)`` allocator events, counting
    a free only against the live block allocated at its address within the events (its own
    size): frees of blocks from before the events are not the call's."""
    cur = peak = 0
    live: dict[int, int] = {}
    for _, ptr, n in events:
        if n >= 0:
            live[ptr] = n
            cur += n
            peak = max(peak, cur)
        elif ptr in live:
            cur -= live.pop(ptr)
    return peak
