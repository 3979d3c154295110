"""Door conformance: OpenAI HTTP, KServe v2 HTTP, Triton gRPC (ModelInfer and ModelStreamInfer) are
codecs over one core, so they give the same tokens and log-probs for the same greedy request and the
same status for the same bad input, each in its own protocol's shape. Real server, unmodified wire
formats (raw protobuf and raw JSON, so malformed requests a client library would stop can be sent)."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import serialize_byte_tensor

from engine.generate import run_generation
from tandem.sampling_params import SamplingParams

PROMPT = "The three primary colours are"
NP = {"BYTES": np.object_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}
BASE = {"text_input": (["Hello there"], "BYTES"), "max_tokens": ([4], "INT32")}
OPENAI_BASE = {"prompt": "Hello there", "max_tokens": 4}


# -- the four doors, spoken on the wire -----------------------------------------------------------------

def http(url: str, path: str, body: dict | None = None, raw: bytes | None = None, method: str = "POST"):
    """(status, parsed JSON body, Content-Type) of one HTTP call."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("Content-Type", "")


def kserve_json(tensors: dict, outputs: list[str] = (), parameters: dict | None = None) -> dict:
    """tensors: name -> (values, datatype[, shape]); shape [1, len(values)] unless given; `parameters`:
    the request's."""
    inputs = []
    for name, spec in tensors.items():
        values, dt = spec[0], spec[1]
        shape = spec[2] if len(spec) > 2 else [1, len(values) if isinstance(values, list) else 1]
        inputs.append({"name": name, "datatype": dt, "shape": shape, "data": values})
    body = {"inputs": inputs, "outputs": [{"name": o} for o in outputs]}
    return body | ({"parameters": parameters} if parameters else {})


def grpc_request(tensors: dict, outputs: list[str] = (), model: str = "ensemble", rid: str = "c",
                 raw: dict | None = None, parameters: dict | None = None) -> pb.ModelInferRequest:
    """The same tensors as raw protobuf; `raw`: name -> bytes replacing a tensor's encoded data;
    `parameters`: the request's, each in the InferParameter field of its Python type."""
    req = pb.ModelInferRequest(model_name=model, id=rid)
    for name, value in (parameters or {}).items():
        kind = {bool: "bool_param", int: "int64_param", str: "string_param", float: "double_param"}[type(value)]
        setattr(req.parameters[name], kind, value)
    for name, spec in tensors.items():
        values, dt = spec[0], spec[1]
        shape = spec[2] if len(spec) > 2 else [1, len(values)]
        if dt == "BYTES":
            data = serialize_byte_tensor(np.array([v.encode() for v in values], dtype=np.object_)).item()
        else:
            data = np.array(values, dtype=NP[dt]).tobytes()
        req.inputs.add(name=name, datatype=dt, shape=shape)
        req.raw_input_contents.append((raw or {}).get(name, data))
    for o in outputs:
        req.outputs.add(name=o)
    return req


def grpc_unary(url: str, req: pb.ModelInferRequest):
    """(gRPC code, details, response) of one ModelInfer."""
    with grpc.insecure_channel(url) as ch:
        try:
            return grpc.StatusCode.OK, "", pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=120)
        except grpc.RpcError as e:
            return e.code(), e.details(), None


def grpc_stream(url: str, req: pb.ModelInferRequest) -> list[pb.ModelStreamInferResponse]:
    """Every response of one request on a ModelStreamInfer call, up to its final one or an error."""
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    with grpc.insecure_channel(url) as ch:
        outbox: queue.Queue = queue.Queue()
        outbox.put(req)
        call = pb_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(iter(outbox.get, None), timeout=120)
        got = []
        for resp in call:
            got.append(resp)
            if resp.error_message or resp.infer_response.parameters["triton_final_response"].bool_param:
                break
        outbox.put(None)
        call.cancel()
        return got


