"""Numbers for people: byte sizes in binary units and durations (one formatter and one parser each, so every
message, flag, setting and request field agrees)."""

from __future__ import annotations

import math
import re

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | None) -> str:
    """``n`` bytes in binary units with about 3 significant digits ("98.2 MiB", "1.50 GiB"); ``None`` is "n/a"."""
    if n is None:
        return "n/a"
    sign, value = ("-" if n < 0 else ""), float(abs(n))
    unit = 0
    while value >= 1023.5 and unit < len(_UNITS) - 1:  # 1023.5 KiB would round to "1024 KiB": say "1.00 MiB"
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{int(value)} B"
    digits = 2 if value < 9.995 else 1 if value < 99.95 else 0
    return f"{sign}{value:.{digits}f} {_UNITS[unit]}"


_SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes, or a number with a K/M/G/T suffix, binary (512M = 512 MiB; "1GiB" and "1G" alike); ``ValueError``
    for anything else or a negative size."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        raw = str(text).strip().lower().removesuffix("ib").removesuffix("b")
        unit = raw[-1] if raw and raw[-1] in _SIZE_UNITS else ""
        try:
            value = int(float(raw[: len(raw) - len(unit)]) * _SIZE_UNITS.get(unit, 1))
        except (ValueError, OverflowError):
            raise ValueError(f"bad size {text!r}: use bytes or a number with K, M, G or T (binary)") from None
    if value < 0:
        raise ValueError(f"bad size {text!r}: a size cannot be negative")
    return value


# Go's time.ParseDuration syntax ("5m", "1h30m", "-1s"), as Ollama's keep_alive takes it, or seconds as text
DURATION = r"^-?(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+$|^-?([0-9]+(\.[0-9]*)?|\.[0-9]+)$"
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION = re.compile(DURATION)


def parse_duration(value: str | float) -> float:
    """Seconds, from a number of seconds (as a number or as text) or a duration such as "5m", "1h30m", "250ms"
    (Go's syntax, as Ollama's keep_alive takes it); negative values are returned as they are (callers decide what
    they mean). ``ValueError`` for anything else, NaN included."""
    if isinstance(value, bool):
        raise ValueError(f"bad duration {value!r}: use seconds or a duration such as '5m' or '1h30m'")
    if isinstance(value, str):
        text = value.strip()
        if not _DURATION.fullmatch(text):
            raise ValueError(f"bad duration {value!r}: use seconds or a duration such as '5m' or '1h30m'")
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("-")
        parts = _DURATION_PART.findall(body)
        seconds = sign * (sum(float(n) * _DURATION_UNITS[unit] for n, unit in parts) if parts else float(body))
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise ValueError("bad duration: NaN is no number of seconds")
    return seconds
