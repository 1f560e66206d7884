"""Per-GPU vendor queries that survive failures: a failing query loses its field, not the GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class GpuQueries:
    """One GPU's queries; the GPU turns unhealthy only when `is_bad` says an error means a bad GPU."""

    def __init__(
        self,
        errors: tuple[type[BaseException], ...],
        is_bad: Callable[[BaseException], bool],
        describe: Callable[[BaseException], str] = str,
    ) -> None:
        self.errors = errors
        self.is_bad = is_bad
        self.describe = describe
        self.problems: list[str] = []

    def get(self, what: str, call: Callable[[], Any]) -> Any:
        """`call()`, or None when the vendor library raises one of `errors` (noted if it means a bad GPU)."""
        try:
            return call()
        except self.errors as exc:
            if self.is_bad(exc):
                self.problems.append(f"{what}: {self.describe(exc)}")
            return None