def output(resp: pb.ModelInferResponse, name: str) -> np.ndarray:
    i = [o.name for o in resp.outputs].index(name)
    dt = resp.outputs[i].datatype
    raw = resp.raw_output_contents[i]
    if dt == "BYTES":  # 4-byte little-endian length, then the bytes, per element
        out, pos = [], 0
        while pos < len(raw):
            n = int.from_bytes(raw[pos:pos + 4], "little")
            out.append(raw[pos + 4:pos + 4 + n].decode())
            pos += 4 + n
        return np.array(out, dtype=object)
    return np.frombuffer(raw, dtype=NP[dt]).reshape(list(resp.outputs[i].shape))


# -- one greedy request, four doors -----------------------------------------------------------------------

def test_one_greedy_request_gives_the_same_tokens_and_logprobs_through_every_door(served, default_engine):
    n = 12
    want = run_generation(default_engine, default_engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=n))
    tensors = {"text_input": ([PROMPT], "BYTES"), "max_tokens": ([n], "INT32"),
               "return_log_probs": ([True], "BOOL"), "exclude_input_in_output": ([True], "BOOL")}

    status, body, _ = http(served.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": n, "temperature": 0})
    assert status == 200, body
    openai = (body["choices"][0]["text"], body["usage"]["completion_tokens"])

    status, meta, _ = http(served.http, "/v2/models/ensemble", method="GET")
    advertised = [o["name"] for o in meta["outputs"]]
    status, body, _ = http(served.http, "/v2/models/ensemble/infer", kserve_json(tensors))
    assert status == 200, body
    outs = {o["name"]: o["data"] for o in body["outputs"]}
    assert list(outs) == advertised  # every output the model advertises, in its order
    kserve = (outs["text_output"][0], outs["num_output_tokens"][0])
    kserve_lp = np.array(outs["output_log_probs"], dtype=np.float32)

    code, details, resp = grpc_unary(served.grpc, grpc_request(tensors))
    assert code == grpc.StatusCode.OK, details
    assert [o.name for o in resp.outputs] == advertised
    unary = (output(resp, "text_output")[0], int(output(resp, "num_output_tokens")[0, 0]))
    unary_lp = output(resp, "output_log_probs").reshape(-1)
    assert output(resp, "cum_log_probs")[0, 0] == pytest.approx(float(unary_lp.sum()), abs=1e-4)

    responses = grpc_stream(served.grpc, grpc_request(tensors | {"stream": ([True], "BOOL")}))
    assert not any(r.error_message for r in responses), responses[-1].error_message
    parts = [r.infer_response for r in responses]
    streamed = ("".join(output(r, "text_output")[0] for r in parts), int(output(parts[-1], "num_output_tokens")[0, 0]))
    stream_lp = np.concatenate([output(r, "output_log_probs").reshape(-1) for r in parts])

    assert openai == kserve == unary == streamed == (want.text, n)
    assert len(unary_lp) == n and np.array_equal(kserve_lp, unary_lp) and np.array_equal(stream_lp, unary_lp)
    assert np.all(unary_lp <= 0) and np.any(unary_lp < 0)


# -- bad input, every door that can say it ----------------------------------------------------------------

@dataclass(frozen=True)
class Bad:
    """One bad input, as each door that can carry it says it (None: that door cannot)."""

    name: str
    http: int  # the HTTP status, and the gRPC code, every door must answer with
    code: str
    message: str | tuple[str, str]  # a piece of the error text every door gives (OpenAI's, KServe's)
    openai: dict | None = None  # the body for /v1/completions
    kserve: dict | None = None  # input tensors (replacing BASE's) for HTTP infer and gRPC
    outputs: tuple[str, ...] = ()
    http_raw: dict | None = None  # the HTTP infer body, where JSON can say what tensors cannot
    grpc_raw: dict = field(default_factory=dict)  # name -> raw bytes for the gRPC tensor
    drop: tuple[str, ...] = ()  # BASE inputs left out
    parameters: dict | None = None  # the KServe request's parameters (Triton's schedule policy)
    unary_only: bool = False  # not sent on ModelStreamInfer (where it is not an error)
    grpc: bool = True  # the gRPC doors can carry it
    over_http: bool = True  # KServe HTTP (JSON) can carry it

    def says(self, openai: bool) -> str:
        return self.message if isinstance(self.message, str) else self.message[0 if openai else 1]


BAD = [
    Bad("empty prompt", 400, "INVALID_ARGUMENT", "prompt is empty", {"prompt": ""},
        {"text_input": ([""], "BYTES")}),
    Bad("prompt over the context", 400, "INVALID_ARGUMENT", "model's context is 8192", {"prompt": "word " * 9000},
        {"text_input": (["word " * 9000], "BYTES")}),
    Bad("max_tokens 0", 400, "INVALID_ARGUMENT", "max_tokens must be an integer >= 1", {"max_tokens": 0},
        {"max_tokens": ([0], "INT32")}),
    Bad("max_tokens negative", 400, "INVALID_ARGUMENT", "max_tokens must be an integer >= 1", {"max_tokens": -3},
        {"max_tokens": ([-3], "INT32")}),
    Bad("max_tokens past the context", 400, "INVALID_ARGUMENT", "ask for at most", {"max_tokens": 100000},
        {"max_tokens": ([100000], "INT32")}),
    Bad("max_tokens of the wrong type", 400, "INVALID_ARGUMENT", "max_tokens", {"max_tokens": 4.5},
        {"max_tokens": ([4.5], "FP32")}),
    Bad("temperature negative", 400, "INVALID_ARGUMENT", "temperature must be >= 0", {"temperature": -1},
        {"temperature": ([-1.0], "FP32")}),
    Bad("top_p above 1", 400, "INVALID_ARGUMENT", "top_p must be in (0, 1]", {"top_p": 1.5},
        {"top_p": ([1.5], "FP32")}),
    Bad("top_k negative", 400, "INVALID_ARGUMENT", "top_k must be an integer >= 0", {"top_k": -2},
        {"top_k": ([-2], "INT32")}),
    Bad("min_tokens past max_tokens", 400, "INVALID_ARGUMENT", "min_tokens must be in [0, max_tokens=4]",
        {"min_tokens": 9}, {"min_tokens": ([9], "INT32")}),
    Bad("seed of the wrong type", 400, "INVALID_ARGUMENT", "seed", {"seed": "x"}, {"seed": ([1.0], "FP32")}),
    Bad("stop of the wrong type", 400, "INVALID_ARGUMENT", "stop", {"stop": 5}, {"stop_words": ([5], "INT32")}),
    Bad("stream not a boolean", 400, "INVALID_ARGUMENT", "stream", {"stream": "yes"}, {"stream": ([1], "INT32")}),
    # OpenAI accepts a field it does not know and names it once in the log (as vLLM does): KServe only
    Bad("an unknown input", 400, "INVALID_ARGUMENT", "frobnicate", None, {"frobnicate": ([1], "INT32")}),
    Bad("no prompt", 400, "INVALID_ARGUMENT", ("'prompt' must be a string", "missing required input 'text_input'"),
        {"prompt": None}, {}, drop=("text_input",)),
    Bad("more answers than a request may ask", 400, "INVALID_ARGUMENT",
        ("'n' must be an integer in [1, 64]", "num_return_sequences=2 is not supported"), {"n": 65},
        {"num_return_sequences": ([2], "INT32")}),
    Bad("an unknown model", 404, "NOT_FOUND", "unknown model", {"model": "llama-70b"}, {}),
    Bad("an unknown LoRA adapter", 404, "NOT_FOUND", ("unknown model 'sql-lora'", "unknown LoRA adapter 'sql-lora'"),
        {"model": "sql-lora"}, {"lora_name": (["sql-lora"], "BYTES")}),
    Bad("an output the model lacks", 400, "INVALID_ARGUMENT", "unknown outputs ['context_logits']",
        kserve={}, outputs=("context_logits",)),
    Bad("stream=true on a unary call", 400, "INVALID_ARGUMENT", "needs a streaming call",
        kserve={"stream": ([True], "BOOL")}, unary_only=True),
    Bad("data that is not a list", 400, "INVALID_ARGUMENT", "'data' must be a list", grpc=False,
        http_raw={"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": "Hi"},
                             {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [4]}]}),
    Bad("data that does not fill its shape", 400, "INVALID_ARGUMENT", "max_tokens",
        kserve={"max_tokens": ([4, 5], "INT32", [1, 1])}, grpc_raw={"max_tokens": np.array([4, 5], np.int32).tobytes()}),
    Bad("INT32 out of range", 400, "INVALID_ARGUMENT", "is not a INT32", grpc=False,
        kserve={"max_tokens": ([3_000_000_000], "INT32")}),
    Bad("text that is not Unicode", 400, "INVALID_ARGUMENT", ("not valid Unicode", "not valid UTF-8"),
        {"prompt": "\ud800"}, kserve={"text_input": (["x"], "BYTES")}, over_http=False,
        grpc_raw={"text_input": b"\x02\x00\x00\x00\xff\xfe"}),
    Bad("a batch past the model's", 400, "INVALID_ARGUMENT", "batch size must be 1..64",
        kserve={"text_input": (["hi"] * 65, "BYTES", [65, 1]), "max_tokens": ([4] * 65, "INT32", [65, 1])}),
    Bad("a guide that does not compile", 400, "INVALID_ARGUMENT", "regex guide does not compile",
        {"guided_regex": "(ab"}, {"guided_decoding_guide_type": (["regex"], "BYTES"),
                                  "guided_decoding_guide": (["(ab"], "BYTES")}),
    Bad("a guide of an unknown type", 400, "INVALID_ARGUMENT",
        ("response_format must be", "guided_decoding_guide_type must be one of"), {"response_format": {"type": "xml"}},
        {"guided_decoding_guide_type": (["xml"], "BYTES"), "guided_decoding_guide": (["<a/>"], "BYTES")}),
    Bad("a schema that is not an object", 400, "INVALID_ARGUMENT", "json_schema guide must be a JSON object",
        {"guided_json": "[1]"}, {"guided_decoding_guide_type": (["json_schema"], "BYTES"),
                                 "guided_decoding_guide": (["[1]"], "BYTES")}),
    Bad("a priority on a first-come, first-served server", 400, "INVALID_ARGUMENT", "first come, first served",
        {"priority": 1}, {}, parameters={"priority": 1}),
    Bad("a priority of the wrong type", 400, "INVALID_ARGUMENT", ("'priority' must be an integer",
        "parameter priority must be an integer"), {"priority": "high"}, {}, parameters={"priority": "high"}),
    Bad("a priority level past the last", 400, "INVALID_ARGUMENT", "parameter priority must be an integer in [0, "
        "4294967295] (a priority level: 1 the highest", kserve={}, parameters={"priority": 2**32}),
    Bad("a negative timeout", 400, "INVALID_ARGUMENT", "parameter timeout must be an integer in [0, ", kserve={},
        parameters={"timeout": -5}),
    Bad("parameters that are not an object", 400, "INVALID_ARGUMENT", "parameters must be an object", grpc=False,
        http_raw=kserve_json(BASE) | {"parameters": [1]}),
    Bad("a cache salt too long", 400, "INVALID_ARGUMENT", "of at most 256 characters", {"cache_salt": "s" * 257},
        {"cache_salt": (["s" * 257], "BYTES")}),
]


