"""A PNG of a run: decode speed per stream and in total against concurrency, and prefill TTFT."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hyperqwen.bench.rows import Row

Series = dict[str, tuple[list[float], list[float]]]
"""Line label -> (x values, y values)."""
# Rows of a cohort (decode speed against concurrency); prefill and depth rows are by length.
COHORT_DATA = frozenset({"sharegpt", "random", "copy"})


class PlotUnavailable(Exception):
    """matplotlib is not installed; the message says how to get it."""


def _draw(axis, series: Series, title: str, xlabel: str, ylabel: str) -> None:
    """Lines with markers; y drawn from zero with headroom, so no scale flatters a speed."""
    for marker, (label, (xs, ys)) in zip("oxsd^v<>", series.items(), strict=False):
        axis.plot(xs, ys, marker=marker, label=label)
    axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axis.grid(alpha=0.3)
    highest = max((y for _, ys in series.values() for y in ys), default=0.0)
    if highest > 0:
        axis.set_ylim(0, highest * 1.15)
        axis.legend()


def _decode_series(rows: Sequence[Row], key: str) -> Series:
    series: Series = {}
    for row in rows:
        value = getattr(row, key)
        if row.data in COHORT_DATA and value is not None:
            xs, ys = series.setdefault(f"{row.data} {row.prompt}", ([], []))
            xs.append(row.C)
            ys.append(value)
    return series


def load_pyplot():
    """matplotlib's pyplot on the file-only backend; imported on use, it is slow to import."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "matplotlib is not installed, so no PNG was drawn (the JSON has every number): "
            ".venv/bin/pip install matplotlib"
        ) from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def write_plot(path: Path, rows: Sequence[Row], title: str) -> None:
    pyplot = load_pyplot()
    from matplotlib import ticker

    figure, (per_stream, total, prefill) = pyplot.subplots(1, 3, figsize=(15, 4.5))
    cohorts = sorted({row.C for row in rows if row.data in COHORT_DATA})
    for axis, key, label in (
        (per_stream, "decode_tok_s_per_stream", "decode tok/s per stream"),
        (total, "decode_tok_s_total", "decode tok/s, all streams"),
    ):
        _draw(axis, _decode_series(rows, key), label, "concurrent streams (C)", label)
        if cohorts:
            axis.set_xscale("log")
            axis.set_xticks(cohorts)
            axis.xaxis.set_major_formatter(ticker.ScalarFormatter())
            axis.xaxis.set_minor_formatter(ticker.NullFormatter())
    prefill_rows = [row for row in rows if row.data == "prefill"]
    lengths = [float(row.in_tok) for row in prefill_rows]
    prefill_series: Series = {
        "p50": (lengths, [row.ttft_p50_ms for row in prefill_rows]),
        "p99": (lengths, [row.ttft_p99_ms for row in prefill_rows]),
    }
    _draw(prefill, prefill_series, "prefill: first token", "prompt tokens", "TTFT (ms)")
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
