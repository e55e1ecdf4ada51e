"""YaRN's magnitude correction, plain math (configs read it without importing torch)."""

from __future__ import annotations

import math


def yarn_m(scale: float, mscale: float) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 when not scaling up)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
