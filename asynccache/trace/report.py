"""Tables and plots of trace replays.

- :func:`format_table` — one row per (policy, budget): hit rate overall and by tier, fraction of
  the infinite-cache bound, prefill FLOPs saved, bytes moved per tier, evictions (KV pages,
  states, and the budget enforcements left over budget: ``stuck``), replay time.
- :func:`plot_results` — a PNG: hit rate against the host budget, one line per policy, one panel
  per storage budget, with the bound drawn across.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from asynccache.trace.policies import ATTENTION_ONLY
from asynccache.trace.results import ReplayResult, format_size

__all__ = ["format_markdown_table", "format_table", "plot_results"]

_COLUMNS = (
    ("policy", "<"),
    ("write", "<"),
    ("budget", "<"),
    ("hit %", ">"),
    ("of bound", ">"),
    ("dev/host/disk %", ">"),
    ("PFLOP saved", ">"),
    ("h2d/d2h/disk GiB", ">"),
    ("evicted kv/state/stuck", ">"),
    ("time s", ">"),
)


def _row(r: ReplayResult) -> list[str]:
    tiers = r.hit_rate_by_tier()
    moved = r.bytes_moved
    gib = 2**30
    disk = moved.get("storage_write", 0) + moved.get("storage_read", 0)
    kv_ev = r.evictions.get("device_kv", 0) + r.evictions.get("host_kv", 0)
    st_ev = r.evictions.get("device_state", 0) + r.evictions.get("host_state", 0)
    stuck = r.evictions.get("device_stuck", 0) + r.evictions.get("host_stuck", 0)
    return [
        r.policy,
        r.write_policy,
        r.budget.label,
        f"{100 * r.hit_rate:.2f}",
        f"{r.fraction_of_bound:.3f}",
        "/".join(f"{100 * tiers[t]:.1f}" for t in ("device", "host", "storage")),
        f"{r.flops_saved / 1e15:,.0f}",
        f"{moved.get('h2d', 0) / gib:,.0f}/{moved.get('d2h', 0) / gib:,.0f}/{disk / gib:,.0f}",
        f"{kv_ev:,}/{st_ev:,}/{stuck:,}",
        f"{r.wall_s:.1f}",
    ]


def format_table(results: Sequence[ReplayResult], *, bound: float) -> str:
    """A fixed-width text table (see the module docstring), with the bound on the first line."""
    rows = [[name for name, _ in _COLUMNS]] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [f"infinite-cache bound: {100 * bound:.2f} % of prompt tokens"]
    for k, row in enumerate(rows):
        cells = [cell.ljust(w) if align == "<" else cell.rjust(w) for cell, w, (_, align) in zip(row, widths, _COLUMNS)]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown_table(results: Sequence[ReplayResult]) -> str:
    """The same rows as a Markdown table (for docs/benchmarks.md)."""
    head = "| " + " | ".join(name for name, _ in _COLUMNS) + " |"
    sep = "|" + "|".join("---" if align == "<" else "---:" for _, align in _COLUMNS) + "|"
    body = ["| " + " | ".join(_row(r)) + " |" for r in results]
    return "\n".join([head, sep, *body])


def plot_results(results: Sequence[ReplayResult], path: str | Path, *, bound: float, title: str = "") -> None:
    """Hit rate vs host budget per policy; one panel per storage budget (PNG at ``path``). The
    attention-only reference is drawn dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    storages = sorted({r.budget.storage for r in results})
    fig, axes = plt.subplots(1, len(storages), figsize=(6.5 * len(storages), 4.8), squeeze=False, sharey=True)
    policies = list(dict.fromkeys(f"{r.policy} ({r.write_policy})" for r in results))
    for ax, storage in zip(axes[0], storages):
        for policy in policies:
            pts = sorted(
                (r.budget.host, r.hit_rate)
                for r in results
                if r.budget.storage == storage and f"{r.policy} ({r.write_policy})" == policy
            )
            if not pts:
                continue
            xs = [p[0] for p in pts]
            reference = policy.startswith(ATTENTION_ONLY)  # not a hybrid policy: dotted
            ax.plot(
                xs,
                [100 * p[1] for p in pts],
                marker="o",
                linestyle=":" if reference else "-",
                label=f"{policy}, reference" if reference else policy,
            )
        ax.axhline(100 * bound, color="black", linestyle="--", linewidth=1, label="infinite cache")
        ax.set_xscale("log", base=2)
        hosts = sorted({r.budget.host for r in results if r.budget.storage == storage})
        ax.set_xticks(hosts, [format_size(h) for h in hosts])
        ax.minorticks_off()
        ax.set_xlabel("host budget")
        ax.set_title("no storage tier" if storage == 0 else f"+ storage {format_size(storage)}")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("prompt tokens served from cache (%)")
    for ax in axes[0]:  # each panel names its own lines (the reference has no storage panel)
        ax.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
