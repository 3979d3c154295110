"""The sections of the deployment file (ops/deployment.py), each a strict, frozen model: unknown keys are
refused naming the allowed ones, and every value is checked where it is read."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator

from frontdoor.cors import Cors
from frontdoor.reasoning_text import PARSER_NAMES as REASONING_PARSERS
from frontdoor.response_store import DEFAULT_MAX_BYTES as DEFAULT_KEPT_BYTES
from frontdoor.tls import ServerTls
from frontdoor.tool_parsers import PARSER_NAMES
from tandem.call_renewal import ANSWER_RENEW_AFTER
from tandem.modes import HandoffMode


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerPool(Strict):
    count: int = Field(1, ge=0, le=64)
    urls: list[str] = []  # Triton gRPC endpoints (host:port) of workers started elsewhere (`tandem worker`)
    dns: str | None = None  # host:port; every address the name resolves to is a worker (a headless Service)
    device: Literal["auto", "cpu", "cuda"] | None = None  # None: the deployment's `device`
    gpus: list[NonNegativeInt] = []  # local workers take these GPUs in turn (worker i: gpus[i % len]); []: all

    @field_validator("urls")
    @classmethod
    def _host_port(cls, urls: list[str]) -> list[str]:
        for u in urls:
            host, _, port = u.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker URL {u!r} must be host:port (Triton's gRPC port)")
        return urls


class FrontDoor(Strict):
    host: str = "127.0.0.1"
    grpc_port: int = Field(8001, ge=0, le=65535)
    http_port: int = Field(8000, ge=0, le=65535)
    model_name: str = Field("ensemble", min_length=1)  # the Triton model name (gRPC, KServe HTTP)
    served_model_name: list[str] | str | None = None  # OpenAI model id(s): ops/model_files.served_names
    # API keys, one a line with its holder's name if any (frontdoor/api_keys.py); TANDEM_API_KEY adds one
    api_key_file: str | None = None
    no_api_key: bool = False  # serve beyond loopback without keys: only when said explicitly
    open_probes: bool = True  # health and metrics answer without a key
    tls: ServerTls | None = None  # frontdoor/tls.py
    chat_template: str | None = Field(None, min_length=1)  # a Jinja file or a named template (default: the model's)
    tool_call_parser: Literal[PARSER_NAMES] | None = None  # the model's tool-call format (frontdoor/tool_parsers.py)
    reasoning_parser: Literal[REASONING_PARSERS] | None = None  # its thinking's tags (frontdoor/reasoning_text.py)
    generation_config: str = Field("auto", min_length=1)  # auto, none or a path (frontdoor/generation_defaults.py)
    override_generation_config: dict[str, float | int] = {}  # generation_config.json's names: values on top
    responses_kept: int = Field(0, ge=0, le=100_000)  # /v1/responses kept for follow-ups (frontdoor/response_store.py)
    responses_kept_bytes: int = Field(DEFAULT_KEPT_BYTES, ge=1 << 20)  # their size at most, as JSON
    cors: Cors = Cors()  # web pages of other origins that may call (frontdoor/cors.py)
    # a gRPC client connection is asked to reconnect (GOAWAY) after this, its calls in flight finishing
    # first, so long-lived clients spread over orchestrator replicas added since; null: never
    grpc_max_connection_age_s: float | None = Field(None, gt=0)


class Limits(Strict):
    max_in_flight: int = Field(64, ge=1)  # admitted at once; more get 429 (two CPU cores stream ~64 answers well)
    max_queued_tokens: int = Field(32768, ge=1)  # prompt tokens awaiting their first (~1 min of prefill, one core)
    max_in_flight_per_key: int | None = Field(None, ge=1)  # one API key holder's requests in flight (admission.py)
    request_timeout_s: float = Field(600.0, gt=0)  # default deadline of a request (every wait is bounded by it)
    max_body_bytes: int = Field(16 << 20, ge=1024)  # HTTP bodies over this are refused before being read whole
    receive_timeout_s: float = Field(30.0, gt=0)  # HTTP: one request's head and body arrive within this (slowloris)
    send_timeout_s: float = Field(30.0, gt=0)  # a client reading nothing of its answer this long is cut off
    max_prompt_chars: int = Field(1 << 20, ge=1)  # refused before tokenizing
    max_model_len: int | None = Field(None, ge=2)  # prompt + answer tokens; null: the model's context


class Handoff(Strict):
    mode: HandoffMode = HandoffMode.PUSH  # see control/handoff.py
    transfer_timeout_s: float = Field(30.0, gt=0)  # a started request whose KV never arrives fails after this;
    # and a decode worker ends an answer whose Continue (below) has not come after this
    fence_timeout_s: float = Field(60.0, gt=0)  # NIXL: a writer never heard from again is presumed gone
    # an answer's tokens per call to its decode worker; the next call continues it (tandem/call_renewal.py)
    tokens_per_call: int = Field(ANSWER_RENEW_AFTER, ge=1, le=ANSWER_RENEW_AFTER)


class Health(Strict):
    heartbeat_s: float = Field(2.0, gt=0)  # how often a worker says it is alive (from its own thread)
    stall_s: float = Field(4.0, gt=0)  # silence after which a worker leaves routing (and /health says 503)
    stall_restart_s: float = Field(10.0, gt=0)  # a local worker silent this much longer is killed and replaced
    drain_grace_s: float = Field(30.0, ge=0)  # on SIGTERM: how long requests in flight may take to finish


class Tracing(Strict):
    # OTLP URL (gRPC: OTEL_EXPORTER_OTLP_PROTOCOL=grpc) every process sends spans to; null: OTEL_* decide (or off)
    otlp_endpoint: str | None = None


class PrefixCacheConfig(Strict):
    enabled: bool = True  # off: a pool keeps no page after its request (every prompt is computed in full)
    prefill_pool_bytes: int | None = Field(None, ge=1 << 20)  # a prefill worker's own pool; null: the decode pool's
    per_api_key: bool = False  # cached prefixes shared only among one key holder's requests (frontdoor/api_keys.py)
