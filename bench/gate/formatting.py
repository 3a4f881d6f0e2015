"""The gate's tolerances (parsed and checked), noise allowances, short digests and JSON numbers; the
numbers themselves are formatted by ``bench.units``."""

from __future__ import annotations

import math
from typing import Any

from bench.units import format_percent


def check_tolerance(tolerance: float) -> None:
    if not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}")


def parse_tolerance(text: str | float) -> float:
    """``"5%"`` -> 0.05, ``"0.05"`` -> 0.05, ``"2.5 %"`` -> 0.025. Raises ValueError otherwise.

    A bare number must be a fraction in [0, 1) (``"5"`` is rejected as ambiguous); a percentage
    must be in [0, 100).
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        check_tolerance(float(text))
        return float(text)
    if not isinstance(text, str):
        raise ValueError(f"tolerance must be a string such as '5%' or '0.05', got {text!r}")
    raw = text.strip()
    percent = raw.endswith("%")
    number = raw[:-1].strip() if percent else raw
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"invalid tolerance {text!r}: expected a percentage such as '5%' or a fraction such as '0.05'"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"invalid tolerance {text!r}: must be a finite, non-negative number")
    if percent:
        if value >= 100:
            raise ValueError(f"invalid tolerance {text!r}: a percentage must be below 100%")
        return value / 100.0
    if value >= 1:
        raise ValueError(
            f"invalid tolerance {text!r}: a bare number is a fraction and must be below 1; "
            f"write '{raw}%' for a percentage"
        )
    return value


def format_noise(noise: float | None, exact: bool) -> str:
    """``noise 3.1%``, or ``exact value`` for a metric without a spread (no noise allowance)."""
    return "exact value" if exact and not noise else f"noise {format_percent(noise, 1)}"


def short(digest: str | None) -> str:
    return digest[:12] if digest else "-"


def json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
