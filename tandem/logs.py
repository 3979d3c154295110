"""Log lines for operators: every line names the request it is about, as text or as one JSON object.

    setup_logging("text")   2026-12-02 10:00:00,123 INFO tandem.access [req=7f3a...]: POST /v1/completions 200 ...
    setup_logging("json")   {"time": "...", "level": "INFO", "logger": "tandem.access", "request_id": "7f3a...",
                             "message": "...", "method": "POST", "route": "/v1/completions", "status": 200, ...}

The request id comes from the current request (tandem/request_context.py), so a line written anywhere
while a request is served carries it without the code that writes it knowing. The access log
(`tandem.access`, one line per request) adds method, route, status, duration and token counts as
fields of the JSON object (and as `key=value` text).
"""

from __future__ import annotations

import json
import logging
import time

from tandem.request_context import RequestRecord, current_id

FORMATS = ("text", "json")
ACCESS_FIELDS = ("method", "route", "status", "duration_ms", "prompt_tokens", "completion_tokens", "peer")
access_log = logging.getLogger("tandem.access")


class RequestIdFilter(logging.Filter):
    """Puts the current request's id on every record (`request_id`, empty outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = current_id()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", "")
        record.rid = f" [req={rid}]" if rid else ""
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, request_id, message, the access
    fields when present, and the traceback as `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "request_id": getattr(record, "request_id", ""),
               "message": record.getMessage()}
        for key in ACCESS_FIELDS:
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """The root logger writes to stderr in `fmt` (text or json), every record carrying its request id."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; use one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def log_access(method: str, route: str, status: int | str, started: float, record: RequestRecord | None,
               peer: str = "") -> None:
    """The access line of one request that began at `started` (time.perf_counter())."""
    fields = {"method": method, "route": route, "status": status,
              "duration_ms": round((time.perf_counter() - started) * 1000, 1),
              "prompt_tokens": record.prompt_tokens if record else 0,
              "completion_tokens": record.completion_tokens if record else 0, "peer": peer}
    if record is not None and record.api_key:
        fields["api_key"] = record.api_key  # the key's name (frontdoor/api_keys.py), never the key
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("method", "route", "status"))
    access_log.info("%s %s %s %s", method, route, status, text,
                    extra=dict(fields, request_id=record.request_id if record else ""))
