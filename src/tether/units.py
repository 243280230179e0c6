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
