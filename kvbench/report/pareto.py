"""Which points of a two-objective comparison are on the Pareto frontier."""

from __future__ import annotations


def pareto_mask(xs: list[float], ys: list[float], y_higher_better: bool = False) -> list[bool]:
    """True where a point is not dominated (lower x is better; y by its direction)."""
    out = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        dominated = False
        for j, (x2, y2) in enumerate(zip(xs, ys)):
            if i == j:
                continue
            better_y = y2 >= y if y_higher_better else y2 <= y
            strictly = x2 < x or (y2 > y if y_higher_better else y2 < y)
            if x2 <= x and better_y and strictly:
                dominated = True
                break
        out.append(not dominated)
    return out
