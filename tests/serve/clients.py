"""Unmodified clients for the front doors: tritonclient (gRPC and HTTP) and plain HTTP for OpenAI."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def ensemble_inputs(module, prompt: str, max_tokens: int, stream: bool, extra: dict | None = None) -> list:
    """The ensemble's inputs shaped [1, 1]; `extra` adds or replaces tensors: {name: (array, datatype)}."""
    tensors = {"text_input": (np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
               "max_tokens": (np.array([[max_tokens]], dtype=np.int32), "INT32"),
               "stream": (np.array([[stream]], dtype=np.bool_), "BOOL"),
               "exclude_input_in_output": (np.array([[True]], dtype=np.bool_), "BOOL")}
    tensors.update(extra or {})
    out = []
    for name, (arr, dtype) in tensors.items():
        t = module.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def grpc_infer(url: str, prompt: str, max_tokens: int, model: str = "ensemble") -> str:
    c = grpcclient.InferenceServerClient(url)
    try:
        return c.infer(model, ensemble_inputs(grpcclient, prompt, max_tokens, False)).as_numpy("text_output")[0][0].decode()
    finally:
        c.close()


def grpc_stream(url: str, prompt: str, max_tokens: int, extra: dict | None = None,
                headers: dict | None = None, priority: int = 0, on_part=None) -> list[str]:
    """Each streamed response's text_output, in order (ends at Triton's final-response flag); `priority`:
    Triton's level; `on_part(n)` is called after the n-th response arrives (n from 1)."""
    c = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)), headers=headers)
    try:
        c.async_stream_infer("ensemble", ensemble_inputs(grpcclient, prompt, max_tokens, True, extra),
                             request_id="s", enable_empty_final_response=True, priority=priority)
        parts = []
        while True:
            result, error = q.get(timeout=120)
            if error is not None:
                raise error
            parts.append(result.as_numpy("text_output")[0][0].decode())
            if on_part is not None:
                on_part(len(parts))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return parts
    finally:
        c.stop_stream()
        c.close()


def http_infer(url: str, prompt: str, max_tokens: int) -> str:
    c = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        return c.infer("ensemble", ensemble_inputs(httpclient, prompt, max_tokens, False)).as_numpy(
            "text_output")[0][0].decode()
    finally:
        c.close()


def post(url: str, path: str, body, raw: bytes | None = None, headers: dict | None = None,
         on_event=None) -> tuple[int, dict | list]:
    """POST JSON; returns (status, parsed body), or (status, list of SSE events) for a stream.
    `on_event(n)` is called after the n-th streamed event arrives (n from 1)."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                events = []
                for line in r:
                    line = line.decode().strip()
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        if on_event is not None:
                            on_event(len(events))
                return r.status, events
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def pages_used(http: str) -> dict[str, float]:
    """`tandem_kv_pages_used{worker=...}` -> pages held by requests, as the front door's /metrics says."""
    with urllib.request.urlopen(http + "/metrics") as r:
        lines = r.read().decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("tandem_kv_pages_used")}


def metric_total(http: str, name: str, label: str = "") -> float:
    """The sum of a metric's series (every label set, or those holding `label`, e.g. 'status="OK"') on the
    front door's /metrics; 0 without any."""
    with urllib.request.urlopen(http + "/metrics") as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines
               if line.split("{")[0].split(" ")[0] == name and label in line.split(" ")[0])
