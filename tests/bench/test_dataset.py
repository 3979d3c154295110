"""`tandem bench --dataset`: prompts read from a ShareGPT file or JSON Lines with the model's real
tokenizer (vLLM's ShareGPT filter, answers as long as the replies, a seeded order, a short file sent
round again, malformed files named where), and a run of them against the running server whose every
request has the prompt and answer lengths the file gave."""

from __future__ import annotations

import json

import pytest

from cli.bench_cmd import _tokenizer
from clients.bench.dataset import MAX_PROMPT_TOKENS, sample
from tests.bench.test_bench_run import bench

REPLY = "The harbor lantern glowed over the copper river all winter long."
PROMPTS = [f"Tell me about the {w} near the old market, and why it matters." for w in
           ("river", "garden", "engine", "harbor", "meadow", "signal")]


@pytest.fixture(scope="module")
def tok():
    return _tokenizer(None)


def sharegpt(tmp_path, convs: list[list[str]]) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": str(i), "conversations": [
        {"from": "human" if j % 2 == 0 else "gpt", "value": v} for j, v in enumerate(c)]}
        for i, c in enumerate(convs)]))
    return str(path)


def lines(tmp_path, rows: list) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_sharegpt_answers_are_as_long_as_the_replies_and_vllms_filter_holds(tmp_path, tok):
    long_prompt = "word " * (MAX_PROMPT_TOKENS + 10)
    path = sharegpt(tmp_path, [[p, REPLY, "and a third turn"] for p in PROMPTS] +
                    [["only a question"], [PROMPTS[0], "Ok."], [long_prompt, REPLY], ["Hi", REPLY]])
    got, note = sample(path, tok, 100, 0, None, 64)
    kept = {g.prompt for g in got}
    assert kept == set(PROMPTS) and note  # six usable of ten: sent round again, and said so
    assert [g.prompt for g in got[:6]] == [g.prompt for g in got[6:12]]
    for g in got:
        assert (g.prompt_tokens, g.output_tokens) == (len(tok.encode(g.prompt)), len(tok.encode(REPLY)))
    fixed, _ = sample(path, tok, 6, 0, 3, 64)  # a fixed length waives the reply floor ("Ok." is kept)
    assert all(g.output_tokens == 3 for g in fixed) and len(fixed) == 6


def test_the_seed_chooses_the_order_and_json_lines_give_their_own_lengths(tmp_path, tok):
    path = lines(tmp_path, [{"prompt": p, "max_tokens": i + 1} for i, p in enumerate(PROMPTS[:4])] +
                 ["", {"prompt": PROMPTS[4]}])
    a, note = sample(path, tok, 5, 1, None, 9)
    assert not note and sorted(g.prompt for g in a) == sorted(PROMPTS[:5])
    assert {g.prompt: g.output_tokens for g in a} == {**{p: i + 1 for i, p in enumerate(PROMPTS[:4])}, PROMPTS[4]: 9}
    assert [g.prompt for g in sample(path, tok, 5, 1, None, 9)[0]] == [g.prompt for g in a]
    orders = {tuple(g.prompt for g in sample(path, tok, 5, seed, None, 9)[0]) for seed in range(6)}
    assert len(orders) > 1


@pytest.mark.parametrize("content, says", [
    ("hello", "neither a ShareGPT"),
    ("[{\"conversations\": [{\"from\": \"human\", \"value\": 1}, {\"from\": \"gpt\", \"value\": \"x\"}]}]",
     "entry 0"),
    ("[{\"messages\": []}]", "no 'conversations'"),
    ("{\"prompt\": \"a\"}\n{\"prompt\": \"\"}\n", ":2:"),
    ("{\"prompt\": \"a\", \"max_tokens\": 0}\n", "max_tokens must be an integer >= 1"),
    ("{\"prompt\": \"a\"}\n{not json\n", ":2: not JSON"),
    ("[{\"conversations\": [{\"from\": \"human\", \"value\": \"Hi\"}, {\"from\": \"gpt\", \"value\": \"Yo\"}]}]",
     "none of its 1 entries is usable"),
])
def test_a_file_that_cannot_be_used_is_named_with_what_is_wrong(tmp_path, tok, content, says):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("(", r"\(")):
        sample(str(path), tok, 4, 0, None, 8)
    proc = bench("--dataset", str(path), "--url", "127.0.0.1:1")
    assert proc.returncode == 2 and "--dataset" in proc.stderr and says in proc.stderr, proc.stderr


def test_a_dataset_run_sends_the_files_prompts_and_lengths(served, tmp_path, tok):
    path = lines(tmp_path, [{"prompt": p, "max_tokens": 3 + i} for i, p in enumerate(PROMPTS[:4])])
    out = tmp_path / "report"
    proc = bench("--url", served.http, "--protocol", "openai", "--dataset", path, "--requests", "4",
                 "--concurrency", "2", "--warmup", "0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((out / "report.json").read_text())
    assert doc["summary"]["requests"] == 4 and doc["summary"]["failed"] == 0
    [stream] = doc["scenario"]["streams"]
    assert (stream["source"], stream["prompts"], stream["count"]) == (path, 4, 4)
    sent = sorted((r["prompt_tokens"], r["output_tokens"]) for r in doc["records"])
    assert sent == sorted((len(tok.encode(p)), 3 + i) for i, p in enumerate(PROMPTS[:4]))
