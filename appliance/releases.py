"""vLLM release numbers: how they compare, and which release pdctl read answers a question for a given one."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def version_tuple(version: str) -> tuple[int, ...]:
    """'0.32.0+cpu' -> (0, 32, 0): the release numbers, for comparisons."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def answer_for(version: str, answers: Mapping[str, T]) -> T | None:
    """What holds for vLLM `version`, from `answers` found by reading some releases' code (release -> answer).

    A release of the same minor line as a read one answers as it does (0.32.1 as 0.32.0); one newer than every
    read release as the newest (until one is read and found otherwise); one between two read releases as both
    when they agree. None where that cannot tell: an unknown version, one older than every read release, or one
    between two that disagree.
    """
    wanted = version_tuple(version)[:2]
    if len(wanted) < 2 or not answers:
        return None
    read = sorted(answers, key=version_tuple)
    lines = [version_tuple(release)[:2] for release in read]
    if wanted in lines:
        return answers[read[lines.index(wanted)]]
    if wanted > lines[-1]:
        return answers[read[-1]]
    if wanted < lines[0]:
        return None
    after = next(n for n, line in enumerate(lines) if line > wanted)
    before, later = answers[read[after - 1]], answers[read[after]]
    return before if before == later else None
