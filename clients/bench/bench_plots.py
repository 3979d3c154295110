"""Plots (PNG): CDFs of TTFT and inter-token gaps per mode, a per-request token timeline that
shows generation stalls (one row per request, a tick per streamed token), and SLO attainment vs
arrival rate per layout (measured, and as the planner predicts it)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402

from clients.bench.stats import RequestRecord  # noqa: E402


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


def attainment(sweep: dict, plan: dict, path: str, title: str) -> None:
    """DistServe's figure: attainment vs rate per layout, measured (solid) and `tandem plan` (dashed);
    the dotted line is the target, where a curve crosses it is the rate the layout sustains."""
    fig, ax = plt.subplots(figsize=(8, 5))
    plan_pts: dict[str, list[tuple[float, float]]] = {}
    for r in plan["results"]:
        plan_pts.setdefault(r["layout"], []).append((r["rate"], r["metrics"]["slo_attainment"]))
    for i, (name, curve) in enumerate(sweep["measured"].items()):
        rates = sorted(curve)
        ax.plot(rates, [curve[r] * 100 for r in rates], "-o", color=f"C{i}", label=f"{name} measured")
        if name in plan_pts:
            xs, ys = zip(*sorted(plan_pts[name]))
            ax.plot(xs, [y * 100 for y in ys], "--", color=f"C{i}", alpha=0.7, label=f"{name} tandem plan")
    ax.axhline(plan["slo"]["target_attainment"] * 100, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("Poisson rate (requests/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
