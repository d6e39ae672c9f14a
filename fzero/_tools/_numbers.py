"""Quantities as people type and read them: parameter counts (7.5B, 350M), byte sizes
(31.4 GB), and the argparse types that check the command line's numbers."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS.update({"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40})


def parse_count(text: str) -> int:
    """A parameter count such as `7.5e9`, `7.5B`, `350M`, `1.3T` or `125_000_000`.

    Args:
      text: a number with an optional K / M / B (or G) / T suffix, case-insensitive.

    Returns:
      The count, rounded to an integer.
    """
    match = re.fullmatch(
        r"\s*([0-9][0-9_]*\.?[0-9_]*(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text, re.I
    )
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid parameter count {text!r} (examples: 7.5e9, 7.5B, 350M)"
        )
    count = float(match[1].replace("_", "")) * _SUFFIXES[match[2].lower()]
    if not math.isfinite(count) or count < 1:
        raise argparse.ArgumentTypeError(f"parameter count must be at least 1, got {text!r}")
    return round(count)


def format_count(n: int) -> str:
    """A parameter count the way papers write it: 7.5B, 350M, 1.3T, 12,345."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:,}"


def int_list(lo: int, hi: int | None = None) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated ints in [lo, hi]."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers, got {text!r}"
            ) from None
        bad = [v for v in values if v < lo or (hi is not None and v > hi)]
        if bad:
            span = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"values must be {span}, got {bad[0]}")
        return values

    return parse


def at_least(cast: Callable[[str], float], lo: float) -> Callable[[str], float]:
    """An argparse type: one finite number parsed by `cast`, at least `lo`."""

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and value >= lo):
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {text!r}")
        return value

    return parse


positive_int = at_least(int, 1)
nonnegative_float = at_least(float, 0)


def human_bytes(n: float, unit: str = "auto") -> str:
    """`n` bytes with three significant digits in decimal units (the ZeRO paper's GB).

    Args:
      n: bytes.
      unit: "auto" (the largest decimal unit that keeps the value >= 1) or a key of
        B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.

    Returns:
      For example "31.4 GB".
    """
    if unit == "auto":
        unit = next((u for u in ("TB", "GB", "MB", "KB") if n >= UNITS[u]), "B")
    value = n / UNITS[unit]
    text = f"{value:.3g}" if value < 1000 else f"{value:,.0f}"
    return f"{text} {unit}"
