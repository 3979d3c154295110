"""Statistics and the Markdown table of multi-turn runs (clients/bench/multiturn.py).

Per run, three groups: every turn, the first turns (nothing of the conversation cached yet but the
system prompt), and the later turns (turn >= 2, where a prefix cache pays). Per group: TTFT p50/p99,
ITL p99, KV bytes moved per request and prefix-cache hit rate (both from the front door's counters,
read between rounds), the share of turns a decode worker prefilled itself, and goodput.
"""

from __future__ import annotations

from clients.bench.multiturn import Turn
from clients.bench.stats import percentile

GROUPS = {"all": lambda t: True, "turn 1": lambda t: t == 1, "turns >= 2": lambda t: t >= 2}


def summarize_multiturn(run: dict, slo_ttft: float, slo_tpot: float) -> dict:
    """{group: statistics} for one run ({"turns": [...], "rounds": [...]})."""
    return {name: _group(run, keep, slo_ttft, slo_tpot) for name, keep in GROUPS.items()}


def _group(run: dict, keep, slo_ttft: float, slo_tpot: float) -> dict:
    turns: list[Turn] = [t for t in run["turns"] if keep(t.turn)]
    rounds = [r for r in run["rounds"] if keep(r["turn"])]
    ok = [t for t in turns if t.ok]
    if not ok:
        return {"requests": len(turns), "failed": len(turns), "error": "no turn completed"}
    gaps = [b - a for t in ok for a, b in zip(t.response_times, t.response_times[1:])]
    tpot = [_tpot(t) for t in ok if len(t.response_times) > 1]
    good = [t for t in ok if t.response_times[0] <= slo_ttft and _tpot(t) <= slo_tpot]
    wall = sum(r["wall_s"] for r in rounds)
    out = {"requests": len(turns), "failed": len(turns) - len(ok),
           "ttft_p50_s": percentile([t.response_times[0] for t in ok], 50),
           "ttft_p99_s": percentile([t.response_times[0] for t in ok], 99),
           "itl_p99_s": percentile(gaps, 99), "tpot_p50_s": percentile(tpot, 50),
           "goodput_rps": len(good) / wall if wall else 0.0, "met_slo": len(good)}
    if rounds and "kv_bytes" in rounds[0]:
        looked = sum(r["hit_pages"] + r["miss_pages"] for r in rounds)
        out.update(kv_bytes_per_request=sum(r["kv_bytes"] for r in rounds) / len(turns),
                   hit_rate=sum(r["hit_pages"] for r in rounds) / looked if looked else 0.0,
                   local_prefill_share=sum(r["local_prefills"] for r in rounds) / len(turns))
    usage = [t for t in ok if t.cached_tokens is not None and t.prompt_tokens]
    if usage:
        out["cached_token_share"] = sum(t.cached_tokens for t in usage) / sum(t.prompt_tokens for t in usage)
    return out


def _tpot(t: Turn) -> float:
    """Seconds per response after the first (0 for a one-response answer)."""
    r = t.response_times
    return (r[-1] - r[0]) / (len(r) - 1) if len(r) > 1 else 0.0


def _cell(s: dict, key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    return fmt.format(s[key] * scale) if key in s else "-"


def multiturn_table(results: dict[str, dict], group: str) -> str:
    """results: label -> summarize_multiturn(...); one row per label for `group`."""
    head = ("| | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | KV MB/request | hit rate | local prefill | "
            "goodput req/s | failed |")
    rows = [head, "|---" * 9 + "|"]
    for label, summary in results.items():
        s = summary[group]
        if "error" in s:
            rows.append(f"| {label} | " + " | ".join(["-"] * 7) + f" | {s['failed']} |")
            continue
        rows.append(f"| {label} | {_cell(s, 'ttft_p50_s', 1e3)} | {_cell(s, 'ttft_p99_s', 1e3)} | "
                    f"{_cell(s, 'itl_p99_s', 1e3)} | {_cell(s, 'kv_bytes_per_request', 1e-6, '{:.2f}')} | "
                    f"{_cell(s, 'hit_rate', 100, '{:.0f}%')} | {_cell(s, 'local_prefill_share', 100, '{:.0f}%')} | "
                    f"{s['goodput_rps']:.3f} | {s['failed']} |")
    return "\n".join(rows)


def turns_json(turns: list[Turn]) -> list[dict]:
    return [{"conversation": t.conversation, "turn": t.turn, "response_times": t.response_times,
             "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens, "error": t.error} for t in turns]
