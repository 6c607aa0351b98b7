"""How much of the KV cache the scored positions of an lm-eval run read quantized.

A prompt shorter than a method's full-precision residual is never quantized, so its scores
equal ``full``'s.  The backend logs, per request, the share of the past its scored (or
generated) positions read from quantized storage (``quantized_fraction``) and how many past
tokens they read (``past_tokens_read``); :func:`per_task` weighs those by the tokens read, and
:func:`low_coverage_message` says when a task stays below a threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

#: default ``min_quantized_fraction`` of the backend: warn below it
DEFAULT_MIN_QUANTIZED_FRACTION = 0.5


class LowQuantizedFractionWarning(UserWarning):
    """A task's scored positions read less of their past quantized than the set threshold."""


class RequestEntry(TypedDict, total=False):
    """One lm-eval request as the backend logs it (``KVBenchLM.request_log``): lm-eval's
    ``task``, ``doc_id`` and ``idx``, its ``request_type``, its ``index`` in the batch, the
    ``context_tokens`` and ``scored_tokens`` it fed, and of the past its scored positions read:
    ``past_tokens_read`` tokens, ``quantized_fraction`` of them quantized (``None``: a cache
    that is not kvbench's).  ``reads`` (per scored position: quantized tokens read, past
    tokens) is there only while the request runs."""

    task: str | None
    doc_id: int | None
    idx: int
    request_type: str
    index: int
    reads: list[tuple[float | None, int]]
    context_tokens: int
    scored_tokens: int
    quantized_fraction: float | None
    past_tokens_read: int


def quantized_fraction(entries: Sequence[RequestEntry]) -> float | None:
    """Quantized tokens read / past tokens read over ``entries`` (request-log entries);
    ``None`` when some entry was not measured (a cache that is not kvbench's: a peer), 0 when
    no past token was read."""
    if any(e["quantized_fraction"] is None for e in entries):
        return None
    past = sum(e["past_tokens_read"] for e in entries)
    q = sum(e["quantized_fraction"] * e["past_tokens_read"] for e in entries)
    return q / past if past else 0.0


def per_task(log: Sequence[RequestEntry]) -> dict[str | None, float | None]:
    """Task name -> :func:`quantized_fraction` of its requests, tasks in first-seen order."""
    by_task: dict[str | None, list[RequestEntry]] = {}
    for e in log:
        by_task.setdefault(e["task"], []).append(e)
    return {task: quantized_fraction(entries) for task, entries in by_task.items()}


def mean_context(log: Sequence[RequestEntry], task: str | None) -> float:
    """Mean context tokens of ``task``'s requests (0 when none)."""
    ctx = [e["context_tokens"] for e in log if e["task"] == task]
    return sum(ctx) / len(ctx) if ctx else 0.0


def low_coverage_message(
    fractions: dict[str | None, float | None],
    log: Sequence[RequestEntry],
    threshold: float,
    method: str,
    residual: int | None,
) -> str | None:
    """The warning for the tasks whose fraction is below ``threshold`` (``None`` if none).

    Names each such task with its fraction and mean context length, the method (and its
    ``residual_length`` when it has one), and what to change."""
    low = {t: f for t, f in fractions.items() if f is not None and f < threshold}
    if not low:
        return None
    tasks = "; ".join(
        f"{t}: {f:.3f} (mean context {mean_context(log, t):.0f} tokens)" for t, f in low.items()
    )
    res = f" with residual_length={residual}" if residual is not None else ""
    return (
        f"kvbench: kv_quantized_fraction below min_quantized_fraction={threshold:g} for "
        f"method {method!r}{res}: {tasks}. Contexts shorter than the method's full-precision "
        "part are never quantized, so these scores are close to (or equal) full's. Use longer "
        "prompts (more few-shot examples) or a smaller residual_length; set "
        "min_quantized_fraction=0 in --model_args to silence this."
    )
