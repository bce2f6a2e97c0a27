"""The notebooks' parity tables: every figure printed beside its tolerance, and the cell fails if one is not below
it, so that a wrong figure cannot be printed unnoticed.

    from parity import check_table
    check_table(["class", "dtype", "quantity", "max abs diff", "tolerance"],
                [("SelfAttention", "float64", "output", 3e-17, 1e-10), ...])

Each row is its labels followed by two numbers, the figure (an error: absolute, relative, as the header says)
and its tolerance; the figure must be finite and strictly below the tolerance. Returns the largest figure
relative to its tolerance.
"""
import math


def check_table(header, rows, title=None):
    """Print ``rows`` under ``header`` (labels left-aligned, figures in %.3e, tolerances in %.1e), then raise
    AssertionError naming every row whose figure is not finite and below its tolerance."""
    if not rows:
        raise AssertionError(f"{title or 'parity table'}: no rows (nothing was compared)")
    cells = [[str(x) for x in row[:-2]] + [f"{float(row[-2]):.3e}", f"{float(row[-1]):.1e}"] for row in rows]
    widths = [max(len(str(h)), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    labels = len(header) - 2
    line = lambda items: "  ".join(s.ljust(w) if i < labels else s.rjust(w)
                                   for i, (s, w) in enumerate(zip(items, widths)))
    if title:
        print(title)
    print(line([str(h) for h in header]))
    for c in cells:
        print(line(c))
    failed = [row for row in rows if not (math.isfinite(float(row[-2])) and float(row[-2]) < float(row[-1]))]
    assert not failed, f"figures not below their tolerance: {failed}"
    print(f"{len(rows)} figures, all below their tolerance")
    return max(float(r[-2]) / float(r[-1]) for r in rows)
