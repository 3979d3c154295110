"""`tandem batch` (an OpenAI batch file answered by a serve), run as a user runs it, against real stacks:
each request's result is the answer the server gives it alone (chat, completions, Responses), refusals
as their status and error body; a bad file is refused whole, naming its lines, before anything is sent;
--resume keeps the final results and asks the rest; with no --url it starts a serve, asks again while
that serve refuses as busy (limits.max_in_flight 1 under 4 at once) and stops it, leaving nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from tests.conftest import leak_check, leak_snapshot
from tests.serve.test_door_conformance import http

MODEL = "smollm2-135m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a large city."}], "max_tokens": 12,
        "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
RESPONSE = {"model": MODEL, "input": "Name a river.", "max_output_tokens": 8, "temperature": 0}


def _batch(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", "batch", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def _write(path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def _line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _results(path) -> dict[str, dict]:
    lines = [json.loads(t) for t in open(path)]
    by_id = {x["custom_id"]: x for x in lines}
    assert len(by_id) == len(lines), "a custom_id has two results"
    return by_id


def test_each_result_is_the_answer_its_request_gets_alone(served, tmp_path):
    src = _write(tmp_path / "in.jsonl", [
        _line("chat", "/v1/chat/completions", CHAT), "",  # a blank line is skipped
        _line("completion", "/v1/completions", COMPLETION),
        _line("response", "/v1/responses", RESPONSE),
        _line("bad-max-tokens", "/v1/chat/completions", CHAT | {"max_tokens": -1}),
        _line("no-such-model", "/v1/completions", COMPLETION | {"model": "gpt-none"})])
    run = _batch("-i", src, "-o", str(tmp_path / "out.jsonl"), "--url", served.http, "--concurrency", "3")
    assert run.returncode == 0, run.stderr
    assert "5 of 5 requests answered" in run.stdout and "3 × 200" in run.stdout, run.stdout
    got = _results(tmp_path / "out.jsonl")
    assert set(got) == {"chat", "completion", "response", "bad-max-tokens", "no-such-model"}
    for cid, url, body in (("chat", "/v1/chat/completions", CHAT), ("completion", "/v1/completions", COMPLETION),
                           ("response", "/v1/responses", RESPONSE)):
        status, alone, _ = http(served.http, url, body)
        response = got[cid]["response"]
        assert response["status_code"] == status == 200 and got[cid]["error"] is None and response["request_id"]
        if cid == "chat":
            assert response["body"]["choices"][0]["message"] == alone["choices"][0]["message"]
        elif cid == "completion":
            assert response["body"]["choices"][0]["text"] == alone["choices"][0]["text"]
        else:
            assert response["body"]["output"][0]["content"][0]["text"] == alone["output"][0]["content"][0]["text"]
    assert got["bad-max-tokens"]["response"]["status_code"] == 400
    assert got["bad-max-tokens"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert got["no-such-model"]["response"]["status_code"] == 404


def test_a_bad_file_is_refused_whole_naming_each_bad_line(served, tmp_path):
    src = _write(tmp_path / "in.jsonl", [
        "{not json", {"method": "POST", "url": "/v1/completions", "body": COMPLETION},
        _line("a", "/v1/completions", COMPLETION), _line("a", "/v1/completions", COMPLETION),
        {**_line("b", "/v1/completions", COMPLETION), "method": "GET"}, _line("c", "/v1/embeddings", {}),
        _line("d", "/v1/completions", COMPLETION | {"stream": True}), _line("e", "/v1/completions", [1])])
    out = tmp_path / "out.jsonl"
    run = _batch("-i", src, "-o", str(out), "--url", served.http)
    assert run.returncode == 2 and not out.exists(), run.stderr
    assert "7 bad line(s), nothing was sent" in run.stderr, run.stderr
    for n, says in ((1, "not JSON"), (2, "custom_id must be"), (4, "custom_id 'a' is used by an earlier line"),
                    (5, "method must be"), (6, "url must be one of"), (7, "body.stream must be"), (8, "body must be")):
        assert f"line {n}: {says}" in run.stderr, run.stderr


def test_resume_keeps_final_results_and_asks_only_for_the_rest(served, tmp_path):
    src = _write(tmp_path / "in.jsonl", [_line(f"q{i}", "/v1/completions", COMPLETION) for i in range(1, 5)])
    out = tmp_path / "out.jsonl"
    kept = {"id": "batch_req_kept", "custom_id": "q1", "error": None,
            "response": {"status_code": 200, "request_id": "r1", "body": {"marker": "kept as it was"}}}
    busy = {"id": "batch_req_busy", "custom_id": "q2", "error": None,
            "response": {"status_code": 429, "request_id": "r2", "body": {"error": {"message": "busy"}}}}
    unanswered = {"id": "batch_req_none", "custom_id": "q3", "response": None,
                  "error": {"code": "no_answer", "message": "ClientConnectorError"}}
    out.write_text("".join(json.dumps(x) + "\n" for x in (kept, busy, unanswered)) + '{"custom_id": "q4", "resp')
    refused = _batch("-i", src, "-o", str(out), "--url", served.http)
    assert refused.returncode == 2 and "--resume" in refused.stderr  # an existing output is never overwritten
    run = _batch("-i", src, "-o", str(out), "--url", served.http, "--resume")
    assert run.returncode == 0, run.stderr
    assert "1 results kept, 3 requests to ask" in run.stderr and "3 of 3 requests answered" in run.stdout
    got = _results(out)
    assert got["q1"] == kept and open(out).readline() == json.dumps(kept) + "\n"
    assert [got[q]["response"]["status_code"] for q in ("q2", "q3", "q4")] == [200, 200, 200]
    again = _batch("-i", src, "-o", str(out), "--url", served.http, "--resume")
    assert again.returncode == 0 and "every request" in again.stdout and _results(out) == got


def test_without_a_url_it_serves_itself_and_asks_again_while_the_server_is_busy(built_engines, tmp_path):
    (tmp_path / "dep.yaml").write_text(yaml.safe_dump({"limits": {"max_in_flight": 1}}))
    src = _write(tmp_path / "in.jsonl", [_line(f"q{i}", "/v1/completions", COMPLETION | {"max_tokens": 8})
                                         for i in range(8)])
    before = leak_snapshot()
    serve = f"--model {built_engines} --kv-pool-bytes {256 << 20} --config {tmp_path / 'dep.yaml'}"
    run = _batch("-i", src, "-o", str(tmp_path / "out.jsonl"), "--serve", serve, "--concurrency", "4",
                 "--retries", "100")
    assert run.returncode == 0, run.stderr
    got = _results(tmp_path / "out.jsonl")
    assert sorted(got) == [f"q{i}" for i in range(8)]
    assert {x["response"]["body"]["choices"][0]["text"] for x in got.values()} == \
        {got["q0"]["response"]["body"]["choices"][0]["text"]}  # one prompt, greedy: one answer
    assert "8 × 200" in run.stdout and "asked again 0 times" not in run.stdout, run.stdout  # it was refused as busy
    assert leak_check(before) == []  # the serve it started is stopped, with its workers
