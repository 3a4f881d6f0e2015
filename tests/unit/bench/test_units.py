"""bench.units: the report's numbers, checked against hand-written text."""

from __future__ import annotations

import pytest

from bench.units import (
    GIB,
    MIB,
    axis_scale,
    format_bytes,
    format_gib,
    format_memory,
    format_percent,
    format_signed_bytes,
    format_signed_percent,
    format_significant,
    format_value,
)


@pytest.mark.parametrize(
    "value, unit, text",
    [
        (171_917_901_824, "bytes", "160.11 GiB"),  # 171917901824 / 2**30 = 160.111...
        (2 * GIB, "bytes", "2.00 GiB"),
        (52_428_800, "bytes", "50.0 MiB"),
        (1536, "bytes", "1.5 KiB"),
        (12_815.39, "tokens/s", "12,815 tokens/s"),
        (52_000, "tokens/s", "52,000 tokens/s"),
        (12.8154, "tokens/s", "12.8 tokens/s"),
        (0.23024, "TFLOP/s", "0.230 TFLOP/s"),
        (858.2, "TFLOP/s", "858 TFLOP/s"),
        (1234.5, "TFLOP/s", "1,234 TFLOP/s"),
        (0.0042317, "TFLOP/s", "0.00423 TFLOP/s"),
        (0.0123, "s", "12.3 ms"),
        (2.048, "s", "2.05 s"),
        (40_910.8, "s", "11.4 h"),
        (0.4217, "ratio", "42.2%"),
        (46_865_731_584, "params", "46.87 B params"),
        (3_177_861_120, "params", "3.18 B params"),
        (19.07e9, "FLOP", "19.1 GFLOP"),
        (2048, "tokens", "2,048 tokens"),
        (3, "count", "3"),
        (6.9312, "nats", "6.931 nats"),
        (None, "bytes", "-"),
    ],
)
def test_format_value(value, unit, text):
    assert format_value(value, unit) == text


def test_significant_never_writes_an_exponent():
    assert format_significant(1.2e-7) == "0.000000120"
    assert format_significant(123456789.0) == "123,456,789"


@pytest.mark.parametrize(
    "unit, values, factor, label",
    [
        ("bytes", [100 * MIB, 3 * GIB], GIB, "GiB"),
        ("bytes", [100 * MIB, 300 * MIB], MIB, "MiB"),
        ("s", [0.5, 0.9], 1e-3, "ms"),
        ("s", [0.5, 2.0], 1.0, "s"),
        ("ratio", [0.4], 0.01, "%"),
        ("tokens/s", [52_000], 1.0, "tokens/s"),
    ],
)
def test_axis_scale(unit, values, factor, label):
    scale = axis_scale(unit, values)
    assert (scale.factor, scale.label) == (factor, label)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (format_gib(171917901824), "160.11 GiB"),
        (format_gib(171917901824, decimals=1), "160.1 GiB"),
        (format_gib(1500 * GIB), "1,500.00 GiB"),
        (format_memory(52428800), "50.0 MiB"),
        (format_memory(3 * GIB + GIB // 4, decimals=1), "3.2 GiB"),
        (format_memory(1536), "1.5 KiB"),
        (format_memory(0), "0 B"),
        (format_bytes(512), "512 B"),
        (format_bytes(4 * MIB), "4 MiB"),
        (format_bytes(1536), "1.5 KiB"),
        (format_bytes(-3 * GIB), "-3 GiB"),
        (format_bytes(5 * 1024 * 2**40), "5120 TiB"),
        (format_signed_bytes(2 * MIB), "+2 MiB"),
        (format_signed_bytes(-2 * MIB), "-2 MiB"),
    ],
)
def test_bytes_as_every_report_writes_them(text, expected):
    """The run summary, the plan line, the page (GiB, MiB) and the gate's work lines (compact binary units)."""
    assert text == expected


@pytest.mark.parametrize(
    ("fraction", "decimals", "expected"),
    [
        (0.05, None, "5%"),  # 5 to 4 significant digits, trailing zeros dropped by "g"
        (0.025, None, "2.5%"),
        (0.123456, None, "12.35%"),  # 12.3456 -> 4 significant digits
        (None, None, "-"),
        (0.123, 1, "12.3%"),  # the page's noise column and the plan chart's shares
        (0.0312, 1, "3.1%"),
        (0.4217, 1, "42.2%"),
        (0.876, 0, "88%"),  # the memory chart's "of capacity"
        (1.0, 1, "100.0%"),
    ],
)
def test_format_percent_both_forms(fraction, decimals, expected):
    assert format_percent(fraction, decimals) == expected


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [
        (0.0312, "+3.1%"),
        (-0.5, "-50.0%"),
        (-0.2, "-20.0%"),
        (0.0, "+0.0%"),
        (0.0006, "+0.1%"),  # from 0.05% up: one decimal
        (0.000012, "+0.0012%"),  # below 0.05%: two significant digits, never "+0.0%"
        (-0.00031, "-0.031%"),
    ],
)
def test_format_signed_percent_never_hides_a_change(fraction, expected):
    """The report page's change column and the gate's work lines write a relative change the same way."""
    assert format_signed_percent(fraction) == expected
