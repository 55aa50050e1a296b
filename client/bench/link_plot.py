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

_COLORS = {
    "none": "tab:blue",
    "fp16": "tab:orange",
    "bf16": "tab:olive",
    "int8": "tab:green",
    "topk": "tab:red",
    "other": "tab:gray",
}
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
    """Write the figure of `rows` (Row fields, as `--json` writes them, every one with a link): a
    panel per op and layout; colour: the push codec, dashed: a compressed pull."""
    rows = [r for r in rows if r.get("link")]
    if not rows:
        raise ValueError("no rows with a link to plot")
    check_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    largest = max(r["size_mib"] for r in rows)  # one size per figure: the largest measured
    layouts = sorted({r["transport"] for r in rows})
    fig, axes = plt.subplots(len(layouts), 2, figsize=(12, 4 * len(layouts)), squeeze=False)
    every = sorted({_rate(r) for r in rows})
    for row_axes, layout in zip(axes, layouts, strict=True):
        for ax, (op, label) in zip(row_axes, _OPS, strict=True):
            mine = [r for r in rows if r["op"] == op and r["size_mib"] == largest and r["transport"] == layout]
            _draw(ax, mine)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks([rate / 1e9 for rate in every], [format_rate(rate) for rate in every])
            ax.minorticks_off()
            low, high = ax.get_ylim()
            ticks = [t for t in _TICKS_MS if low <= t <= high]
            ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
            ax.set_ylim(low, high)
            ax.set_xlabel("each host's link (both ways)")
            ax.set_ylabel("ms per iteration")
            ax.set_title(f"{label}, {largest:g} MiB, shards {layout}")
            ax.grid(alpha=0.3, which="both")
            if not mine:
                ax.text(0.5, 0.5, f"no {op} rows", ha="center", va="center", transform=ax.transAxes)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize="small")
    workers = "/".join(map(str, sorted({r["workers"] for r in rows})))
    shards = "/".join(map(str, sorted({r["shards"] for r in rows})))
    fig.suptitle(f"{title} on emulated links ({workers} workers, {shards} shards; medians; dashed: bf16/fp16 pulls)")
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw(ax: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """One line per codec pair of `rows`, and gloo's all_reduce in black."""
    for codec in sorted({_codec(r) for r in rows}, key=lambda c: (list(_COLORS).index(_family(c)), c)):
        rates, ms = _median_by_rate([r for r in rows if _codec(r) == codec], "seconds")
        style = "-" if "/" not in codec else "--"
        ax.plot([rate / 1e9 for rate in rates], ms, style, marker="o", color=_COLORS[_family(codec)], label=codec)
    rates, gloo = _median_by_rate(rows, "gloo_seconds")
    if gloo:
        ax.plot([rate / 1e9 for rate in rates], gloo, "-", marker="s", color="black", label="gloo all_reduce")


def _family(codec: str) -> str:
    """A codec pair's push codec without its parameters ("topk:0.01/bf16" -> "topk")."""
    name = codec.split("/")[0].split(":")[0]
    return name if name in _COLORS else "other"
