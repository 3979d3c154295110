"""API keys and TLS on both front doors and on the worker channel, request ids and the access log:
one `tandem serve` whose doors and workers all speak TLS with certificates from the test's own CA,
whose doors require a key, and which writes JSON logs; its door certificate is renewed by a reload (SIGHUP).
Unmodified clients: urllib, tritonclient, grpc."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from engine.generate import run_generation
from tandem.sampling_params import SamplingParams
from tests.conftest import sighup, start_serve, stop_serve
from tests.serve.certs import TestCA
from tests.serve.clients import ensemble_inputs

KEY = "test-api-key-0123456789"
SECRET = "test-deployment-secret-0123456789"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return TestCA(str(tmp_path_factory.mktemp("ca")))


@pytest.fixture(scope="module")
def secured(built_engines, tmp_path_factory, ca):
    work = tmp_path_factory.mktemp("serve-secured")
    door, worker = ca.issue("door"), ca.issue("worker", dns=("tandem-worker",), ips=())
    keys = work / "keys"
    keys.write_text(f"# rotated keys\nold-key-that-still-works\n{KEY}\n")
    cfg = work / "dep.yaml"
    cfg.write_text(yaml.safe_dump({
        "front_door": {"tls": {"cert": door.cert, "key": door.key}, "api_key_file": str(keys)},
        # the workers' certificate names no address: the orchestrator checks the name instead
        "worker_tls": {"ca": ca.path, "server_name": "tandem-worker", "cert": worker.cert, "key": worker.key}}))
    s = start_serve(built_engines, work, "--config", str(cfg), "--log-format", "json",
                    env={"TANDEM_SECRET": SECRET}, ca=ca.path)
    s.door = door
    yield s
    stop_serve(s)


@pytest.fixture(scope="module")
def expected(default_engine):
    ids = default_engine.tokenizer.encode(PROMPT)
    return run_generation(default_engine, ids, SamplingParams(max_tokens=12)).text


def _post(s, path: str, body: dict, headers: dict, context=None):
    req = urllib.request.Request(s.http + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120, context=context or s.ssl_context()) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _log_lines(s) -> list[dict]:
    return [json.loads(ln) for ln in open(s.log_path, errors="replace") if ln.startswith("{")]


def test_http_door_needs_a_key_over_tls_and_answers_exactly_with_one(secured, expected):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    status, headers, err = _post(secured, "/v1/completions", body, {})
    assert status == 401 and err["error"]["type"] == "authentication_error" and "API key" in err["error"]["message"]
    assert headers["WWW-Authenticate"].startswith("Bearer")
    status, _, err = _post(secured, "/v1/completions", body, {"Authorization": "Bearer not-a-key-of-this-server"})
    assert status == 401 and "not valid" in err["error"]["message"]
    for key in (KEY, "old-key-that-still-works"):
        status, _, out = _post(secured, "/v1/completions", body, {"Authorization": f"Bearer {key}"})
        assert status == 200 and out["choices"][0]["text"] == expected
    with urllib.request.urlopen(secured.http + "/health", context=secured.ssl_context()) as r:  # probes stay open
        assert r.status == 200


def test_http_door_refuses_clients_that_do_not_speak_tls_or_do_not_trust_it(secured):
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(secured.http.replace("https://", "http://") + "/health", timeout=10)
    with pytest.raises(urllib.error.URLError) as e:
        urllib.request.urlopen(secured.http + "/health", timeout=10, context=ssl.create_default_context())
    assert isinstance(e.value.reason, ssl.SSLCertVerificationError)


def test_grpc_door_needs_a_key_over_tls(secured, expected):
    ca = open(secured.ca, "rb").read()
    c = grpcclient.InferenceServerClient(secured.grpc, ssl=True, root_certificates=secured.ca)
    try:
        assert c.is_server_live() and c.is_server_ready()  # probes stay open
        inputs = ensemble_inputs(grpcclient, PROMPT, 12, False)
        with pytest.raises(InferenceServerException) as e:
            c.infer("ensemble", inputs)
        assert e.value.status() == "StatusCode.UNAUTHENTICATED" and "API key" in e.value.message()
        with pytest.raises(InferenceServerException) as e:
            c.get_model_config("ensemble", headers={"authorization": "Bearer wrong-key-123"})
        assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        out = c.infer("ensemble", inputs, headers={"authorization": f"Bearer {KEY}"})
        assert out.as_numpy("text_output")[0][0].decode() == expected
    finally:
        c.close()
    with grpc.insecure_channel(secured.grpc) as plain:  # no TLS: no answer at all
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GRPCInferenceServiceStub(plain).ServerLive(pb.ServerLiveRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ca  # the CA was read (the client above used the same file)


def test_request_id_is_returned_on_both_doors_and_names_the_access_line(secured):
    rid = "client-chosen-id-42"
    status, headers, out = _post(secured, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0},
                                 {"Authorization": f"Bearer {KEY}", "X-Request-Id": rid})
    assert status == 200 and headers["X-Request-Id"] == rid and out["id"] == f"cmpl-{rid}"
    status, headers, _ = _post(secured, "/v1/completions", {"prompt": PROMPT}, {"X-Request-Id": "bad id with spaces"})
    assert status == 401 and headers["X-Request-Id"] not in ("", "bad id with spaces")  # replaced, errors too
    with grpc.secure_channel(secured.grpc, grpc.ssl_channel_credentials(open(secured.ca, "rb").read())) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        req = pb.ModelInferRequest(model_name="ensemble")
        for t in ensemble_inputs(grpcclient, PROMPT, 5, False):
            req.inputs.append(t._get_tensor())
            req.raw_input_contents.append(t._get_content())
        resp, call = stub.ModelInfer.with_call(req, metadata=(("authorization", f"Bearer {KEY}"),
                                                              ("x-request-id", "grpc-chosen-7")), timeout=120)
        assert dict(call.initial_metadata())["x-request-id"] == "grpc-chosen-7" and resp.id == "grpc-chosen-7"
    access = [ln for ln in _log_lines(secured) if ln["logger"] == "tandem.access"]
    mine = [ln for ln in access if ln["request_id"] == rid]
    assert len(mine) == 1 and mine[0]["route"] == "/v1/completions" and mine[0]["status"] == 200
    assert mine[0]["completion_tokens"] == out["usage"]["completion_tokens"]
    assert mine[0]["prompt_tokens"] == out["usage"]["prompt_tokens"]
    grpc_line = [ln for ln in access if ln["request_id"] == "grpc-chosen-7"]
    assert grpc_line and grpc_line[0]["route"].endswith("/ModelInfer") and grpc_line[0]["status"] == "OK"
    assert grpc_line[0]["completion_tokens"] == 5


def test_workers_serve_tls_only(secured):
    url = next(iter(secured.workers().values()))["grpc"]
    with grpc.insecure_channel(url) as plain:
        with pytest.raises(grpc.RpcError):
            pb_grpc.GRPCInferenceServiceStub(plain).ServerLive(pb.ServerLiveRequest(), timeout=10)
    creds = grpc.ssl_channel_credentials(open(secured.ca, "rb").read())
    with grpc.secure_channel(url, creds, options=[("grpc.ssl_target_name_override", "tandem-worker")]) as ch:
        assert pb_grpc.GRPCInferenceServiceStub(ch).ServerLive(pb.ServerLiveRequest(), timeout=10).live


def test_operator_routes_need_the_deployment_secret_not_an_api_key(secured):
    """`tandem status` over TLS: the secret from the environment opens /admin/workers, an API key does not."""
    env = {**os.environ, "SSL_CERT_FILE": secured.ca}
    env.pop("TANDEM_SECRET", None)
    cmd = [sys.executable, "-m", "cli.main", "status", "--url", secured.http, "--json"]
    for given in ({}, {"TANDEM_SECRET": KEY}):  # none; an API key is not the secret
        refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**env, **given})
        assert refused.returncode == 1 and "401" in refused.stderr and "deployment secret" in refused.stderr
    seen = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**env, "TANDEM_SECRET": SECRET})
    assert seen.returncode == 0, seen.stderr
    workers = json.loads(seen.stdout)["workers"]
    assert sorted(w["name"] for w in workers) == ["decode-0", "prefill-0"]
    assert all(w["state"] == "routable" for w in workers)


def _trusted_by(s, ca_path: str) -> dict[str, bool]:
    """Whether a new connection on each door verifies against `ca_path` alone (and is answered)."""
    ok = {}
    try:
        with urllib.request.urlopen(s.http + "/health", timeout=10, context=ssl.create_default_context(cafile=ca_path)):
            ok["http"] = True
    except urllib.error.URLError:
        ok["http"] = False
    creds = grpc.ssl_channel_credentials(open(ca_path, "rb").read())
    with grpc.secure_channel(s.grpc, creds, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:  # a new connection
        try:
            ok["grpc"] = pb_grpc.GRPCInferenceServiceStub(ch).ServerLive(pb.ServerLiveRequest(), timeout=10).live
        except grpc.RpcError:
            ok["grpc"] = False
    return ok


def test_a_renewed_door_certificate_is_served_after_a_reload_without_a_restart(secured, ca, tmp_path):
    """Last in this module: it swaps the door's certificate files (and puts the first ones back)."""
    first = {p: open(p, "rb").read() for p in (secured.door.cert, secured.door.key)}
    ca2 = TestCA(str(tmp_path), "tandem renewal CA")
    renewed = ca2.issue("door")
    assert _trusted_by(secured, ca2.path) == {"http": False, "grpc": False}
    try:
        for src, dst in ((renewed.cert, secured.door.cert), (renewed.key, secured.door.key)):
            open(dst, "wb").write(open(src, "rb").read())
        sighup(secured, "TLS certificate")
        assert _trusted_by(secured, ca2.path) == {"http": True, "grpc": True}  # new connections: the new one
        assert _trusted_by(secured, ca.path) == {"http": False, "grpc": False}
        open(secured.door.cert, "wb").write(b"not a certificate")
        sighup(secured, "reload refused")
        assert "cannot use the TLS certificate" in secured.log_tail(3)
        assert _trusted_by(secured, ca2.path) == {"http": True, "grpc": True}  # the running one stays
    finally:
        for path, pem in first.items():
            open(path, "wb").write(pem)
        sighup(secured, "TLS certificate")
    assert _trusted_by(secured, ca.path) == {"http": True, "grpc": True}
