"""PNG chart of a load test from locust's stats-history CSV.

Three panels over time (seconds since the shape started), with the shape's stages
shaded and named:

1. throughput: requests/s (per-second deltas of locust's cumulative count, centred
   3 s mean) and the number of users (right axis);
2. latency: p50 and p99 in ms (locust's rolling ~10 s window; run with
   ``--csv-full-history`` so the Aggregated row holds windowed, not cumulative,
   percentiles) and the p99 goal as a dashed line;
3. failures/s (per-second deltas of the cumulative failure count).

Example::

    plot_history(Path("loadtest/results/X/locust_stats_history.csv"),
                 Path("loadtest/results/X/chart.png"), p99_goal_ms=60)
"""
from __future__ import annotations

import csv
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_history", "read_history"]

log = logging.getLogger(__name__)


def _f(v: str | None) -> float:
    try:
        return float(v) if v not in (None, "", "N/A") else math.nan
    except ValueError:
        return math.nan


def read_history(path: Path) -> dict[str, list[float]]:
    """The Aggregated rows of a locust ``*_stats_history.csv``, one per second.

    Returns columns ``t`` (epoch s, mid-second), ``users``, ``rps``, ``fail_s`` (per-second deltas of
    the cumulative counts), ``p50_ms``, ``p99_ms`` (locust's windowed percentiles),
    ``requests``, ``failures`` (cumulative). Rows sharing a timestamp keep the last.
    """
    by_t: dict[int, dict[str, str]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if row.get("Name") == "Aggregated":
                by_t[int(row["Timestamp"])] = row
    ts = sorted(by_t)
    cols: dict[str, list[float]] = {k: [] for k in (
        "t", "users", "rps", "fail_s", "p50_ms", "p99_ms", "requests", "failures")}
    prev_t, prev_n, prev_f = None, 0.0, 0.0
    for t in ts:
        row = by_t[t]
        n, fails = _f(row["Total Request Count"]), _f(row["Total Failure Count"])
        dt = (t - prev_t) if prev_t is not None else 1.0
        # Locust stamps rows with int(now): the row's true time is in [t, t + 1).
        cols["t"].append(t + 0.5)
        cols["users"].append(_f(row["User Count"]))
        cols["rps"].append((n - prev_n) / dt if dt > 0 else math.nan)
        cols["fail_s"].append((fails - prev_f) / dt if dt > 0 else math.nan)
        # Before its window fills, or with no request in it, locust writes 0 or N/A: no
        # latency (a real HTTP round trip never rounds to 0 ms).
        p50, p99 = _f(row.get("50%")), _f(row.get("99%"))
        cols["p50_ms"].append(p50 if n > prev_n and p50 > 0 else math.nan)
        cols["p99_ms"].append(p99 if n > prev_n and p99 > 0 else math.nan)
        cols["requests"].append(n)
        cols["failures"].append(fails)
        prev_t, prev_n, prev_f = t, n, fails
    return cols


def _moving_mean(xs: Sequence[float], half: int = 1) -> list[float]:
    """Centred moving mean over 2*half+1 points (no lag against the users line)."""
    out = []
    for i in range(len(xs)):
        win = [x for x in xs[max(0, i - half):i + half + 1] if not math.isnan(x)]
        out.append(sum(win) / len(win) if win else math.nan)
    return out


def plot_history(history_csv: Path, out_png: Path, *, stages: Sequence[dict[str, Any]] = (),
                 started_at: float | None = None, p99_goal_ms: float | None = None,
                 title: str = "load test",
                 totals: tuple[int, int] | None = None) -> Path | None:
    """Draw the chart; returns ``out_png``, or None when the CSV has no data rows.

    ``totals`` = (requests, failed) for the caption (default: the CSV's last row, which
    can miss the last second of the run).
    """
    if not history_csv.is_file():
        log.warning("no %s: no chart", history_csv)
        return None
    h = read_history(history_csv)
    if not h["t"]:
        log.warning("%s has no Aggregated rows: no chart", history_csv)
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    t0 = started_at if started_at is not None else h["t"][0]
    x = [t - t0 for t in h["t"]]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 3, 1.6]})
    for i, s in enumerate(stages):
        for ax in (ax1, ax2, ax3):
            ax.axvspan(s["start_s"], s["end_s"], color="0.92" if i % 2 == 0 else "0.97", lw=0)
            if s.get("settle_s"):
                ax.axvspan(s["start_s"], s["start_s"] + s["settle_s"], fill=False, lw=0,
                           hatch="///", edgecolor="0.75")
        ax1.annotate(s["name"], xy=((s["start_s"] + s["end_s"]) / 2, 1.0),
                     xycoords=("data", "axes fraction"), ha="center", va="bottom", fontsize=8)
    ax1.plot(x, h["rps"], color="tab:blue", alpha=0.3, lw=1)
    ax1.plot(x, _moving_mean(h["rps"]), color="tab:blue", lw=2, label="requests/s (3 s centred mean)")
    ax1.set_ylabel("requests/s")
    ax1.set_ylim(bottom=0)
    axu = ax1.twinx()
    axu.step(x, h["users"], where="post", color="tab:gray", lw=1.2, ls="--", label="users")
    axu.set_ylabel("users")
    axu.set_ylim(bottom=0)
    lines = ax1.get_legend_handles_labels()
    lines_u = axu.get_legend_handles_labels()
    ax1.legend(lines[0] + lines_u[0], lines[1] + lines_u[1], loc="upper left", fontsize=8)

    ax2.plot(x, h["p50_ms"], color="tab:green", lw=1.6, label="p50 (10 s window)")
    ax2.plot(x, h["p99_ms"], color="tab:red", lw=1.6, label="p99 (10 s window)")
    top = max((v for v in h["p99_ms"] if not math.isnan(v)), default=1.0) * 1.25
    if p99_goal_ms and p99_goal_ms <= 3 * top:
        ax2.axhline(p99_goal_ms, color="tab:red", ls=":", lw=1.2, label=f"p99 goal {p99_goal_ms:g} ms")
        top = max(top, p99_goal_ms * 1.15)
    elif p99_goal_ms:  # a far-away goal would flatten the curves: name it instead
        ax2.plot([], [], color="tab:red", ls=":", label=f"p99 goal {p99_goal_ms:g} ms (off scale)")
    ax2.set_ylabel("latency (ms)")
    ax2.set_ylim(0, top)
    ax2.legend(loc="upper left", fontsize=8)

    ax3.bar(x, h["fail_s"], width=1.0, color="tab:red", label="failures/s")
    ax3.set_ylabel("failures/s")
    ax3.set_xlabel("seconds since start (shaded: stages; hatched: settling, not measured)")
    n_req, n_fail = totals if totals is not None else (h["requests"][-1], h["failures"][-1])
    ax3.set_title(f"{int(n_fail)} failed of {int(n_req)} requests",
                  fontsize=8, loc="right")
    ax3.set_ylim(bottom=0, top=max(1.0, max((v for v in h["fail_s"] if not math.isnan(v)),
                                            default=0.0) * 1.2))
    fig.suptitle(title)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
