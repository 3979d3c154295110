"""Bad words through the doors of a real 1P1D stack: vLLM's `bad_words` on OpenAI (each word banned
alone and after a space) and TensorRT-LLM's `bad_words` input over KServe v2 and gRPC (each word as it
is sent), each answer exactly one engine's with the same banned token sequences."""

from __future__ import annotations

from tandem.sampling_params import SamplingParams
from tests.conftest import complete
from tests.serve.test_door_conformance import grpc_request, grpc_unary, http, kserve_json, output

PROMPT = "The capital of France is"


def _engine_text(engine, words: list[str]) -> str:
    tok = engine.tokenizer
    banned = tuple(dict.fromkeys(tuple(tok.encode(w, add_special_tokens=False)) for w in words))
    return tok.decode(complete(engine, tok.encode(PROMPT), SamplingParams(max_tokens=16, bad_words=banned)).output_ids)


def test_bad_words_are_banned_the_same_way_by_one_engine_and_every_door(served, default_engine):
    free = default_engine.tokenizer.decode(complete(default_engine, default_engine.tokenizer.encode(PROMPT),
                                                    SamplingParams(max_tokens=16)).output_ids)
    word = free.split()[0]  # the answer's first word, so banning it changes the answer
    status, body, _ = http(served.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                                            "bad_words": [word]})
    openai = body["choices"][0]["text"]
    assert status == 200 and openai == _engine_text(default_engine, [word, " " + word]) != free, body
    assert word not in openai.split()
    tensors = {"text_input": ([PROMPT], "BYTES"), "max_tokens": ([16], "INT32"),
               "exclude_input_in_output": ([True], "BOOL"), "bad_words": ([" " + word], "BYTES")}
    want = _engine_text(default_engine, [" " + word])
    status, body, _ = http(served.http, "/v2/models/ensemble/infer", kserve_json(tensors))
    assert status == 200 and body["outputs"][0]["data"][0] == want != free, body
    code, details, resp = grpc_unary(served.grpc, grpc_request(tensors))
    assert output(resp, "text_output")[0] == want, details


def test_malformed_bad_words_are_a_400(served):
    for bad in ("Paris", [""], [3], [f"w{i}" for i in range(40)]):  # 40 words are 80 with their spaced forms
        status, body, _ = http(served.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "bad_words": bad})
        assert status == 400 and body["error"]["param"] == "bad_words", (bad, body)
