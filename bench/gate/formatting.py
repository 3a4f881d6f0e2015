"""Numbers, ratios, percentages, bytes and tolerances as the gate's reports print them."""

from __future__ import annotations

import math
from typing import Any


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


def format_number(value: float | None) -> str:
    """Compact: integers below a million exactly (1000), else 4 significant digits (812.5, 0.4321,
    1.288e+10, 1.2e-07)."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 1e6 or (0 < magnitude < 1e-4):
        return f"{value:.4g}"
    if value == int(value):
        return str(int(value))
    decimals = max(0, 3 - math.floor(math.log10(magnitude)))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.3f}" if math.isfinite(ratio) else str(ratio)


def format_percent(fraction: float | None, decimals: int | None = None) -> str:
    """0.05 -> "5%", 0.025 -> "2.5%"; with ``decimals``: 0.0312 -> "3.1%"."""
    if fraction is None:
        return "-"
    if decimals is None:
        return f"{fraction * 100:.4g}%"
    return f"{fraction * 100:.{decimals}f}%"


def format_signed_percent(fraction: float) -> str:
    """0.0312 -> "+3.1%", -0.5 -> "-50.0%"; changes below 0.05% keep two significant digits (+0.0012%)."""
    percent = fraction * 100
    return f"{percent:+.1f}%" if abs(percent) >= 0.05 or percent == 0 else f"{percent:+.2g}%"


def format_bytes(value: float) -> str:
    """Binary units: 512 -> "512 B", 4194304 -> "4 MiB", 1536 -> "1.5 KiB"."""
    magnitude, unit = abs(value), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if magnitude < 1024 or unit == "TiB":
            break
        magnitude /= 1024
    sign = "-" if value < 0 else ""
    return f"{sign}{magnitude:.4g} {unit}"


def signed_bytes(value: float) -> str:
    return ("+" if value >= 0 else "") + format_bytes(value)


def signed_count(value: float) -> str:
    return f"{int(value):+d}" if value == int(value) else f"{value:+g}"


def signed_number(value: float) -> str:
    return ("+" if value >= 0 else "") + format_number(value)


def format_noise(noise: float | None, exact: bool) -> str:
    """``noise 3.1%``, or ``exact value`` for a metric without a spread (no noise allowance)."""
    return "exact value" if exact and not noise else f"noise {format_percent(noise, 1)}"


def short(digest: str | None) -> str:
    return digest[:12] if digest else "-"


def json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
