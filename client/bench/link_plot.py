"""`gradps bench transport --link ... --plot`: time per iteration against the link rate.

One panel per op (push + pull; the sync step), milliseconds against each host's link rate, both
log scaled: one line per layout and codec, gloo's all_reduce of the same tensor in black. Where a
codec's line crosses gloo's is the rate below which it pays.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from client.bench.plot import check_path
from gradps.netem import format_rate, parse_rate

_COLORS = {"none": "tab:blue", "fp16": "tab:orange", "bf16": "tab:olive", "int8": "tab:green", "topk": "tab:red"}
_TICKS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_OPS = (("push_pull", "push + pull (asgd)"), ("sync_step", "sync step"))


def _rate(row: Mapping[str, Any]) -> int:
    """A row's link rate: its --link's default (per-host overrides aside)."""
    return parse_rate(str(row["link"]).split(",")[0])


def _codec(row: Mapping[str, Any]) -> str:
    return row["codec"] + ("" if row.get("pull_codec", "none") == "none" else f"/{row['pull_codec']}")


def _median_by_rate(rows: Sequence[Mapping[str, Any]], field: str) -> tuple[list[int], list[float]]:
    by_rate: dict[int, list[float]] = {}
    for r in rows:
        if r.get(field) is not None:
            by_rate.setdefault(_rate(r), []).append(r[field] * 1e3)
    rates = sorted(by_rate)
    return rates, [statistics.median(by_rate[rate]) for rate in rates]


def plot_links(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "gradps bench transport") -> None:
    """Write the figure of `rows` (Row fields, as `--json` writes them, every one with a link)."""
    rows = [r for r in rows if r.get("link")]
    if not rows:
        raise ValueError("no rows with a link to plot")
    check_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size_mib"] for r in rows})
    largest = sizes[-1]  # one size per figure: the largest measured
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (op, label) in zip(axes, _OPS, strict=True):
        mine = [r for r in rows if r["op"] == op and r["size_mib"] == largest]
        lines = sorted({(r["transport"], _codec(r)) for r in mine})
        for layout, codec in lines:
            rates, ms = _median_by_rate([r for r in mine if (r["transport"], _codec(r)) == (layout, codec)], "seconds")
            color = _COLORS.get(codec.split(":")[0].split("/")[0], "tab:gray")
            style = "-" if layout == "colocated" else "--"
            ax.plot([rate / 1e9 for rate in rates], ms, style, marker="o", color=color, label=f"{layout} {codec}")
        rates, gloo = _median_by_rate(mine, "gloo_seconds")
        if gloo:
            ax.plot([rate / 1e9 for rate in rates], gloo, "-", marker="s", color="black", label="gloo all_reduce")
        ax.set_xscale("log")
        ax.set_yscale("log")
        every = sorted({_rate(r) for r in rows})
        ax.set_xticks([rate / 1e9 for rate in every], [format_rate(rate) for rate in every])
        ax.minorticks_off()
        low, high = ax.get_ylim()
        ax.set_yticks([t for t in _TICKS_MS if low <= t <= high], [f"{t:g}" for t in _TICKS_MS if low <= t <= high])
        ax.set_ylim(low, high)
        ax.set_xlabel("each host's link (both ways)")
        ax.set_ylabel("ms per iteration")
        ax.set_title(f"{label}, {largest:g} MiB")
        ax.grid(alpha=0.3, which="both")
        if lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, f"no {op} rows", ha="center", va="center", transform=ax.transAxes)
    workers = sorted({r["workers"] for r in rows})
    shards = sorted({r["shards"] for r in rows})
    fig.suptitle(f"{title} on emulated links ({'/'.join(map(str, workers))} workers, "
                 f"{'/'.join(map(str, shards))} shards; medians)")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
