"""Plots (PNG): CDFs of TTFT and inter-token gaps per mode, and a per-request token timeline that
shows generation stalls (one row per request, a tick per streamed token)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402

from orchestrator.bench.stats import RequestRecord  # noqa: E402


def _measured(records: list[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.ok and not r.warmup]


def cdf(runs: dict[str, list[RequestRecord]], metric: str, path: str, title: str) -> None:
    """metric: 'ttft' or 'itl' (every gap between consecutive responses)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, records in runs.items():
        rs = _measured(records)
        values = sorted([r.ttft for r in rs] if metric == "ttft" else [g for r in rs for g in r.gaps])
        if values:
            ax.plot([v * 1e3 for v in values], [(i + 1) / len(values) for i in range(len(values))], label=label)
    ax.set_xlabel(f"{'TTFT' if metric == 'ttft' else 'inter-token gap'} (ms)")
    ax.set_ylabel("fraction of " + ("requests" if metric == "ttft" else "gaps"))
    ax.set_xscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline(runs: dict[str, list[RequestRecord]], path: str, title: str) -> None:
    """One panel per mode; each row a request, each tick a streamed response. Gaps = stalls."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.2 + 1.6 * len(runs)), sharex=True, squeeze=False)
    colors = {}
    for ax, (label, records) in zip(axes[:, 0], runs.items()):
        for row, r in enumerate(sorted([r for r in records if r.ok], key=lambda r: r.start)):
            color = colors.setdefault(r.stream, f"C{len(colors)}")
            ax.plot([r.start, r.start + r.e2e], [row, row], color=color, alpha=0.25, lw=1)
            ax.scatter([r.start + t for t in r.response_times], [row] * len(r.response_times), marker="|", s=30,
                       color=color, lw=0.8)
        ax.set_ylabel(label)
        ax.set_yticks([])
    axes[-1, 0].set_xlabel("seconds since start (one row per request, a tick per token)")
    handles = [plt.Line2D([], [], color=c, marker="|", ls="", label=s) for s, c in colors.items()]
    axes[0, 0].legend(handles=handles, loc="upper right", fontsize=8)
    axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
