"""One chaos run: the configuration for its length, references, and (optionally) its own deployment,
with the check that nothing of it is left once it stopped (clients/chaos/leftovers.py: its own
processes and shared memory only, not those of others on the same machine)."""

from __future__ import annotations

import asyncio
import json
import os

from clients.chaos.harness import CANARIES, EXTRA, LOAD, ChaosConfig, Harness, server_references
from clients.chaos.leftovers import Tracker
from clients.chaos.scenarios import LONG_PROMPT


class ChaosRun:
    def __init__(self, faults: list, quick: bool, capacity: int, engines: str | None, log=print):
        self.faults, self.capacity, self.engines, self.log = faults, capacity, engines, log
        self.quick = quick

    def config(self, url: str, workdir: str) -> ChaosConfig:
        if self.quick:
            return ChaosConfig(url, workdir, load_clients=2, settle_s=1.0, stop_s=7.0, storm=100, burst_factor=10, bursts=1,
                               capacity=self.capacity, backlog=3, recover_timeout_s=90.0)
        return ChaosConfig(url, workdir, capacity=self.capacity)

    def lengths(self, cfg: ChaosConfig) -> dict[str, int]:
        """Every prompt whose answer is checked, with the number of tokens it asks for."""
        out = {p: cfg.canary_tokens for p in CANARIES} | {p: cfg.load_tokens for p in LOAD}
        return out | {LONG_PROMPT: 8, "Name a color.": 8}

    def references(self, cfg: ChaosConfig) -> dict[str, str]:
        lengths = self.lengths(cfg)
        if self.engines is None:
            return asyncio.run(server_references(cfg.url, lengths))
        from engine.generate import run_generation
        from engine.load import load_engine

        engine = load_engine(os.path.join(self.engines, "prefill"), kv_bytes=256 << 20)
        return {p: run_generation(engine, engine.tokenizer.encode(p), _params(n, EXTRA.get(p, {}))).text
                for p, n in lengths.items()}

    async def against(self, url: str, workdir: str, references: dict | None = None) -> dict:
        cfg = self.config(url, workdir)
        refs = references if references is not None else await asyncio.to_thread(self.references, cfg)
        return await Harness(cfg, refs).run(self.faults)

    def with_serve(self, args: list[str], workdir: str) -> dict:
        """Start `tandem serve ARGS`, run the faults against it, stop it, and list what it left behind."""
        from ops.serve_process import ServeProcess

        tracker = Tracker().start()
        try:
            serve = ServeProcess(workdir, tuple(args), env=tracker.env).start()
            try:
                cfg = self.config(serve.http, workdir)
                refs = self.references(cfg)
                doc = asyncio.run(Harness(cfg, refs).run(self.faults))
            finally:
                code = serve.stop()
        finally:
            tracker.stop()
        doc["serve_exit_code"] = code
        doc["leftovers"] = tracker.leftovers()
        return doc


def _params(max_tokens: int, extra: dict):
    """The SamplingParams the OpenAI door makes of a harness request's fields (greedy unless `extra`
    gives a temperature, a seed, a guided_json schema)."""
    from tandem.guides import Guide, GuideKind
    from tandem.sampling_params import SamplingParams

    schema = extra.get("guided_json")
    return SamplingParams(max_tokens=max_tokens, temperature=extra.get("temperature", 0.0), seed=extra.get("seed"),
                          guide=Guide(GuideKind.JSON_SCHEMA, json.dumps(schema)) if schema is not None else None)
