"""The sweep that picks the conditional-disaggregation threshold (deployment key local_prefill_tokens).

Two 1P1D stacks with the prefix cache on, one that always hands the prompt to the prefill worker
(threshold 0) and one where the decode worker always prefills what it lacks itself. Both first see a
shared prefix (so both workers cache it); then, for each suffix length L, `reps` probes of prefix + L
new tokens are sent one after another while `background` clients stream long answers from the same
decode worker. Measured per L and stack: the probes' TTFT, and the background streams' ITL p99 (a
local prefill shares the decode worker's passes with them).

The threshold is the largest L such that at every length up to it, prefilling locally gives a TTFT
no worse than handing off, and background ITL p99 at most ITL_TOLERANCE times the handoff's.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import random
import sys
import tempfile

import yaml

from clients.bench.multiturn import Turn, make_turns_client
from clients.bench.bench_report import write_json
from clients.bench.stats import percentile
from clients.bench.bench_workload import make_prompt
from ops.serve_process import ServeProcess

ITL_TOLERANCE = 1.5
STACKS = {"handoff": 0, "local": 1 << 30}  # local_prefill_tokens: never / always local


def pick_threshold(rows: list[dict]) -> int:
    """rows: per length, {"tokens", "ttft_p50_s": {stack: s}, "itl_p99_s": {stack: s}}, shortest first."""
    best = 0
    for r in sorted(rows, key=lambda r: r["tokens"]):
        t, i = r["ttft_p50_s"], r["itl_p99_s"]
        if t["local"] > t["handoff"] or i["local"] > ITL_TOLERANCE * i["handoff"]:
            break
        best = r["tokens"]
    return best


def run_sweep(engines: str, out: str, lengths: list[int], reps: int, prefix_tokens: int, background: int,
              kv_pool_bytes: int, tokenizer, log=print) -> dict:
    rng = random.Random(0)
    prefix = make_prompt(tokenizer, prefix_tokens, rng)
    suffixes = {n: [make_prompt(tokenizer, n, rng) for _ in range(reps)] for n in lengths}
    streams = [make_prompt(tokenizer, 64, rng) for _ in range(background)]
    measured = {}
    work = tempfile.mkdtemp(prefix="tandem-sweep-")
    for name, threshold in STACKS.items():
        folder = os.path.join(work, name)
        os.makedirs(folder)
        with open(os.path.join(folder, "deployment.yaml"), "w") as f:
            yaml.safe_dump({"local_prefill_tokens": threshold}, f)
        log(f"[{name}] starting tandem serve (logs in {folder}) ...")
        serve = ServeProcess(folder, ("--model", engines, "--kv-pool-bytes", str(kv_pool_bytes),
                                      "--config", os.path.join(folder, "deployment.yaml"))).start()
        try:
            measured[name] = asyncio.run(_probe_all(serve.http, prefix, suffixes, streams))
        finally:
            serve.stop()
    rows = [{"tokens": n, "ttft_p50_s": {s: measured[s][n]["ttft_p50_s"] for s in STACKS},
             "itl_p99_s": {s: measured[s][n]["itl_p99_s"] for s in STACKS}} for n in lengths]
    doc = {"command": "python " + " ".join(sys.argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "cpus": len(os.sched_getaffinity(0)), "prefix_tokens": prefix_tokens, "reps": reps,
           "background_streams": background, "itl_tolerance": ITL_TOLERANCE, "rows": rows,
           "threshold": pick_threshold(rows)}
    write_json(os.path.join(out, "sweep.json"), doc)
    with open(os.path.join(out, "sweep.md"), "w") as f:
        f.write(_markdown(doc))
    return doc


async def _probe_all(url: str, prefix: str, suffixes: dict[int, list[str]], streams: list[str]) -> dict:
    client = make_turns_client("openai", url)
    try:
        await client.send(Turn(-1, 0), prefix, 4)  # both workers now hold the prefix
        out = {}
        for n, texts in suffixes.items():
            bg = [Turn(-2, i) for i in range(len(streams))]
            tasks = [asyncio.create_task(client.send(r, s, 96)) for r, s in zip(bg, streams)]
            await asyncio.sleep(1.0)  # the background streams are decoding
            probes = []
            for text in texts:
                probes.append(Turn(-3, n))
                await client.send(probes[-1], prefix + text, 4)
            await asyncio.gather(*tasks)
            gaps = [b - a for r in bg for a, b in zip(r.response_times, r.response_times[1:])]
            out[n] = {"ttft_p50_s": percentile([p.response_times[0] for p in probes if p.ok], 50),
                      "itl_p99_s": percentile(gaps, 99)}
        return out
    finally:
        await client.close()


def _markdown(doc: dict) -> str:
    lines = ["# Conditional disaggregation: the threshold sweep\n",
             f"Command: `{doc['command']}`  \nDate: {doc['date']}  \n{doc['cpus']} cores; a {doc['prefix_tokens']}-token "
             f"prefix cached on both workers, {doc['reps']} probes per length, {doc['background_streams']} background "
             f"streams on the decode worker.\n",
             "| new tokens | TTFT p50 handoff ms | TTFT p50 local ms | ITL p99 handoff ms | ITL p99 local ms |",
             "|---|---|---|---|---|"]
    for r in doc["rows"]:
        t, i = r["ttft_p50_s"], r["itl_p99_s"]
        lines.append(f"| {r['tokens']} | {t['handoff'] * 1e3:.0f} | {t['local'] * 1e3:.0f} | "
                     f"{i['handoff'] * 1e3:.0f} | {i['local'] * 1e3:.0f} |")
    lines += ["", f"Threshold picked: **{doc['threshold']}** tokens (the largest length up to which a local "
                  f"prefill is no slower to the first token and keeps ITL p99 within {doc['itl_tolerance']}x).", ""]
    return "\n".join(lines)
