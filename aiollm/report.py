"""Text tables for people: benchmark figures and reports, with the `ratio_*` keys shown last."""


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Format a list of dict rows as an aligned text table."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cells = [[_fmt(row.get(col, "")) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def print_figures(name: str, figures: dict) -> None:
    """Print the scalar figures of a benchmark, ratios last."""
    scalars = {k: v for k, v in figures.items() if isinstance(v, (int, float, str, bool))}
    ordered = sorted(scalars, key=lambda k: (k.startswith("ratio_"), k))
    print(f"\n== {name}: summary ==")
    width = max((len(k) for k in ordered), default=0)
    for key in ordered:
        print(f"{key.ljust(width)}  {_fmt(scalars[key])}")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)
