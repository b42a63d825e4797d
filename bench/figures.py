"""How the benchmarks round the figures they print.

Owns one rule: measured rates and durations keep a fixed number of significant figures,
never a fixed number of decimals, so a small positive figure (a slow machine's GB/s, a
fast machine's pause) is never printed as 0. Never measures anything itself.
"""

from __future__ import annotations

import math


def significant(value: float, digits: int = 3) -> float:
    """`value` to `digits` significant figures (0, inf and nan as they are)."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))
