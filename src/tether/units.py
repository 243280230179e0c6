"""Numbers for people: byte sizes in binary units (one formatter, so every message and table agrees)."""

from __future__ import annotations

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
