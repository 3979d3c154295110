"""The control messages between the orchestrator and the workers: typed, JSON on the wire, never pickle.

One frozen dataclass per operation. A request travels as `{"wire": W, "type": T, "body": {...}}`, where W
is `WIRE`, a fingerprint of every message's schema: a worker refuses a request of another schema (an
orchestrator from another Tandem build) with a PROTOCOL_ERROR saying so. A reply travels as
`{"status": S, "message": "...", "type": T, "body": {...}}`, where a non-OK status has no body and
`message` says what went wrong (see tandem/status.py for what each status means). `parse`
(tandem/wire_parse.py: keys, value types, bytes as base64) rejects unknown or missing keys and wrong
types, so a malformed message from a peer is a PROTOCOL_ERROR naming the field, never a crash deeper
in (the orchestrator's client sees a server fault, 500).

Decode and co-located workers (a request's life there: engine/workers/decode_worker.py):
  Open     -> Reserved (pages leased; remote prefill), then Token... after Start; or Token... at once
              (local_prefill). Its calls (this one, then a `Continue -> Token...` after each Token that
              carries `renew`: call_renewal.py) last as long as the reservation; their end is the release.
  Start    -> Ack      the first token (from prefill) is in; the decode stream of that Open begins
  Release  -> Ack      cancel: the Open request ends with CANCELLED; its pages return once fenced
  Open(source) -> Pulled (pull handoff: pages reserved and the K/V read from the prefill worker's
              pool; the orchestrator may release the prefill hold now), then Token...
  WriterGone -> Ack    a prefill worker died: pages quarantined for its NIXL writes are free again
Prefill workers:
  Prefill  -> Prefilled (the first token; K/V written into the Destination)
  Prefill(pull) -> Prefilled(source), the call staying open while the K/V are held for a reader;
              it ends (Ack) when the hold ends: Unhold, Abort, or the caller going away
  Abort    -> Ack      stop a queued or running prefill, or end its hold; it ends with CANCELLED
  Unhold   -> Ack      the reader pulled the K/V (or will never): the held pages go back once no
              reader can still read them
  ReaderGone -> Ack    a decode worker died: holds waiting for its NIXL reads' end are over
TensorRT-LLM workers (its own pull: its cache transceiver moves the K/V; tandem/trtllm_wire.py):
  Prefill (no destination) -> TrtllmPrefilled (the first token and the context side's TrtllmParams)
  TrtllmDecode -> Token...  (generation_only with those params; Abort cancels it)
Every worker:
  Watch    -> WorkerStats... pushed on every change and as a heartbeat; never final while the worker lives
  Stats    -> WorkerStats
  Flush    -> Ack      drop the prefix cache's idle pages (pages in use keep their names)
  Adapters -> Ack      the LoRA adapters (by key) one orchestrator needs: the worker holds those of every
              orchestrator and its own configured ones, loading what is new, dropping what none needs;
              an orchestrator's set is dropped when its last Watch has been gone a while

Prefix-cache reports ride on WorkerStats: a watcher's pushes carry the page hashes its pool started
(`stored`) and stopped (`removed`) holding since that watcher's previous push, or, with `resync`, the
whole set in `stored` (its first push, or after it fell behind). A one-off Stats reply carries none.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from tandem import __version__
from tandem.call_renewal import ANSWER_RENEW_AFTER, WATCH_RENEW_AFTER, Continue
from tandem.logprobs import Logprob
from tandem.pool import Destination, PullSource
from tandem.roles import Role
from tandem.sampling_params import SamplingParams
from tandem.status import InvalidArgument, Status
from tandem.trtllm_wire import TrtllmDecode, TrtllmPrefilled
from tandem.wire_parse import WireError, fingerprint, json_object, parse, to_base64  # noqa: F401 (WireError, parse: re-exported)


# -- requests ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Open:
    TYPE: ClassVar[str] = "open"
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)  # tokens already streamed (a resumed request)
    local_prefill: bool = False  # True: this worker computes the prompt itself (co-located, or a short suffix)
    writer: str = ""  # remote prefill: the prefill worker that will write the pages (its name)
    writer_host: str = ""  # ... and its host identity (tandem.pool.host_identity), to pick the transport
    source: PullSource | None = None  # pull handoff: where the prompt's K/V wait (from Prefilled.source)
    traceparent: str = ""  # W3C trace context of the attempt (tandem/tracing.py); "" when not traced
    renew_after: int = ANSWER_RENEW_AFTER  # tokens per call of this answer (at most that constant)


@dataclass(frozen=True)
class Start:
    TYPE: ClassVar[str] = "start"
    request_id: str
    lease: str
    token: int  # the first token, sampled by the prefill worker
    logprob: float | None = None


@dataclass(frozen=True)
class Release:
    TYPE: ClassVar[str] = "release"
    request_id: str
    lease: str = ""  # empty for a locally prefilled request (it was never handed to a writer)
    writer_closed: bool = False  # the orchestrator knows no writer can still write these pages


@dataclass(frozen=True)
class Prefill:
    TYPE: ClassVar[str] = "prefill"
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)  # tokens already streamed (recovery re-prefill)
    destination: Destination | None = None  # None: compute the first token only (no handoff)
    pull: bool = False  # pull handoff: keep the K/V in this worker's pool for a reader (no destination)
    reader_host: str = ""  # ... on this host (host_identity), to pick the transport it reads over
    reader: str = ""  # ... and its name (for ReaderGone)
    traceparent: str = ""  # W3C trace context of the orchestrator's prefill span; "" when not traced


@dataclass(frozen=True)
class Abort:
    TYPE: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True)
class Unhold:
    TYPE: ClassVar[str] = "unhold"
    request_id: str
    hold: str  # PullSource.hold: only the caller that was handed the source can end its hold
    reader_closed: bool = False  # no reader can still read the pages: a NIXL hold need not await its notice


@dataclass(frozen=True)
class WriterGone:
    TYPE: ClassVar[str] = "writer_gone"
    writer: str  # a prefill worker that is dead: none of its writes can land any more


@dataclass(frozen=True)
class ReaderGone:
    TYPE: ClassVar[str] = "reader_gone"
    reader: str  # a decode worker that is dead: none of its reads is in flight any more


@dataclass(frozen=True)
class Watch:
    TYPE: ClassVar[str] = "watch"
    heartbeat_ms: int = 1000
    owner: str = ""  # the watching orchestrator (Fleet.owner): its Adapters set leaves with its last watch
    renew_after: int = WATCH_RENEW_AFTER  # pushes after which the worker ends the call (at most that constant)


@dataclass(frozen=True)
class Stats:
    TYPE: ClassVar[str] = "stats"


@dataclass(frozen=True)
class Flush:
    TYPE: ClassVar[str] = "flush"


@dataclass(frozen=True)
class Adapters:
    TYPE: ClassVar[str] = "adapters"
    owner: str  # the orchestrator whose set this is (control/adapters.py): another's is left as it is
    modules: dict = field(default_factory=dict)  # folder by key (SamplingParams.lora)


# -- replies ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reserved:
    TYPE: ClassVar[str] = "reserved"
    request_id: str
    lease: str
    destination: Destination
    cached_tokens: int = 0  # prompt tokens whose K/V the decode worker already holds


@dataclass(frozen=True)
class Token:
    TYPE: ClassVar[str] = "token"
    token: int | None  # None: the stream ends without a new token
    logprob: float | None = None
    finish_reason: str | None = None  # stop | length; set on the last token
    cached_tokens: int = 0  # on the first token of a locally prefilled request
    top: Logprob | None = None  # with the alternatives, when sampling.top_logprobs asks for them
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # on the first token (sampling.prompt_logprobs)
    renew: str = ""  # its call's last reply; the answer goes on after Continue(request_id, renew)


@dataclass(frozen=True)
class Prefilled:
    TYPE: ClassVar[str] = "prefilled"
    request_id: str
    token: int
    logprob: float | None
    finish_reason: str | None  # set when the first token already ends the request
    kv_bytes: int
    kv_seconds: float  # waiting for the handoff after compute
    compute_seconds: float
    queue_seconds: float
    cached_tokens: int = 0  # prompt tokens the prefill worker took from its own prefix cache
    top: Logprob | None = None  # as on Token
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    source: PullSource | None = None  # pull: where the K/V are held (None when the first token ends it)


@dataclass(frozen=True)
class Pulled:
    TYPE: ClassVar[str] = "pulled"
    request_id: str
    kv_bytes: int  # read from the prefill worker's pool (what the decode side's cache lacked)
    kv_seconds: float  # from the Open to the last page read
    cached_tokens: int = 0  # prompt tokens the decode worker already held (not read)


@dataclass(frozen=True)
class Ack:
    TYPE: ClassVar[str] = "ack"
    found: bool = True


@dataclass(frozen=True)
class WorkerStats:
    TYPE: ClassVar[str] = "stats"
    role: Role
    host: str = ""  # tandem.pool.host_identity() of the worker (picks the KV transport per pair)
    pages_total: int = 0
    pages_used: int = 0  # held by requests
    pages_cached: int = 0  # idle prefix-cache pages (reclaimable)
    pages_fenced: int = 0  # released but not yet fenced off from a late writer
    pages_held: int = 0  # prefill, pull handoff: pages holding K/V for a reader (held or being revoked)
    running: int = 0
    reserved: int = 0  # leases waiting for their prefill
    queued_tokens: int = 0  # prompt tokens waiting or in a pass (prefill)
    kv_bytes_received: int = 0
    cache_hits: int = 0  # pages
    cache_misses: int = 0
    cache_evictions: int = 0
    stored: list[str] = field(default_factory=list)  # prefix-cache hashes (hex) added since the last push
    removed: list[str] = field(default_factory=list)
    resync: bool = False  # stored/removed overflowed: `stored` is the whole cache
    engine_salt: str = ""  # hex of the pool's tandem.prefix.engine_salt; "" when its prefix cache is off
    lora_adapters: int = 0  # LoRA adapters the engine holds (engine/workers/adapter_set.py)
    renew: bool = False  # the last reply of its Watch call (Watch.renew_after): the watcher watches again


REQUESTS = {c.TYPE: c for c in (Open, Continue, Start, Release, WriterGone, Prefill, Abort, Unhold, ReaderGone, Watch,
                                Stats, Flush, Adapters, TrtllmDecode)}
REPLIES = {c.TYPE: c for c in (Reserved, Pulled, Token, Prefilled, Ack, WorkerStats, TrtllmPrefilled)}
WIRE = fingerprint(*REQUESTS.values(), *REPLIES.values(), Status)  # every request carries it; a worker checks it


@dataclass(frozen=True)
class Reply:
    """One reply as received: a status, and a body when the status is OK."""

    status: Status
    message: str = ""
    body: object = None


# -- encoding ---------------------------------------------------------------------------------------

def encode_request(msg) -> bytes:
    return json.dumps({"wire": WIRE, "type": msg.TYPE, "body": asdict(msg)}, separators=(",", ":"),
                      default=to_base64).encode()


def decode_request(raw: bytes | str):
    """The typed request in `raw`; raises WireError (a ProtocolError) naming what is wrong, first of all a
    sender whose messages differ from ours (another Tandem build: its `wire` fingerprint is not WIRE)."""
    env = json_object(raw, "request")
    if env.get("wire") != WIRE:
        raise WireError(f"the caller's messages are wire schema {env.get('wire')!r}, this worker's {WIRE!r} "
                        f"(Tandem {__version__}): the orchestrator and its workers come from different Tandem "
                        "builds; run them from one (the same image or package version)")
    cls = REQUESTS.get(env.get("type"))
    if cls is None or set(env) != {"wire", "type", "body"}:
        raise WireError(f"request must be {{'wire': {WIRE!r}, 'type': one of {sorted(REQUESTS)}, 'body': {{...}}}}, "
                        f"got type {env.get('type')!r} and keys {sorted(env)}")
    try:
        return parse(cls, env["body"])
    except InvalidArgument as e:  # a message's own checks (SamplingParams' ranges): the sender's, too
        raise WireError(f"{cls.__name__}: {e}") from None


def encode_reply(body=None, status: Status = Status.OK, message: str = "") -> bytes:
    env = {"status": status.value, "message": message}
    if body is not None:
        env.update(type=body.TYPE, body=asdict(body))
    return json.dumps(env, separators=(",", ":"), default=to_base64).encode()


def decode_reply(raw: bytes | str) -> Reply:
    env = json_object(raw, "reply")
    try:
        status = Status(env.get("status"))
    except ValueError:
        raise WireError(f"reply has unknown status {env.get('status')!r}") from None
    body = None
    if status is Status.OK and "type" in env:
        cls = REPLIES.get(env["type"])
        if cls is None:
            raise WireError(f"reply has unknown type {env['type']!r}; known: {sorted(REPLIES)}")
        body = parse(cls, env.get("body"))
    return Reply(status, str(env.get("message", "")), body)
