"""The report of ``asynccache bench prefix``: the printed table and the plot, from the result
dictionary that the bench writes with ``--json`` (so that ``--from-json`` re-reports a run)."""

from __future__ import annotations

from typing import Any

from storage_backends.local_disk import READ_RANGE_BYTES

__all__ = ["plot", "print_report"]


_TIERS = {
    "cold": "cold prefill",
    "device": "device",
    "host": "host (layer-by-layer load)",
    "disk_all": "local disk, restore all",
    "disk_split": "local disk, cost model",
}


def _direct_note(res: dict[str, Any]) -> str:
    """The direct-read part of the report's first line (absent from runs before it was measured)."""
    if "raw_disk_direct_read_gbps" not in res:
        return ""
    procs = (res.get("storage_options") or {}).get("read_processes")
    readers = f"; the backend read in {procs} reader processes" if procs else ""
    if res["raw_disk_direct_read_gbps"] is None:
        return f"; no direct reads ({res['raw_disk_direct_refused']})" + readers
    used = "direct" if res.get("storage_direct_io") else "through the page cache"
    if procs:
        used += f" in {procs} reader processes"
    return f", {res['raw_disk_direct_read_gbps']:.2f} GB/s direct (O_DIRECT); the backend read {used}"


def print_report(res: dict[str, Any]) -> None:
    print(
        f"prefix TTFT on {res['device']}: {res['preset']}, {res['prefix_tokens']}-token prefix "
        f"({res['prefix_bytes'] / 1e9:.2f} GB) + {res['new_tokens']} new tokens; cold prefill "
        f"{res['prefill_tokens_per_s']:.0f} tok/s; raw disk read {res['raw_disk_read_gbps']:.2f} GB/s sequential, "
        f"{res['raw_disk_parallel_read_gbps']:.2f} GB/s on {res['raw_disk_parallel_threads']} threads"
        + _direct_note(res)
    )
    if res.get("warmed_graphs"):
        print(f"{res['warmed_graphs']} layer graphs of first passes captured before measuring (--warm-up-graphs)")
    print(f"{'served from':<28}{'TTFT (ms)':>11}{'cached':>9}")
    for key, name in _TIERS.items():
        print(f"{name:<28}{res['ttft_ms'][key]:>11.1f}{res['cached_tokens'][key]:>9}")
    print(f"{'disk optimum (sequential)':<28}{res['disk_optimum_ms']:>11.1f}")
    print(f"{'disk optimum (parallel)':<28}{res['disk_optimum_parallel_ms']:>11.1f}")
    if "disk_optimum_best_ms" in res:
        print(f"{'disk optimum (best read)':<28}{res['disk_optimum_best_ms']:>11.1f}")
    print(
        f"host/device {res['host_over_device']:.3f} (medians; {len(res['ttft_ms_repeats']['host'])} alternating "
        f"pairs: median ratio {res['host_over_device_pairwise']:.3f}, median difference "
        f"{res['host_minus_device_ms']:.2f} ms)"
    )
    if res.get("h2d_link_ms") is not None:
        print(
            f"the prefix over the link alone (contiguous pinned copy, same run): {res['h2d_link_ms']:.1f} ms; "
            f"host / max(device, link) {res['host_over_optimum']:.3f}"
        )
    print(
        f"disk (cost model)/cold {res['disk_split_over_cold']:.3f}; "
        f"disk (cost model)/optimum {res['disk_split_over_optimum']:.3f} (sequential read), "
        f"{res['disk_split_over_optimum_parallel']:.3f} (parallel read)"
        + (f", {res['disk_split_over_optimum_best']:.3f} (best read)" if "disk_split_over_optimum_best" in res else "")
    )
    if "raw_disk_prefix_parallel_read_gbps" in res:
        print(
            f"the {res['prefix_files']} objects the prefix's request stored alone, plain reads on {res['raw_disk_parallel_threads']} "
            f"threads (median of 3): {res['raw_disk_prefix_parallel_read_gbps']:.2f} GB/s; the optimum with it "
            f"{res['disk_optimum_prefix_parallel_ms']:.1f} ms, disk (cost model) / it "
            f"{res['disk_split_over_optimum_prefix_parallel']:.3f}, restore all / it "
            f"{res['disk_all_over_optimum_prefix_parallel']:.3f}"
        )
    if "raw_disk_prefix_ranges_read_gbps" in res:
        print(
            f"  the same objects cut as the backend reads them (states in {READ_RANGE_BYTES >> 20} MiB ranges, each thread "
            f"taking the next range): {res['raw_disk_prefix_ranges_read_gbps']:.2f} GB/s; the optimum with it "
            f"{res['disk_optimum_prefix_ranges_ms']:.1f} ms, disk (cost model) / it "
            f"{res['disk_split_over_optimum_prefix_ranges']:.3f}, restore all / it "
            f"{res['disk_all_over_optimum_prefix_ranges']:.3f}"
        )
    if "disk_optimum_interleaved_ms" in res:
        reads = res["raw_disk_paired_read_gbps"]
        every = reads["disk_all"] + reads["disk_split"]
        print(
            f"  the same ranged reads before each disk restore: {min(every):.2f}–{max(every):.2f} GB/s; the optimum "
            f"with their median {res['disk_optimum_interleaved_ms']:.1f} ms, disk (cost model) / it "
            f"{res['disk_split_over_optimum_interleaved']:.3f}, restore all / it "
            f"{res['disk_all_over_optimum_interleaved']:.3f}; each restore over the optimum with the read just "
            f"before it (median): cost model {res['disk_split_over_optimum_paired']:.3f}, restore all "
            f"{res['disk_all_over_optimum_paired']:.3f}"
        )
    if "prefill_fit" in res:
        fit = res["prefill_fit"]
        lengths = ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in fit["prefills_ms"])
        print(
            f"cold prefill {lengths}: {fit.get('s_per_pass', 0.0) * 1e3:.1f} ms a pass + "
            f"{fit['tokens_per_s']:.0f} tok/s + {fit['s_per_context_token'] * 1e9:.3f} ns per token of context "
            f"(the cost model's compute time); with it the remaining tokens' compute in the optimum: "
            f"{res['disk_optimum_fit_parallel_ms']:.1f} ms (parallel read), {res['disk_optimum_fit_best_ms']:.1f} ms "
            f"(best read)"
        )
        print(
            f"disk (cost model)/optimum, remaining tokens' compute from the fit: "
            f"{res['disk_split_over_optimum_fit_parallel']:.3f} (parallel read), "
            f"{res['disk_split_over_optimum_fit_best']:.3f} (best read)"
        )
    if "stored_fraction" in res:
        kind = "compressed" if res["storage_compressed"] else "plain"
        print(
            f"stored objects ({kind}) take {res['stored_fraction']:.3f} of their payload bytes; the optimum with "
            f"the stored bytes read (parallel read, compute from the fit): "
            f"{res['disk_optimum_fit_stored_parallel_ms']:.1f} ms, disk (cost model) / it "
            f"{res['disk_split_over_optimum_fit_stored_parallel']:.3f}"
        )
    reps = zip(res["ttft_ms_repeats"]["disk_split"], res["cached_tokens_repeats"]["disk_split"], strict=True)
    print("cost model, each repeat (TTFT ms / tokens restored): " + ", ".join(f"{t:.0f} / {c}" for t, c in reps))
    corr = res["read_time_correction"]
    print(f"observed / estimated read time: {corr['alone']:.2f} alone, {corr['beside_compute']:.2f} beside a head's computation")
    seen = ", ".join(f"{r:.2f}" for r in corr["beside_compute_observed"]) or "none"
    print(f"  each tail read beside a head (observed / estimated): {seen}")
    if "head_compute" in corr:  # (results written before the head's correction lack it)
        heads = ", ".join(f"{r:.2f}" for r in corr["head_compute_observed"]) or "none"
        print(f"observed / estimated head computation beside the reads: {corr['head_compute']:.2f}; each: {heads}")


