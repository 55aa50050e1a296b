"""`gradps bench transport --plot`: the transport rows as a figure, against the issue's targets.

Left, push + pull as a share of raw loopback TCP; right, the sync step against gloo's all_reduce.
Each line is one transport (and codec), its median over the shard and worker counts of the run,
with their range shaded.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Transports in the order of the legend: fastest first.
_COLORS = {"shm": "tab:blue", "colocated": "tab:green", "stream": "tab:orange", "grpc": "tab:red"}
# What matplotlib writes without extra packages.
FORMATS = (".png", ".svg", ".pdf")
# The acceptance targets (issue 5): push + pull >= 50% of TCP; a sync step <= 1.5x gloo.
_TCP_TARGET, _GLOO_TARGET = 0.5, 1.5


def _lines(rows: Sequence[Mapping[str, Any]], op: str, field: str) -> dict[tuple[str, str], list[tuple]]:
    """(transport, codec) -> [(size, median, min, max)] of `field` over the rows of `op`."""
    values: dict[tuple[str, str], dict[float, list[float]]] = {}
    for r in rows:
        if r["op"] == op and r.get(field) is not None:
            values.setdefault((r["transport"], r["codec"]), {}).setdefault(r["size_mib"], []).append(r[field])
    rank = {transport: i for i, transport in enumerate(_COLORS)}

    def legend_order(key: tuple[str, str]) -> tuple:
        transport, codec = key
        return rank.get(transport, len(rank)), codec != "none", key

    return {
        key: [(size, statistics.median(v), min(v), max(v)) for size, v in sorted(values[key].items())]
        for key in sorted(values, key=legend_order)
    }


def check_path(path: Path) -> None:
    """ValueError unless `path` names a format matplotlib writes (FORMATS)."""
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"{path.name}: expected a file ending in {', '.join(FORMATS)}")


def plot_transport(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "gradps bench transport") -> None:
    """Write the figure of `rows` (Row fields, as `--json` writes them) to `path`, one of FORMATS."""
    if not rows:
        raise ValueError("no rows to plot")
    check_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (push_pull, sync_step) = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = (
        (push_pull, "push_pull", "ratio_vs_tcp", "push + pull vs raw loopback TCP", _TCP_TARGET),
        (sync_step, "sync_step", "ratio_vs_gloo", "sync step time vs gloo all_reduce (lower is faster)", _GLOO_TARGET),
    )
    for ax, op, field, label, target in panels:
        lines = _lines(rows, op, field)
        for (transport, codec), points in lines.items():
            sizes = [p[0] for p in points]
            color = _COLORS.get(transport, "tab:gray")
            style = "-" if codec == "none" else "--"
            ax.plot(sizes, [p[1] for p in points], style, marker="o", color=color, label=f"{transport} {codec}")
            ax.fill_between(sizes, [p[2] for p in points], [p[3] for p in points], color=color, alpha=0.12)
        ax.axhline(target, color="black", linestyle=":", linewidth=1, label="target")
        if op == "sync_step":
            ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        sizes = sorted({r["size_mib"] for r in rows})
        ax.set_xticks(sizes, [f"{size:g}" for size in sizes])
        ax.minorticks_off()
        ax.set_xlabel("parameter set (MiB)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, f"no {op} rows", ha="center", va="center", transform=ax.transAxes)
    push_pull.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    sync_step.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
    fig.suptitle(f"{title} (median over shard and worker counts; shaded: their range)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
