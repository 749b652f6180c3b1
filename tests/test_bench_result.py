"""Tests of the benchmark's result rows and their Markdown table (no GPU needed)."""

from __future__ import annotations

from torpor.bench import Result, markdown


def test_benchmark_rows_compute_ratios_to_the_floor() -> None:
    """A benchmark result row divides each time by bytes over the measured bandwidth."""
    r = Result("torpor", "w", 10**9, 4, sleeps=[2.0, 1.0, 1.0], wakes=[1.5, 1.5, 1.5], released=[10**9])
    row = r.row(1e9, 1e9)
    assert (row["first_x"], row["later_x"], row["wake_x"]) == (2.0, 1.0, 1.5)
    assert row["released_pct"] == 100.0
    assert "| torpor | w | 2.000 s (2.00x)" in markdown({"rows": [row]})
