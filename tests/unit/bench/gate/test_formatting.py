"""bench.gate.formatting: tolerances parsed and checked, the noise text, short digests, JSON numbers."""

from __future__ import annotations

import math

import pytest

from bench.gate.formatting import check_tolerance, format_noise, json_number, parse_tolerance, short


@pytest.mark.parametrize("tolerance", [0, 0.0, 0.05, 0.999])
def test_check_tolerance_takes_fractions_in_zero_to_one(tolerance):
    check_tolerance(tolerance)


@pytest.mark.parametrize("tolerance", [1, 1.0, -0.01, math.nan, math.inf, "0.05", None])
def test_check_tolerance_refuses_the_rest_and_names_it(tolerance):
    with pytest.raises(ValueError, match=r"tolerance must be a fraction in \[0, 1\), got " + repr(tolerance)):
        check_tolerance(tolerance)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5%", 0.05),
        ("0.05", 0.05),
        ("2.5 %", 0.025),
        (" 10% ", 0.10),
        ("0", 0.0),
        ("0%", 0.0),
        ("99.5%", 0.995),
        ("0.999", 0.999),
        (0.05, 0.05),
        (0, 0.0),
    ],
)
def test_parse_tolerance(text, expected):
    assert parse_tolerance(text) == pytest.approx(expected, abs=1e-15)


def test_a_bare_number_of_one_or_more_is_ambiguous_and_the_message_offers_the_percentage():
    with pytest.raises(ValueError, match=r"invalid tolerance '5': a bare number is a fraction .* write '5%'"):
        parse_tolerance("5")
    with pytest.raises(ValueError, match="must be below 1"):
        parse_tolerance("1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("100%", "a percentage must be below 100%"),
        ("150 %", "a percentage must be below 100%"),
        ("-1%", "must be a finite, non-negative number"),
        ("-0.01", "must be a finite, non-negative number"),
        ("inf", "must be a finite, non-negative number"),
        ("nan%", "must be a finite, non-negative number"),
        ("five", "expected a percentage such as '5%'"),
        ("5%%", "expected a percentage such as '5%'"),
        ("", "expected a percentage such as '5%'"),
    ],
)
def test_parse_tolerance_refuses_and_quotes_the_text(text, message):
    with pytest.raises(ValueError, match=f"invalid tolerance {text!r}") as caught:
        parse_tolerance(text)
    assert message in str(caught.value)


@pytest.mark.parametrize("value", [True, None, [0.05], 1.5, -0.1])
def test_parse_tolerance_refuses_non_text_and_out_of_range_numbers(value):
    with pytest.raises(ValueError, match="tolerance must be"):
        parse_tolerance(value)


@pytest.mark.parametrize(
    ("noise", "exact", "expected"),
    [
        (0.031, False, "noise 3.1%"),
        (0.0312, True, "noise 3.1%"),  # an exact metric with a noise floor still shows it
        (0.0, True, "exact value"),
        (None, True, "exact value"),
        (0.0, False, "noise 0.0%"),
        (0.25, False, "noise 25.0%"),
        (None, False, "noise -"),
    ],
)
def test_format_noise(noise, exact, expected):
    assert format_noise(noise, exact) == expected


def test_short_keeps_twelve_characters_and_marks_a_missing_digest():
    assert short("0123456789abcdef0123") == "0123456789ab"
    assert short("abc") == "abc"
    assert short(None) == "-"
    assert short("") == "-"


@pytest.mark.parametrize(
    ("value", "expected"),
    [(math.inf, "inf"), (-math.inf, "-inf"), (math.nan, "nan"), (1.5, 1.5), (3, 3), ("x", "x"), (None, None)],
)
def test_json_number_writes_non_finite_floats_as_strings(value, expected):
    assert json_number(value) == expected
    assert type(json_number(value)) is type(expected)
