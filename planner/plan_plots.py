"""The plan's plot: SLO attainment vs Poisson rate per layout (capacity), or vs devices (sizing).

DistServe-style: the horizontal line is the attainment target; where a layout's curve crosses it is
the rate that layout sustains.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def plot_plan(doc: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    target = doc["slo"]["target_attainment"]
    series: dict[str, list[tuple[float, float]]] = {}
    x_key = "rate" if doc["mode"] == "capacity" else "devices"
    for r in doc["results"]:
        name = r["layout"] if doc["mode"] == "capacity" else _family(r["layout"])
        series.setdefault(name, []).append((r[x_key], r["metrics"]["slo_attainment"]))
    for name, pts in series.items():
        if doc["mode"] == "sizing":  # the best layout of a family at each device count
            best: dict[float, float] = {}
            for x, y in pts:
                best[x] = max(y, best.get(x, 0.0))
            pts = sorted(best.items())
        xs, ys = zip(*sorted(pts))
        style = "-o" if name[0].isdigit() or name.startswith("best") else "--s"
        ax.plot(xs, [y * 100 for y in ys], style, label=name, markersize=4)
        if doc["mode"] == "capacity":
            s = doc["sustained"][name]["rate"]
            if s > 0:
                ax.plot([s], [target * 100], "kx", markersize=6)
    ax.axhline(target * 100, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("Poisson rate (requests/s)" if doc["mode"] == "capacity" else "devices")
    if doc["mode"] == "sizing":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    slo = doc["slo"]
    ax.set_title(f"{doc['profile']['name']}\nTTFT <= {slo['ttft_s'] * 1e3:g} ms, TPOT <= {slo['tpot_s'] * 1e3:g} ms, "
                 f"{slo['target_attainment']:.0%} target", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _family(layout: str) -> str:
    """Sizing plots one line per family: the best xPyD split, and each co-located variant."""
    if layout[0].isdigit():
        return "best xPyD"
    kind, shape = layout.split()
    return f"{kind} {'replicas' if shape.endswith('x1') else 'one worker'}"
