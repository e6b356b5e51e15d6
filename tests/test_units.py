"""Byte sizes: decimal and binary units, refusals, formatting."""

from __future__ import annotations

import pytest

from kv_budget.units import format_bytes, parse_byte_size, per_each


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1048576", 1_048_576),
        ("512MiB", 512 * 1024**2),
        ("14 GiB", 14 * 1024**3),
        ("14gib", 14 * 1024**3),
        ("1.5GiB", 1_610_612_736),
        ("2GB", 2_000_000_000),
        ("2G", 2_000_000_000),
        ("1_000kB", 1_000_000),
        ("0", 0),
        (4096, 4096),
    ],
)
def test_parses_sizes(text, expected):
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1", "1.5", "0.1KiB", "12 parsecs", "1e9", True, 1.0, None, -3])
def test_refuses_what_is_not_a_whole_non_negative_size(text):
    with pytest.raises(ValueError):
        parse_byte_size(text)


def test_format_gives_exact_bytes_and_mib():
    assert format_bytes(1_191_182_336) == "1,191,182,336 B (1136.00 MiB)"
    assert format_bytes(0) == "0 B (0.00 MiB)"


@pytest.mark.parametrize(("total", "count", "expected"), [
    (12, 4, 3),  # exact
    (13, 4, 4),  # a remainder rounds up: a share is never read lower than it is
    (1, 4, 1),
    (0, 4, 0),
    (5, 0, 0),  # nothing held: no share
])
def test_a_share_per_each_rounds_up(total, count, expected):
    assert per_each(total, count) == expected
