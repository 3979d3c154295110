"""The check's output: one table row per measurement, and the JSON file with everything."""

from __future__ import annotations

import json
import os


def rows(results: dict) -> list[tuple[str, str, str]]:
    """(section, what, value) rows from the sections' results."""
    out = []
    for name, sec in results["sections"].items():
        if sec.get("error"):
            out.append((name, "ERROR", sec["error"][:100]))
            continue
        if sec.get("skipped"):
            out.append((name, "skipped", sec["skipped"]))
            continue
        for key, value in sec["results"].items():
            if isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in value.items())
            elif isinstance(value, list):
                value = "; ".join(", ".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else str(x)
                                  for x in value)
            out.append((name, key, str(value).replace("\n", "\\n")))
        out.append((name, "seconds", f"{sec['seconds']:.1f}"))
    return out


def table(results: dict) -> str:
    body = rows(results) or [("-", "-", "no section ran")]
    w0 = max(len(r[0]) for r in body)
    w1 = max(len(r[1]) for r in body)
    lines = [f"gpu-check on {results['env'].get('gpu', results['env']['device'])} "
             f"(torch {results['env']['torch']}); model: {results['model']}"]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in body]
    lines.append(f"verdict: {'PASS' if results['passed'] else 'FAIL'} ({results['total_seconds']:.0f} s)")
    return "\n".join(lines)


def write_json(results: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    return path
