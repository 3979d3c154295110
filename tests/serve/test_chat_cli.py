"""`tandem chat` (cli/chat_cmd.py) against the session's real stacks, as a user runs it: one question
streams the answer the API gives; without one, each stdin line is a turn answered with the conversation
before it (the API's answers to the same conversation), /exit ends it, a refused turn is named on stderr
and left out while the conversation goes on; a server that wants a key gets TANDEM_API_KEY's; an
unreachable server is one line."""

from __future__ import annotations

import os
import subprocess
import sys

from ops.triton_process import free_port
from tests.conftest import GUARD_KEY
from tests.serve.clients import post
from tests.serve.test_startup_errors import one_error_line

MAX = 8


def chat(url: str, *args: str, stdin: str = "", key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"} | ({"TANDEM_API_KEY": key} if key else {})
    return subprocess.run([sys.executable, "-m", "cli.main", "chat", "--url", url, "--max-tokens", str(MAX), *args],
                          input=stdin, capture_output=True, text=True, timeout=300, env=env)


def answer(url: str, messages: list[dict], key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    status, got = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": MAX, "temperature": 0},
                       headers=headers)
    assert status == 200, got
    return got["choices"][0]["message"]["content"]


def test_one_question_streams_the_apis_answer(served):
    ran = chat(served.http, "Name a colour.", "--system", "Answer in one word.")
    want = answer(served.http, [{"role": "system", "content": "Answer in one word."},
                                {"role": "user", "content": "Name a colour."}])
    assert ran.returncode == 0 and ran.stdout == want + "\n", ran.stderr


def test_a_conversation_is_answered_turn_by_turn_and_goes_on_past_a_refusal(served):
    too_long = "word " * 9000  # past the model's context: a 400 for that turn alone
    ran = chat(served.http, stdin=f"My name is Ada.\n\n{too_long}\nWhat is my name?\n/exit\nNever asked.\n")
    first = answer(served.http, [{"role": "user", "content": "My name is Ada."}])
    second = answer(served.http, [{"role": "user", "content": "My name is Ada."},
                                  {"role": "assistant", "content": first},
                                  {"role": "user", "content": "What is my name?"}])
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == f"{first}\n{second}\n"
    assert ran.stderr.count("Error: 400") == 1 and "context" in ran.stderr, ran.stderr


def test_a_server_that_wants_a_key_gets_tandem_api_key(guarded):
    ran = chat(guarded.http, "Name a colour.", key=GUARD_KEY)
    assert ran.returncode == 0 and ran.stdout == answer(guarded.http, [{"role": "user", "content": "Name a colour."}],
                                                        GUARD_KEY) + "\n"
    ran = chat(guarded.http, "Name a colour.")
    assert ran.returncode != 0 and "401" in one_error_line(ran.stderr)


def test_an_unreachable_server_is_one_line():
    ran = chat(f"http://127.0.0.1:{free_port()}", "Hello")
    assert ran.returncode != 0 and "is 'tandem serve' running?" in one_error_line(ran.stderr)
