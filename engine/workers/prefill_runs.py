"""The prefill worker's passes (engine/workers/prefill_worker.py holds its calls and queue): a packed
pass of whole prompts, the next chunk of a long one, a pass given up for requests that left, and the
answer (the first token, and in the pull handoff the hold on the prompt's pages)."""

from __future__ import annotations

import time

from engine.attention import PassStopped
from engine.workers.prefill_items import PrefillItem, send_cached
from tandem.status import Cancelled, TandemError, status_of
from tandem.tracing import ns_at
from tandem.wire import Prefilled


class PrefillRuns:
    """The pass-running half of PrefillWorker (a mixin: it uses the worker's state)."""

    def _packed(self, group: list[PrefillItem]) -> None:
        """Two passes: the pooled items continue against their pages (cached prefix), then the others go
        straight into their writers (no room in the pool, or no cache). Items whose pass completed are
        answered even when the other pass is given up or fails (their first token is appended: computing
        them again would answer the token after it)."""
        t0 = time.perf_counter()
        for it in group:
            it.started_at = it.started_at or t0
        pooled = [it for it in group if it.pooled]
        direct = [it for it in group if not it.pooled]
        work = {it: self._todo(it) for it in group}
        half = sum(work.values()) / 2

        def stop() -> bool:  # most of the pass is for requests that left: cheaper to redo the rest
            return sum(n for it, n in work.items() if it.aborted) >= half

        done: list[tuple[PrefillItem, tuple]] = []  # (item, its first token) of each pass that completed
        try:
            if pooled:
                for it in pooled:
                    send_cached(self.engine.cache, it)
                done += zip(pooled, self.engine.extend([it.seq for it in pooled], [work[it] for it in pooled],
                                                       [it.writer for it in pooled], stop))
            if direct:
                done += zip(direct, self.engine.prefill([it.seq for it in direct], [it.writer for it in direct], stop))
        except PassStopped:
            self._redo_live(direct if done else group)
        except Exception as e:  # a failed pass fails its requests, not the worker
            for it in direct if done else group:
                self._fail(it, e)
        compute = time.perf_counter() - t0
        for it, out in done:
            it.compute_s = compute
            if it.pooled and not it.msg.pull:
                self._release(it, computed=True)
            self._answer(it, out)

    def _redo_live(self, group: list[PrefillItem]) -> None:
        """After a pass was given up: its aborted requests end, the others go back to the head of the
        queue with no pages (they are reserved again and computed from where their cache left them);
        their writers first let any write of the given-up pass land, since the redo writes it again."""
        ended = [it for it in group if it.aborted]  # one reading: an abort may land while we work
        live = [it for it in group if it not in ended]
        for it in ended:
            self._end_cancelled(it)
        for it in live:
            it.writer.settle()
            self._release(it, computed=False)
        with self.lock:
            self.queue[:0] = live

    def _chunk(self, it: PrefillItem) -> None:
        seq, engine = it.seq, self.engine
        it.started_at = it.started_at or time.perf_counter()
        if not seq.page_table:
            with self.lock:
                full = self._reserve(it)
                if full is not None and any(x.chunked for x in self.queue):
                    self.queue.append(it)  # others hold the pool; try again after them
                    return
            if full is not None:
                self._fail(it, full)
                return
            send_cached(engine.cache, it)
        n = min(self.chunk_tokens, seq.num_tokens - seq.num_cached)
        t0 = time.perf_counter()
        try:
            out = engine.extend([seq], [n], [it.writer], stop=lambda: it.aborted)[0]
        except PassStopped:  # aborted mid-chunk: its pages are free now, not when the chunk would end
            self._end_cancelled(it)
            return
        except Exception as e:  # a failed chunk must not hold pages or leave the writer open
            self._fail(it, e)
            return
        it.compute_s += time.perf_counter() - t0
        if out is None and not it.aborted:
            with self.lock:
                if self.caching:
                    self.engine.prefix.commit(seq)  # its finished chunks can serve others already
                self.queue.insert(0, it)  # more chunks to go; keeps its place as the oldest long prompt
            return
        if it.aborted:
            self._end_cancelled(it)
            return
        if not it.msg.pull:
            self._release(it, computed=True)
        self._answer(it, out)

    def _answer(self, it: PrefillItem, out) -> None:
        if it.aborted:
            self._end_cancelled(it)
            return
        token, logprob = out
        t1 = time.perf_counter()
        if not it.msg.pull:  # a pull item stays findable by Abort until it is held (see _hold)
            self._done(it)
        try:
            it.writer.finish()
        except TandemError as e:  # LeaseLost (the decode side took its pages back) or TransferFailed
            self._traced(it, t1, time.perf_counter(), e)
            it.sink.fail(e)
            return
        self._traced(it, t1, time.perf_counter())
        reason = it.seq.finish_reason.value if it.seq.finish_reason else None
        source = None
        if it.msg.pull and reason is not None:  # the first token ends it: nothing to hold
            self._done(it)
            self._release(it, computed=True)
        elif it.msg.pull and (source := self._hold(it, token, logprob)) is None:
            return
        it.sink.send(Prefilled(it.msg.request_id, token, logprob, reason, it.writer.bytes_written,
                               time.perf_counter() - t1, it.compute_s, it.started_at - it.queued_at,
                               cached_tokens=it.cached_tokens, top=it.seq.top_report,
                               prompt_logprobs=it.seq.prompt_logprobs, source=source),
                       final=source is None)

    def _traced(self, it: PrefillItem, computed: float, written: float, error: BaseException | None = None) -> None:
        """This worker's part of the request's trace (under the orchestrator's `tandem.prefill` span):
        its wait in the queue, its passes, and (push) its K/V writes into the decode worker's pages,
        which overlap the passes layer by layer and end when the last write landed (`written`)."""
        parent = it.msg.traceparent
        if not parent:
            return
        started, tokens = ns_at(it.started_at), len(it.msg.prompt_ids) + len(it.msg.output_ids)
        self.tracer.record("tandem.prefill.queue", parent, ns_at(it.queued_at), started, tokens=tokens)
        self.tracer.record("tandem.prefill.compute", parent, started, ns_at(computed), tokens=tokens,
                           cached_tokens=it.cached_tokens, compute_seconds=it.compute_s, chunked=it.chunked)
        if it.msg.destination is not None:
            self.tracer.record("tandem.kv_transfer", parent, started, ns_at(written), direction="push",
                               transport=it.msg.destination.transport, bytes=it.writer.bytes_written,
                               wait_after_compute_seconds=written - computed,
                               status=status_of(error).value if error is not None else "OK")

    def _hold(self, it: PrefillItem, token: int, logprob: float | None):
        """Keep a pull item's pages for its reader; None (and the request ended) if it cannot be held."""
        with self.lock:
            if self.caching:
                self.engine.prefix.commit(it.seq)  # others may share the prefix while it is held
        try:
            source = self.holds.keep(it, token, logprob, it.msg.reader_host, it.msg.reader)
        except TandemError as e:
            self._done(it)
            self._release(it, computed=True)
            it.sink.fail(e)
            return None
        self._done(it)
        if it.aborted:  # an Abort that found it still active: it ended the hold too, or ends it here
            self.holds.end(it.msg.request_id, error=Cancelled(f"prefill of {it.msg.request_id} was aborted"),
                           reader_closed=True)  # nobody was handed the source
            return None
        return source
