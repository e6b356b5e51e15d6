"""Byte sizes as operators write them, and as logs print them.

Every figure kv-budget prints carries its unit in exact bytes and in MiB, so a
reader can redo the arithmetic by hand. Parsing refuses anything it cannot
turn into a whole, non-negative number of bytes: a headroom of "1.3 bytes" is
a typo, not a value to round.
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal, InvalidOperation

__all__ = ["parse_byte_size", "byte_size_argument", "parse_positive_int", "positive_int_argument", "format_bytes",
           "per_each", "MiB", "GiB"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}
"""Decimal units (kB, MB, GB) are powers of 1000 and binary ones (KiB, MiB,
GiB) powers of 1024, as in the SI/IEC standards. ``14G`` means 14 * 10**9:
an operator who means GiB writes GiB."""

_SIZE = re.compile(r"^\s*(?P<number>[0-9][0-9_]*(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]*)\s*$")


def parse_byte_size(text: str | int) -> int:
    """Parse ``"14GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``"1048576"`` into bytes.

    Raises ``ValueError`` naming the text and the accepted units when the text
    is not a size, is negative, or does not come to a whole number of bytes.
    """
    if isinstance(text, bool):
        raise ValueError(f"byte size {text!r} is a bool, not a size")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte size {text} is negative")
        return text
    if not isinstance(text, str):
        raise ValueError(f"byte size {text!r} is a {type(text).__name__}, not a string or int")
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a byte size: write a non-negative number with an "
            "optional unit (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 14GiB"
        )
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise ValueError(
            f"{text!r} has unknown unit {match['unit']!r}: use one of "
            "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    try:
        number = Decimal(match["number"].replace("_", ""))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only digits
        raise ValueError(f"{text!r} is not a byte size") from exc
    value = number * _UNITS[unit]
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is {value} bytes: not a whole number of bytes")
    return int(value)


def byte_size_argument(text: str) -> int:
    """:func:`parse_byte_size` as an argparse ``type=``: a bad size becomes
    the usual one-line usage error (exit 2), not a traceback."""
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parse_positive_int(text: str) -> int:
    """An integer >= 1 (a count of layers, heads, sequences, tokens), or ValueError saying which rule it broke."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{value} must be >= 1")
    return value


def positive_int_argument(text: str) -> int:
    """:func:`parse_positive_int` as an argparse ``type=``, its message kept."""
    try:
        return parse_positive_int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def seconds_argument(text: str) -> float:
    """A number of seconds >= 0 as an argparse ``type=`` (0: the thing timed is off)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds >= 0 (0: no live sampling)")
    return value


def per_each(total: int, count: int) -> int:
    """``total`` over ``count``, rounded up, 0 where ``count`` is 0: a
    per-sequence (or per-block) share must never be read lower than it is,
    or a bound built on it admits one too many."""
    return -(-total // count) if count else 0


def format_bytes(value: int) -> str:
    """``1191182336`` -> ``"1,191,182,336 B (1136.00 MiB)"``: exact and readable."""
    return f"{value:,} B ({value / MiB:.2f} MiB)"
