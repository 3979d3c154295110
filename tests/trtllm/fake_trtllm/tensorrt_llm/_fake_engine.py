"""NOT TensorRT-LLM (see the package docstring): the test double's LLM, on Tandem's own engine.

One thread runs Tandem's PyTorch engine (float32, CPU) with its continuous-batching Scheduler over
every request of this LLM; results reach the asyncio loop that submitted them through
`call_soon_threadsafe`. Greedy tokens are Tandem's own engine's.

Disaggregated requests, and the "cache transceiver":
- context_only: the prompt is prefilled, its first token sampled, the request finishes with
  finish_reason "not_finished" (or "stop" when that token ends it) and DisaggregatedParams whose
  opaque_state names a record this LLM keeps of the context (`<hold dir>/<ctx_request_id>`: the prompt
  and the first token) in an owner-only folder of its own.
- generation_only: the generation side takes the record away (a pull: at most one generation side
  gets it), checks it against the prompt and first token it was given, then RECOMPUTES the K/V of
  prompt + first token with its own engine and continues decoding. No K/V bytes move between the two
  processes: this double does not model the transfer's cost, only its protocol and its failures.
  A record that is gone (already pulled, expired, never written) fails the request with RequestError,
  as a failed transfer does in TensorRT-LLM.
- records not pulled within cache_transceiver_config.kv_transfer_timeout_ms are dropped (TensorRT-LLM's
  own bound on a context's held K/V).
Failure injection for tests (env of the worker): TANDEM_FAKE_TRTLLM_DROP_CONTEXTS=N drops the records of
this LLM's first N context requests, so their pulls fail (the one thing a test cannot cause otherwise
without racing a kill against the orchestrator).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections import namedtuple

from engine.load import load_engine
from engine.scheduler import Scheduler
from tandem.sampling_params import SamplingParams as TandemSampling
from tensorrt_llm.disaggregated_params import DisaggregatedParams, DisaggScheduleStyle
from tensorrt_llm.executor.utils import RequestError

LLM_ARGS = {"max_batch_size", "max_num_tokens", "max_seq_len", "tensor_parallel_size", "enable_chunked_prefill",
            "disable_overlap_scheduler", "print_iter_log", "kv_cache_config", "cuda_graph_config",
            "cache_transceiver_config"}  # api_surface.json: llm_args_fields.top
KV_BYTES = 64 << 20
Logprob = namedtuple("Logprob", "logprob rank")  # TensorRT-LLM's per-token logprob entry


def tandem_params(sp, max_tokens: int) -> TandemSampling:
    greedy = sp.top_k == 1 or not sp.temperature
    stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
    return TandemSampling(max_tokens=max_tokens, temperature=0.0 if greedy else sp.temperature,
                          top_k=0 if greedy else (sp.top_k or 0), top_p=1.0 if greedy else (sp.top_p or 1.0),
                          seed=sp.seed, stop=stop, stop_token_ids=tuple(sp.stop_token_ids or ()),
                          ignore_eos=sp.ignore_eos, min_tokens=sp.min_tokens or 0, logprobs=bool(sp.logprobs))


class CompletionOutput:
    def __init__(self, token_ids: list[int], logprobs: list[dict]):
        self.token_ids, self.logprobs = token_ids, logprobs
        self.finish_reason: str | None = None
        self.disaggregated_params: DisaggregatedParams | None = None


class RequestOutput:
    """One request's result, updated on the submitting loop's thread only."""

    def __init__(self, llm: "LLM", loop: asyncio.AbstractEventLoop, first: list[int], streaming: bool):
        self.llm, self.loop, self.streaming = llm, loop, streaming
        self.outputs = [CompletionOutput(list(first), [{} for _ in first])]
        self.finished = False
        self.error: BaseException | None = None
        self.updates: asyncio.Queue = asyncio.Queue()
        self.seq = None  # the engine thread's Sequence

    def abort(self) -> None:
        self.llm.submit_abort(self)

    async def aresult(self) -> "RequestOutput":
        while not self.finished and self.error is None:
            await self.updates.get()
        if self.error is not None:
            raise self.error
        return self

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        while True:
            await self.updates.get()
            if self.error is not None:
                raise self.error
            yield self
            if self.finished:
                return

    # -- from the engine thread ---------------------------------------------------------------------
    def post(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(self._apply, fn, args)

    def _apply(self, fn, args) -> None:
        fn(*args)
        self.updates.put_nowait(None)

    def add_token(self, token: int, logprob: float | None, reason: str | None, dp=None) -> None:
        c = self.outputs[0]
        c.token_ids.append(token)
        c.logprobs.append({token: Logprob(logprob, 1)} if logprob is not None else {})
        c.finish_reason, c.disaggregated_params = reason, dp
        self.finished = reason is not None

    def fail(self, error: BaseException) -> None:
        self.error = error

    def cancelled(self) -> None:
        self.outputs[0].finish_reason, self.finished = "cancelled", True


class LLM:
    def __init__(self, model: str, backend: str = "pytorch", **options):
        unknown = set(options) - LLM_ARGS
        if backend != "pytorch" or unknown:
            raise ValueError(f"fake tensorrt_llm: backend must be 'pytorch' and options among {sorted(LLM_ARGS)}; "
                             f"got backend {backend!r}, unknown {sorted(unknown)}")
        kv = options.get("kv_cache_config") or {}
        self.engine = load_engine(model, dtype="float32", device="cpu", tokens_per_page=kv.get("tokens_per_block", 16),
                                  kv_bytes=KV_BYTES, prefix_cache=kv.get("enable_block_reuse", True), cuda_graphs=False)
        timeout_ms = (options.get("cache_transceiver_config") or {}).get("kv_transfer_timeout_ms") or 30_000
        self.hold_s, self.holds = timeout_ms / 1000, tempfile.mkdtemp(prefix="fake-trtllm-holds-")
        self.drop = int(os.environ.get("TANDEM_FAKE_TRTLLM_DROP_CONTEXTS", "0"))
        self.sched = Scheduler(self.engine, max_batch_size=options.get("max_batch_size", 64))
        self.ids = itertools.count(1)
        self.inbox: list[tuple[str, RequestOutput, object]] = []
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="fake-trtllm-engine", daemon=True)
        self.thread.start()

    def generate_async(self, inputs: list[int], sampling_params, streaming: bool = False,
                       disaggregated_params: DisaggregatedParams | None = None) -> RequestOutput:
        dp = disaggregated_params
        kind = dp.request_type if dp is not None else "context_and_generation"
        if kind not in ("context_only", "generation_only", "context_and_generation"):
            raise ValueError(f"unknown request_type {kind!r}")
        first = list(dp.first_gen_tokens or []) if kind == "generation_only" else []
        out = RequestOutput(self, asyncio.get_running_loop(), first, streaming)
        self._post("new", out, (kind, list(inputs), sampling_params, dp))
        return out

    def submit_abort(self, out: RequestOutput) -> None:
        self._post("abort", out, None)

    def shutdown(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout=30)
        shutil.rmtree(self.holds, ignore_errors=True)

    def _post(self, what: str, out: RequestOutput, arg) -> None:
        with self.cond:
            self.inbox.append((what, out, arg))
            self.cond.notify()

    # -- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        by_seq: dict[object, tuple[RequestOutput, str]] = {}
        while True:
            with self.cond:
                while not self.inbox and not self.sched.has_work and not self.closed:
                    self.cond.wait(timeout=1.0)
                    self._expire()
                if self.closed:
                    return
                inbox, self.inbox = self.inbox, []
            for what, out, arg in inbox:
                if what == "new":
                    self._start(out, *arg, by_seq=by_seq)
                elif out.seq is not None and out.seq in by_seq:
                    self.sched.remove(out.seq)
                    self.engine.abort(out.seq)
                    by_seq.pop(out.seq)
                    out.post(out.cancelled)
            for ev in self.sched.step() if self.sched.has_work else []:
                out, kind = by_seq[ev.seq]
                reason = ev.seq.finish_reason.value if ev.seq.finished else None
                dp = None
                if kind == "context_only" and reason != "stop":
                    reason, dp = "not_finished", self._hold(ev.seq, ev.token)
                out.post(out.add_token, ev.token, ev.logprob, reason, dp)
                if reason is not None:
                    self.engine.release(ev.seq)
                    by_seq.pop(ev.seq, None)
            self._expire()

    def _start(self, out: RequestOutput, kind, ids, sp, dp, by_seq) -> None:
        try:
            if kind == "generation_only":
                self._pull(dp, ids)
            n = 1 if kind == "context_only" else sp.max_tokens
            params = tandem_params(sp, n)
            seq = self.engine.new_sequence(f"fake-{id(out)}", ids, params, output_ids=list(out.outputs[0].token_ids))
            self.engine.admit(seq)
        except RequestError as e:
            out.post(out.fail, e)
            return
        except Exception as e:  # noqa: BLE001 - what TensorRT-LLM reports for a request it cannot run
            out.post(out.fail, RequestError(f"fake tensorrt_llm: {type(e).__name__}: {e}"))
            return
        out.seq = seq
        by_seq[seq] = (out, kind)
        self.sched.add_prefill(seq)

    def _hold(self, seq, token: int) -> DisaggregatedParams:
        """The context's record (see the module docstring) and the params that name it."""
        ctx_id = next(self.ids)
        path = os.path.join(self.holds, str(ctx_id))
        if self.drop > 0:
            self.drop -= 1
        else:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"prompt": seq.prompt_ids, "first": token, "at": time.time()}, f)
        state = json.dumps({"holds": self.holds, "id": ctx_id}).encode()
        return DisaggregatedParams(request_type="context_only", first_gen_tokens=[token], ctx_request_id=ctx_id,
                                   opaque_state=state, schedule_style=DisaggScheduleStyle.CONTEXT_FIRST)

    @staticmethod
    def _pull(dp: DisaggregatedParams, ids: list[int]) -> None:
        """Take the context's record away (RequestError when it is gone or does not match)."""
        state = json.loads(bytes(dp.opaque_state).decode())
        path = os.path.join(state["holds"], str(state["id"]))
        claimed = f"{path}.{os.getpid()}.{threading.get_ident()}"
        try:
            os.rename(path, claimed)  # atomic: one generation side gets it
        except OSError as e:
            raise RequestError(f"fake tensorrt_llm: the context {state['id']} is not held any more ({e.strerror})") \
                from None
        with open(claimed, encoding="utf-8") as f:
            record = json.load(f)
        os.unlink(claimed)
        if record["prompt"] != ids or [record["first"]] != list(dp.first_gen_tokens or []):
            raise RequestError("fake tensorrt_llm: the context held is not this request's")

    def _expire(self) -> None:
        now = time.time()
        for name in os.listdir(self.holds):
            path = os.path.join(self.holds, name)
            try:
                if now - os.path.getmtime(path) > self.hold_s:
                    os.unlink(path)
            except OSError:
                pass  # pulled meanwhile
