"""Helpers shared by the profiles here and the benchmarks (`bench`): the order of interleaved
runs."""

from __future__ import annotations

from typing import Any


def round_order(items: list[Any], i: int) -> list[Any]:
    """Round `i`'s order of interleaved runs: rotated by one each round, so every run takes
    every place in turn and none always follows the same one (or itself, from the round
    before: the run that goes first finds its own weights still in the CPU's caches)."""
    k = i % len(items) if items else 0
    return items[k:] + items[:k]
