"""Byte sizes as people write them: '8GiB', '512MiB', '1.5GB', '4096'."""

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """Bytes in '8GiB', '512MiB', '1.5GB', '4096' (ValueError naming the text otherwise)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"memory size {text!r}: expected a number with an optional unit such as 8GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: float) -> str:
    """Bytes as people read them: '3.4 GiB', '513.1 MiB', '12.0 KiB', '100 B'."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
