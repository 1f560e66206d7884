"""A lock-free histogram for the per-token path: the relay observes it, /metrics renders it."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client.core import HistogramMetricFamily


class FastHistogram:
    """A lock-free histogram for the per-token path (one event loop thread writes it)."""

    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Record one value."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def observe_chunks(self, gap: float, chunks: int) -> None:
        """Record `chunks` tokens read together: the first after `gap`, the others right behind it (0 s)."""
        counts = self.counts
        counts[bisect_left(self.bounds, gap)] += 1
        if chunks > 1:
            counts[0] += chunks - 1
        self.total += gap
        self.count += chunks

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        buckets = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            buckets.append((repr(bound), running))
        buckets.append(("+Inf", self.count))
        family = HistogramMetricFamily(name, doc)
        family.add_metric([], buckets, self.total)
        return family