def _http_infer_body(bad: Bad) -> dict:
    if bad.http_raw is not None:
        return bad.http_raw
    tensors = {k: v for k, v in BASE.items() if k not in bad.drop} | bad.kserve
    return kserve_json(tensors, list(bad.outputs), bad.parameters)


@pytest.mark.parametrize("bad", BAD, ids=[b.name for b in BAD])
def test_a_bad_input_gets_the_same_status_from_every_door_in_its_own_shape(served, bad):
    assert len(BAD) >= 20
    doors = 0
    if bad.openai is not None:
        body = {k: v for k, v in (OPENAI_BASE | bad.openai).items() if v is not None}
        status, reply, kind = http(served.http, "/v1/completions", body)
        assert status == bad.http and kind.startswith("application/json"), reply
        assert bad.says(True) in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"
        doors += 1
    if bad.over_http and (bad.kserve is not None or bad.http_raw is not None):
        model = "llama-70b" if bad.code == "NOT_FOUND" and not bad.kserve else "ensemble"
        status, reply, kind = http(served.http, f"/v2/models/{model}/infer", _http_infer_body(bad))
        assert status == bad.http and kind.startswith("application/json"), reply
        assert list(reply) == ["error"] and bad.says(False) in reply["error"], reply  # Triton's own error shape
        doors += 1
    if bad.kserve is not None and bad.grpc:
        model = "llama-70b" if bad.code == "NOT_FOUND" and not bad.kserve else "ensemble"
        tensors = {k: v for k, v in BASE.items() if k not in bad.drop} | bad.kserve
        req = grpc_request(tensors, list(bad.outputs), model=model, raw=bad.grpc_raw, parameters=bad.parameters)
        code, details, _ = grpc_unary(served.grpc, req)
        assert code.name == bad.code and bad.says(False) in details, (code, details)
        doors += 1
        if not bad.unary_only:
            responses = grpc_stream(served.grpc, req)
            assert len(responses) == 1 and responses[0].error_message.startswith(bad.code + ": "), responses
            assert bad.says(False) in responses[0].error_message and responses[0].infer_response.id == "c"
            doors += 1
    assert doors >= (2 if bad.grpc else 1)


