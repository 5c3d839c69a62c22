"""Lengths of unions of time intervals: how much communication no compute covered (no torch; engine and planner)."""

Intervals = list[tuple[float, float]]


def union(intervals: Intervals) -> Intervals:
    """The same time as sorted, disjoint intervals (overlapping or touching ones merged)."""
    merged: Intervals = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Intervals) -> float:
    """The summed length of ``intervals`` (of their union, when they are disjoint)."""
    return sum(end - start for start, end in intervals)


def _covered(a: Intervals, b: Intervals) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def uncovered(intervals: Intervals, cover: Intervals) -> float:
    """Length of the union of ``intervals`` outside the union of ``cover``: comm that no compute hid."""
    intervals_u = union(intervals)
    return length(intervals_u) - _covered(intervals_u, union(cover))
