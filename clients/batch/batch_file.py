"""OpenAI's batch file format: the requests a batch asks (JSONL in) and its results (JSONL out).

In, one request a line:
    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": ..., "messages": ...}}
`custom_id` a non-empty string, distinct in the file; `method` "POST"; `url` one of URLS; `body` an
object, never streamed (a batch's answers are whole). Blank lines are skipped. A file with any bad
line is refused whole (`read_requests` names every bad line, up to 20), before a request is sent.

Out, one result a line, in the order the answers came (match them by `custom_id`, as in OpenAI's):
    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": ..., "body": {...}},
     "error": null}
A refusal the server answered (a 400, a 404, a 429 still refused after the retries) is a response with
its status and error body; a request that got no answer at all has `"response": null` and
`"error": {"code", "message"}`. A result is final unless the server was busy or gone (RETRIED): a
`--resume` run keeps the final ones and asks again for the rest.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
RETRIED = (429, 503)  # the server's "not now" statuses: asked again, and again on --resume
MAX_NAMED = 20  # bad lines named in one refusal


class BatchFileError(ValueError):
    """The input file cannot be run as it is; the message names each bad line and what is allowed."""


@dataclass(frozen=True)
class BatchRequest:
    line: int  # 1-based, in the input file
    custom_id: str
    url: str
    body: dict


def read_requests(path: str) -> list[BatchRequest]:
    """Every request of the input file, in order; BatchFileError naming every bad line (up to 20)."""
    out, bad, seen = [], [], set()
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                req = _request(n, text)
                if req.custom_id in seen:
                    raise ValueError(f"custom_id {req.custom_id!r:.80} is used by an earlier line")
                seen.add(req.custom_id)
                out.append(req)
            except ValueError as e:
                bad.append(f"line {n}: {e}")
    if bad:
        more = f"\n... and {len(bad) - MAX_NAMED} more" if len(bad) > MAX_NAMED else ""
        raise BatchFileError(f"{path}: {len(bad)} bad line(s), nothing was sent:\n" + "\n".join(bad[:MAX_NAMED]) + more)
    if not out:
        raise BatchFileError(f"{path}: no requests (one JSON object a line)")
    return out


def _request(n: int, text: str) -> BatchRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError("must be a JSON object {\"custom_id\", \"method\", \"url\", \"body\"}")
    cid, method, url, body = (obj.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(cid, str) or not cid:
        raise ValueError("custom_id must be a non-empty string")
    if method != "POST":
        raise ValueError(f"method must be \"POST\", got {method!r:.40}")
    if url not in URLS:
        raise ValueError(f"url must be one of {', '.join(URLS)}, got {url!r:.80}")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object (the request's body)")
    if body.get("stream") not in (None, False):
        raise ValueError("body.stream must be false or absent: a batch's answers are whole")
    return BatchRequest(n, cid, url, body)


def result(custom_id: str, status: int, request_id: str, body) -> dict:
    """The result line of an answer the server gave (its HTTP status and JSON body)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def failure(custom_id: str, code: str, message: str) -> dict:
    """The result line of a request that got no answer (the server could not be reached, or went away)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def is_final(line: dict) -> bool:
    """Whether a result stands (an answer, or a refusal asking again would repeat); else --resume asks again."""
    response = line.get("response")
    return isinstance(response, dict) and response.get("status_code") not in RETRIED


def keep_final(path: str) -> set[str]:
    """For --resume: rewrite the output file `path` with its final results only (dropping the ones to ask
    again and a last line cut short by an interrupted run) and return their custom_ids."""
    if not os.path.exists(path):
        return set()
    kept, ids = [], set()
    with open(path, encoding="utf-8") as f:
        for text in f:
            try:
                line = json.loads(text) if text.endswith("\n") else None
            except json.JSONDecodeError:
                line = None
            if isinstance(line, dict) and is_final(line) and line.get("custom_id") not in ids:
                kept.append(text)
                ids.add(line["custom_id"])
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    return ids