def test_http_routes_and_methods_that_do_not_exist_are_json_in_each_protocols_shape(served):
    for path, method, status in [("/v1/nothing", "GET", 404), ("/v1/completions", "GET", 405),
                                 ("/v1/models", "POST", 405)]:
        got, reply, kind = http(served.http, path, {} if method == "POST" else None, method=method)
        assert got == status and kind.startswith("application/json"), (path, reply)
        assert reply["error"]["code"] == {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}[status]
        assert path in reply["error"]["message"]
    for path, method, status in [("/v2/models/ensemble/nothing", "GET", 404),
                                 ("/v2/models/ensemble/infer", "GET", 405)]:
        got, reply, kind = http(served.http, path, None, method=method)
        assert got == status and kind.startswith("application/json") and list(reply) == ["error"], (path, reply)
        assert path in reply["error"]


def test_triton_schedule_policy_timeout_bounds_a_request_on_both_kserve_doors(served):
    """Triton's `timeout` parameter (microseconds) is the request's deadline; priorities are refused
    on a first-come, first-served server (above), whose config advertises no priority levels."""
    slow = BASE | {"max_tokens": ([64], "INT32"), "min_tokens": ([64], "INT32")}
    status, reply, _ = http(served.http, "/v2/models/ensemble/infer", kserve_json(slow, parameters={"timeout": 1}))
    assert status == 504 and "deadline" in reply["error"], reply
    code, details, _ = grpc_unary(served.grpc, grpc_request(slow, parameters={"timeout": 1}))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
    roomy = {"timeout": 120_000_000}
    status, reply, _ = http(served.http, "/v2/models/ensemble/infer", kserve_json(BASE, parameters=roomy))
    code, details, resp = grpc_unary(served.grpc, grpc_request(BASE, parameters=roomy))
    assert status == 200 and code == grpc.StatusCode.OK, (reply, details)
    assert reply["outputs"][0]["data"] == list(output(resp, "text_output"))
    status, cfg, _ = http(served.http, "/v2/models/ensemble/config", method="GET")
    assert status == 200 and "dynamic_batching" not in cfg, cfg
    status, meta, _ = http(served.http, "/v2", method="GET")
    assert "schedule_policy" in meta["extensions"], meta
