"""The results and the report of ``asynccache bench multiturn``: what one mode measured, its
summary, the printed tables and the plot.

- :class:`ModeResult` — one mode's requests (per round), the workload's ideal cached tokens and
  the wall time; :meth:`ModeResult.summary` gives the figures the report and ``--json`` show
  (hit rate, ideal hit rate, cached tokens by tier, TTFT mean/p50/p99, throughput, per round).
- :func:`print_tables` — the table of the modes and the table per round, from the summaries.
- :func:`plot` — hit rate and TTFT per round of each mode, as a PNG.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asynccache.reference.scheduler import RequestResult

__all__ = ["ModeResult", "plot", "print_tables"]


@dataclass(slots=True)
class ModeResult:
    results: list[list[RequestResult]] = field(default_factory=list)  # per round
    ideal: list[list[int]] = field(default_factory=list)
    wall_s: float = 0.0
    #: the storage backend's options, with the defaults the cache chose (storage mode only)
    storage_options: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        flat = [r for rnd in self.results for r in rnd]
        prompt = sum(r.prompt_tokens for r in flat)
        cached = sum(r.cached_tokens for r in flat)
        ideal = sum(sum(i) for i in self.ideal)
        ttft = np.array([r.ttft_s * 1e3 for r in flat])
        out_tokens = sum(len(r.output_ids) for r in flat)
        by_tier = {t: sum(r.cached_by_tier.get(t, 0) for r in flat) for t in ("device", "host", "storage")}
        out: dict[str, Any] = {
            "hit_rate": cached / prompt,
            "ideal_hit_rate": ideal / prompt,
            "fraction_of_ideal": cached / ideal if ideal else 1.0,
            "cached_by_tier": by_tier,
            "ttft_ms": {
                "mean": float(ttft.mean()),
                "p50": float(np.percentile(ttft, 50)),
                "p99": float(np.percentile(ttft, 99)),
            },
            "throughput_tok_s": (prompt + out_tokens) / self.wall_s if self.wall_s else 0.0,
            "rounds": [
                {
                    "hit_rate": sum(r.cached_tokens for r in rnd) / sum(r.prompt_tokens for r in rnd),
                    "ideal_hit_rate": sum(ide) / sum(r.prompt_tokens for r in rnd),
                    "ttft_ms_mean": float(np.mean([r.ttft_s * 1e3 for r in rnd])),
                }
                for rnd, ide in zip(self.results, self.ideal, strict=True)
            ],
        }
        if self.storage_options is not None:
            out["storage_options"] = self.storage_options
        return out


def print_tables(summaries: dict[str, dict[str, Any]]) -> None:
    print()
    # TTFT columns leave room for six-digit milliseconds (a loaded CPU run reaches 10 s).
    print(f"{'mode':<20}{'hit rate':>9}{'ideal':>8}{'of ideal':>9}{'TTFT mean':>13}{'p50':>11}{'p99':>11}{'tok/s':>10}")
    for mode, s in summaries.items():
        t = s["ttft_ms"]
        print(
            f"{mode:<20}{s['hit_rate']:>9.3f}{s['ideal_hit_rate']:>8.3f}{s['fraction_of_ideal']:>9.3f}"
            f"{t['mean']:>11.1f}ms{t['p50']:>9.1f}ms{t['p99']:>9.1f}ms{s['throughput_tok_s']:>10.0f}"
        )
    print()
    print("per round: hit rate / TTFT mean (ms)")
    rounds = len(next(iter(summaries.values()))["rounds"])
    print(f"{'mode':<20}" + "".join(f"{'round ' + str(i):>20}" for i in range(rounds)))
    for mode, s in summaries.items():
        cells = "".join(f"{r['hit_rate']:>9.3f} / {r['ttft_ms_mean']:>8.1f}" for r in s["rounds"])
        print(f"{mode:<20}{cells}")


def plot(summaries: dict[str, dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, s in summaries.items():
        xs = list(range(len(s["rounds"])))
        ax1.plot(xs, [r["hit_rate"] for r in s["rounds"]], marker="o", label=mode)
        ax2.plot(xs, [r["ttft_ms_mean"] for r in s["rounds"]], marker="o", label=mode)
    first = next(iter(summaries.values()))
    ax1.plot(
        range(len(first["rounds"])), [r["ideal_hit_rate"] for r in first["rounds"]], "k--", label="ideal"
    )
    ax1.set(xlabel="round", ylabel="cache hit rate", title="hit rate per round", ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(first["rounds"])))
    ax2.set(xlabel="round", ylabel="TTFT mean (ms)", title="TTFT per round")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