def plot(res: dict[str, Any], path: str) -> None:
    """TTFT per tier (log scale, with the disk optima and the link time), and each alternating
    device/host pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    keys = list(_TIERS)
    ttft = [res["ttft_ms"][k] for k in keys]
    bars = ax1.bar(range(len(keys)), ttft, color=["0.6", "tab:green", "tab:blue", "tab:orange", "tab:red"])
    ax1.bar_label(
        bars, labels=[f"{t:.1f}" for t in ttft], fontsize=8, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1}
    )
    ax1.set_xticks(range(len(keys)), [_TIERS[k].replace(" (", "\n(").replace(", ", ",\n") for k in keys], fontsize=8)
    ax1.set_yscale("log")
    floor = min([*ttft, res.get("h2d_link_ms") or min(ttft)])
    ax1.set_ylim(floor / 2, max(ttft) * 60)  # the link's line in view, room above the bars for the legend
    for value, label, color, linestyle in (
        (res["disk_optimum_ms"], "disk optimum, sequential read", "k", "--"),
        (res["disk_optimum_parallel_ms"], "disk optimum, parallel read", "k", ":"),
        (res.get("disk_optimum_best_ms"), "disk optimum, best read", "tab:red", ":"),
        (res.get("disk_optimum_fit_parallel_ms"), "disk optimum, parallel read, compute from the fit", "tab:red", "--"),
        (res.get("h2d_link_ms"), "prefix over the link alone", "b", ":"),
    ):
        if value is not None:
            ax1.axhline(value, color=color, linestyle=linestyle, linewidth=1, label=f"{label} ({value:.1f} ms)")
    ax1.set(ylabel="TTFT (ms, median)", title="TTFT by the tier that holds the prefix")
    ax1.legend(fontsize=7, loc="upper right")
    reps = res["ttft_ms_repeats"]
    xs = range(1, len(reps["device"]) + 1)
    ax2.plot(xs, reps["device"], "o-", color="tab:green", label="device")
    ax2.plot(xs, reps["host"], "o-", color="tab:blue", label="host")
    ax2.plot(xs, [1.05 * d for d in reps["device"]], color="tab:green", linestyle=":", label="1.05 × device")
    ax2.set(
        xlabel="alternating pair",
        ylabel="TTFT (ms)",
        title=f"device and host in turn: host/device {res['host_over_device']:.3f} (medians)",
    )
    ax2.legend(fontsize=8)
    fig.suptitle(
        f"{res['preset']} on {res['device']}: {res['prefix_tokens']:,}-token prefix "
        f"({res['prefix_bytes'] / 1e9:.2f} GB) + {res['new_tokens']} new tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
