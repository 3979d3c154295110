"""The prefill worker: packed passes over prompts, K/V handed to the decode worker's pages.

For each request in a batch: validate it, open a transport writer into its destination pages, run
packed passes of at most `max_num_tokens` prompt tokens, in arrival order (writers receive each layer
as it is computed), then wait for each writer of the pass to finish and report its requests at once.
A bad request, or a destination that cannot be written, fails alone: the other requests of the batch
still complete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.engine import Engine
from engine.errors import EngineError, InvalidRequest
from engine.sampling import SamplingParams
from engine.transports import KVSender, TransferError, sender
from tandem.wire import PrefillRequest, PrefillResult


class DiscardWriter:
    """No destination: compute the first token only (a benchmark baseline, or a probe)."""

    bytes_written = 0

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        return None

    def finish(self) -> None:
        return None

    def abort(self) -> None:
        return None


@dataclass
class _Item:
    index: int
    req: PrefillRequest
    seq: object
    writer: object


class PrefillWorker:
    def __init__(self, engine: Engine, max_num_tokens: int = 8192):
        self.engine = engine
        self.max_num_tokens = max_num_tokens
        self.senders: dict[str, KVSender] = {}
        self.layout = engine.kv_layout()

    def _sender(self, name: str) -> KVSender:
        if name not in self.senders:
            try:
                self.senders[name] = sender(name, self.layout)
            except ValueError as e:
                raise TransferError(str(e)) from None
        return self.senders[name]

    def run(self, batch: list[tuple[list[int], PrefillRequest]], on_result=None) -> list:
        """One result (a PrefillResult, or the error for that request alone) per (prompt_ids, request),
        in order. `on_result(index, result)` is called as soon as each one is known (after its pass)."""
        results: list = [None] * len(batch)

        def done(i, result):
            results[i] = result
            if on_result is not None:
                on_result(i, result)

        items: list[_Item] = []
        for i, (prompt_ids, req) in enumerate(batch):
            try:
                items.append(self._open(i, prompt_ids, req))
            except (EngineError, TransferError) as e:
                done(i, e)
        for group in self._passes(items):
            t0 = time.perf_counter()
            try:
                outs = self.engine.prefill([it.seq for it in group], [it.writer for it in group])
            except Exception:  # a failed pass must not leave writers half open
                for it in group:
                    it.writer.abort()
                raise
            compute = time.perf_counter() - t0
            for it, (token, logprob) in zip(group, outs):
                t1 = time.perf_counter()
                try:
                    it.writer.finish()
                except TransferError as e:
                    done(it.index, e)
                    continue
                reason = it.seq.finish_reason.value if it.seq.finish_reason else None
                done(it.index, PrefillResult(it.req.request_id, token, logprob, reason, it.writer.bytes_written,
                                             time.perf_counter() - t1, compute))
        return results

    def _open(self, index: int, prompt_ids: list[int], req: PrefillRequest) -> _Item:
        params = SamplingParams.from_dict(req.sampling)
        seq = self.engine.new_sequence(req.request_id, prompt_ids, params, req.output_ids)
        if req.destination is None:
            return _Item(index, req, seq, DiscardWriter())
        dest = req.destination
        name = dest.pool.get("transport") if isinstance(dest.pool, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest("destination.pool has no 'transport' name")
        need = self.layout.pages_for(seq.num_tokens)
        if len(dest.page_ids) < need:
            raise InvalidRequest(f"destination has {len(dest.page_ids)} pages; {seq.num_tokens} tokens need {need}")
        return _Item(index, req, seq, self._sender(name).writer(dest.pool, req.request_id, dest.page_ids))

    def _passes(self, items: list[_Item]) -> list[list[_Item]]:
        """Split into packed passes of at most max_num_tokens tokens (a longer prompt runs alone)."""
        passes, cur, n = [], [], 0
        for it in items:
            if cur and n + it.seq.num_tokens > self.max_num_tokens:
                passes.append(cur)
                cur, n = [], 0
            cur.append(it)
            n += it.seq.num_tokens
        return passes + ([cur] if cur else [])

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        self.senders.clear()
