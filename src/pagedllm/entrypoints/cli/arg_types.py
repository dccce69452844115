"""argparse value types for the CLI's numeric flags: a bad value is argparse's one-line error at once, not a
traceback after a run (or a run that silently clamps it)."""
from __future__ import annotations

import argparse


def _ranged_int(low: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value
    return parse


positive_int = _ranged_int(1, ">= 1")
non_negative_int = _ranged_int(0, ">= 0")


def non_blank(text: str) -> str:
    """A name: not empty, not only whitespace (clients could not name it as a request's "model")."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty or blank, got {text!r}")
    return text


def unit_fraction(text: str) -> float:
    """A float in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def percentiles(text: str) -> str:
    """Comma-separated percentiles, each in (0, 100]: checked now, used as given."""
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        if not 0.0 < value <= 100.0:
            raise argparse.ArgumentTypeError(f"a percentile is in (0, 100], got {part}")
    return text
