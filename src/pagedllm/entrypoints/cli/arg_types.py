"""argparse value types for the CLI's flags: a bad value is argparse's one-line error at once, not a traceback
after a run (or a run that silently clamps it, or a benchmark whose results cannot be written once it is over)."""
from __future__ import annotations

import argparse
import os
from typing import Optional


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


def _ranged_float(low: float, strict: bool, what: str):
    """A float above low (strict) or at least low; nan is refused (it compares false with every bound, so a
    timeout of nan would pass any check and then never, or at once, fire)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value != value or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text.strip()}")
        return value
    return parse


positive_float = _ranged_float(0.0, True, "> 0")
non_negative_float = _ranged_float(0.0, False, ">= 0")


def any_float(text: str) -> float:
    """A float, any sign (a negative one has its own meaning), but not nan."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value:
        raise argparse.ArgumentTypeError("must be a number, got nan")
    return value

_DECIMAL = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def human_int(text: str) -> int:
    """An integer, or with vLLM's size suffixes: k / m / g multiply by 1000^n, K / M / G by 1024^n (25.6k = 25600,
    32K = 32768); the product must be whole."""
    text = text.strip()
    unit = _DECIMAL.get(text[-1:]) or _BINARY.get(text[-1:])
    if unit is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer (or one like 32k / 32K), got {text!r}") from None
    try:
        number = float(text[:-1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number before {text[-1]!r}, got {text!r}") from None
    value = number * unit
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ({value:g})")
    return int(value)


def tcp_port(text: str) -> int:
    """A TCP port, 0..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {value}")
    return value


def http_url(text: str) -> str:
    """An http:// or https:// URL with a host (a bare host:port or a typo'd scheme is refused now, not reported
    later as an unreachable server)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text.strip())
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a valid URL {text!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text.strip()


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


def output_problem(path: str, is_dir: bool = False) -> Optional[str]:
    """Why the file (is_dir: the folder) at path could not be written, its missing folders created first; None
    when it can. Checked before a run, so a benchmark does not end in an error after all its work."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path):
        if is_dir != os.path.isdir(path):
            return "is not a directory" if is_dir else "is a directory"
        return None if os.access(path, os.W_OK | (os.X_OK if is_dir else 0)) else "is not writable"
    ancestor = os.path.dirname(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"{ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not writable"
    return None


def output_file(text: str) -> str:
    """A file written at the end of a run (missing folders are created): checked now."""
    problem = output_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {problem}")
    return text


def output_dir(text: str) -> str:
    """A folder written into at the end of a run (created if missing): checked now."""
    problem = output_problem(text, is_dir=True)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write into {text}: {problem}")
    return text


def write_json(path: str, data: object) -> None:
    """Write a run's results to an output_file path, making its missing folders (as that check allowed)."""
    import json
    import sys

    os.makedirs(os.path.dirname(os.path.abspath(os.path.expanduser(path))), exist_ok=True)
    with open(os.path.expanduser(path), "w") as f:
        json.dump(data, f, indent=2)
    print(f"Saved results to {path}", file=sys.stderr)


def existing_path_or_repo(text: str) -> str:
    """A local file / folder or a hub repo id. One written as a local path (/, ./, ../, ~) must exist: refused now,
    not after a hub lookup for a repo id it cannot be."""
    local = text.startswith(("/", "./", "../", "~")) or text in (".", "..")
    if local and not os.path.exists(os.path.expanduser(text)):
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text
