"""Numbers as people read them: GiB, tokens/s with thousands separators, TFLOP/s, percentages.

``format_value(value, unit)`` is the text of one metric value in the report (tables, hover labels);
``axis_scale(unit, values)`` is the factor and label of a chart axis showing such values, so that an
axis reads ``peak memory (GiB)`` rather than ``1e10``. Units are the result documents' ``unit``
strings (``bytes``, ``tokens/s``, ``TFLOP/s``, ``s``, ``ratio``, ``params``, ``FLOP``, ...).

Every function that turns a number into text is named ``format_*``: the prefix says the result is text
(``bench.run.profile.curves.round_significant`` rounds and stays a number), and the quantity after it
never doubles as a local variable name (``memory``, ``count``, ``percent``). Two forms coexist on
purpose: the report's (``format_significant``, ``format_memory``: fixed digits, thousands separated)
and the gate's compact one (``format_number``, ``format_bytes``: 4 significant digits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

GIB = 2**30
MIB = 2**20
KIB = 2**10


def format_significant(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits, thousands separated, never in exponent form:
    12815.39 -> "12,815", 0.0042317 -> "0.00423", 46.87 -> "46.9"."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def format_percent(fraction: float | None, decimals: int | None = None) -> str:
    """A fraction in percent: 0.05 -> "5%", 0.025 -> "2.5%" (4 significant digits); with ``decimals``
    that many after the point: 0.123 -> "12.3%" (``decimals=1``); "-" for None."""
    if fraction is None:
        return "-"
    if decimals is None:
        return f"{fraction * 100:.4g}%"
    return f"{fraction * 100:.{decimals}f}%"


def format_signed_percent(fraction: float) -> str:
    """A relative change: 0.0312 -> "+3.1%", -0.5 -> "-50.0%"; a change below 0.05% keeps two significant
    digits (0.000012 -> "+0.0012%") so that it never reads as "+0.0%"."""
    in_percent = fraction * 100
    return f"{in_percent:+.1f}%" if abs(in_percent) >= 0.05 or in_percent == 0 else f"{in_percent:+.2g}%"


def format_gib(n_bytes: float, decimals: int = 2) -> str:
    """Bytes in GiB: 171917901824 -> "160.11 GiB" (``decimals=1``: "160.1 GiB")."""
    return f"{n_bytes / GIB:,.{decimals}f} GiB"


def format_count(n: float, digits: int = 3) -> str:
    """A count (parameters) in T, B, M or K with ``digits`` significant digits: 1193.9e9 -> "1.19T",
    47.1e9 -> "47.1B", 3.2e6 -> "3.2M", 512 -> "512"."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            text = format_significant(n / scale, digits)
            return (text.rstrip("0").rstrip(".") if "." in text else text) + suffix
    return f"{n:,.0f}"


def format_memory(n_bytes: float, decimals: int = 2) -> str:
    """GiB from 1 GiB up (``decimals`` of them), else MiB with one decimal (or KiB, B): 52428800 -> "50.0 MiB"."""
    magnitude = abs(n_bytes)
    if magnitude >= GIB:
        return format_gib(n_bytes, decimals)
    if magnitude >= MIB:
        return f"{n_bytes / MIB:,.1f} MiB"
    if magnitude >= KIB:
        return f"{n_bytes / KIB:,.1f} KiB"
    return f"{n_bytes:,.0f} B"


def format_tokens_per_s(value: float) -> str:
    """12815.39 -> "12,815 tokens/s"; below 100 one decimal: "12.8 tokens/s"."""
    return f"{value:,.0f} tokens/s" if abs(value) >= 100 else f"{value:,.1f} tokens/s"


def format_tflops(value: float) -> str:
    """0.23024 -> "0.230 TFLOP/s", 858.2 -> "858 TFLOP/s" (3 significant digits)."""
    return f"{format_significant(value)} TFLOP/s"


