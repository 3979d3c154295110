"""The chaos report: per fault and overall, as a JSON document and a Markdown summary."""

from __future__ import annotations

import json
import os
from collections import Counter

from clients.chaos.harness import EXTRA

# outcomes that are not failures of the server: the client walked away, or the request was shed (429)
NOT_FAILED = {"OK", "CLIENT_CANCELLED"}


def _stats(outs: list) -> dict:
    ended = [o for o in outs if o.status]
    failed = Counter(o.status for o in ended if o.status not in NOT_FAILED)
    canaries = [o for o in ended if o.kind == "canary"]
    checked = [o for o in ended if o.correct is not None]
    return {
        "sent": len(outs), "completed": sum(o.status == "OK" for o in ended),
        "failed": dict(sorted(failed.items())), "failed_total": sum(failed.values()),
        "client_cancelled": sum(o.status == "CLIENT_CANCELLED" for o in ended),
        "canaries": len(canaries),
        "canary_error_rate": (sum(o.status != "OK" or o.correct is False for o in canaries) / len(canaries)
                              if canaries else None),
        "checked": len(checked), "wrong": sum(o.correct is False for o in checked),
        "checked_structured": sum(o.prompt in EXTRA for o in checked),  # of them, sampled structured answers
        "longest_s": max((o.seconds for o in ended), default=0.0),
    }


def summarize(h, t0: float, idle_pages: float | None) -> dict:
    scenarios = []
    for w in h.windows:
        end = w.recovered_at or w.fault_end + h.cfg.recover_timeout_s
        inside = [o for o in h.outcomes if w.start <= o.start <= end]
        scenarios.append({"name": w.name, "fault_s": w.fault_end - w.start,
                          "time_to_recover_s": None if w.recovered_at is None else w.recovered_at - w.start,
                          "recovered": w.recovered_at is not None, **_stats(inside), "details": w.details})
    return {"config": {k: getattr(h.cfg, k) for k in h.cfg.__dataclass_fields__},
            "duration_s": max((o.end for o in h.outcomes), default=t0) - t0,
            "overall": _stats(h.outcomes), "scenarios": scenarios, "pages_in_use_at_end": idle_pages}


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {n}" for k, n in v.items()) or "0"
    return str(v)


def markdown(doc: dict, command: str) -> str:
    lines = ["# Fault injection (`tandem chaos`)", "", f"Command: `{command}`", "",
             "| fault | sent | completed | failed (by status) | canary errors in window | time to recover s | "
             "wrong answers | longest s |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for s in doc["scenarios"]:
        lines.append(f"| {s['name']} | {s['sent']} | {s['completed']} | {_fmt(s['failed'])} | "
                     f"{_fmt(s['canary_error_rate'])} | {_fmt(s['time_to_recover_s'])} | {s['wrong']} of "
                     f"{s['checked']} | {_fmt(s['longest_s'])} |")
    o = doc["overall"]
    lines += ["", f"Overall: {o['sent']} requests, {o['completed']} completed, failed {_fmt(o['failed'])}, "
                  f"{o['client_cancelled']} walked away by design; canary error rate {_fmt(o['canary_error_rate'])}; "
                  f"{o['wrong']} wrong of {o['checked']} checked answers ({o['checked_structured']} of them sampled "
                  f"structured output); longest request {o['longest_s']:.1f} s.",
              f"Pages in use at the end: {_fmt(doc['pages_in_use_at_end'])}.", ""]
    if doc.get("leftovers") is not None:
        lines.append(f"Left over after the deployment stopped (its own processes and shm; others on the machine "
                     f"are not counted): {doc['leftovers'] or 'nothing'}.")
    lines += ["", "Details per fault:", ""]
    for s in doc["scenarios"]:
        lines.append(f"- {s['name']}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in s["details"].items()))
    return "\n".join(lines) + "\n"


def write(doc: dict, out: str, command: str) -> None:
    os.makedirs(out, exist_ok=True)
    doc = dict(doc, command=command)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(doc, command))