def format_duration(seconds: float) -> str:
    """0.0123 -> "12.3 ms", 1.5 -> "1.50 s", 40910 -> "11.4 h"."""
    magnitude = abs(seconds)
    if magnitude < 1e-3:
        return f"{format_significant(seconds * 1e6)} us"
    if magnitude < 1:
        return f"{format_significant(seconds * 1e3)} ms"
    if magnitude < 600:
        return f"{format_significant(seconds)} s"
    if magnitude < 3 * 3600:
        return f"{format_significant(seconds / 60)} min"
    return f"{format_significant(seconds / 3600)} h"


_SCALED = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _scaled(value: float, unit: str, separator: str = " ") -> str:
    for scale, prefix in _SCALED:
        if abs(value) >= scale:
            return f"{format_significant(value / scale)}{separator}{prefix}{unit}"
    return f"{format_significant(value)}{separator}{unit}".rstrip()


def format_value(value: float | None, unit: str) -> str:
    """One metric value with its unit, as the report shows it; "-" for None."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    if unit == "bytes":
        return format_memory(value)
    if unit == "tokens/s":
        return format_tokens_per_s(value)
    if unit == "TFLOP/s":
        return format_tflops(value)
    if unit == "s":
        return format_duration(value)
    if unit == "ratio":
        return format_percent(value, 1)
    if unit == "params":
        for scale, word in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
            if abs(value) >= scale:
                return f"{value / scale:,.2f} {word} params"
        return f"{value:,.0f} params"
    if unit == "FLOP":
        return _scaled(value, "FLOP")
    if unit == "tokens":
        return f"{value:,.0f} tokens" if value == int(value) else f"{format_significant(value)} tokens"
    if unit in ("count", ""):
        return f"{value:,.0f}" if value == int(value) else format_significant(value)
    return f"{format_significant(value, 4)} {unit}"


@dataclass(frozen=True)
class AxisScale:
    """How a chart axis shows values of one unit."""

    factor: float
    """Values are divided by this before they are drawn."""
    label: str
    """The unit on the axis title (``GiB``, ``tokens/s``, ``ms``, ``%``)."""
    tickformat: str
    """A d3 format for the tick labels (``,.0f``: thousands separated)."""


def axis_scale(unit: str, values: Iterable[float]) -> AxisScale:
    """The axis for ``values`` of ``unit``: bytes in GiB (MiB when all are below 1 GiB), seconds in ms
    when all are below a second, ratios in percent, tokens/s with thousands separators."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    top = max(finite, default=0.0)
    if unit == "bytes":
        return AxisScale(GIB, "GiB", ",.2f") if top >= GIB else AxisScale(MIB, "MiB", ",.1f")
    if unit == "s":
        return AxisScale(1.0, "s", ",.3~g") if top >= 1 else AxisScale(1e-3, "ms", ",.3~g")
    if unit == "ratio":
        return AxisScale(0.01, "%", ",.1f")
    if unit in ("tokens/s", "tokens"):
        return AxisScale(1.0, unit, ",.0f" if top >= 100 else ",.1f")
    if unit == "params":
        return AxisScale(1e9, "B params", ",.2f") if top >= 1e9 else AxisScale(1e6, "M params", ",.1f")
    if unit == "FLOP":
        return AxisScale(1e9, "GFLOP", ",.3~g")
    return AxisScale(1.0, unit, ",.3~g")


# The gate's compact forms: a comparison's table and its work-counter lines.


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


def format_bytes(value: float) -> str:
    """Binary units: 512 -> "512 B", 4194304 -> "4 MiB", 1536 -> "1.5 KiB"."""
    magnitude, unit = abs(value), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if magnitude < 1024 or unit == "TiB":
            break
        magnitude /= 1024
    sign = "-" if value < 0 else ""
    return f"{sign}{magnitude:.4g} {unit}"


def format_signed_bytes(value: float) -> str:
    return ("+" if value >= 0 else "") + format_bytes(value)


def format_signed_count(value: float) -> str:
    return f"{int(value):+d}" if value == int(value) else f"{value:+g}"


def format_signed_number(value: float) -> str:
    return ("+" if value >= 0 else "") + format_number(value)
