"""Chat templates: chat_template.jinja beside the tokenizer, named-list templates, an override, tools;
real tokenizer files (the default model's tokenizer.json) in folders the tests write."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.checkpoint import resolve
from engine.errors import InvalidRequest, ModelLoadError
from engine.tokenizer import ChatMessage, Tokenizer

HELLO = [ChatMessage("user", "hello")]


@pytest.fixture(scope="module")
def tokenizer_json():
    return resolve("smollm2-135m").folder + "/tokenizer.json"


def folder(tmp_path, tokenizer_json, config: dict | None = None, jinja: str | None = None):
    shutil.copyfile(tokenizer_json, tmp_path / "tokenizer.json")
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return str(tmp_path)


def test_chat_template_jinja_beside_the_tokenizer_wins_over_the_config(tmp_path, tokenizer_json):
    tok = Tokenizer(folder(tmp_path, tokenizer_json, {"chat_template": "CONFIG {{ messages[0].content }}"},
                           "FILE {% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"))
    assert tok.render_chat(HELLO) == "FILE <user>hello"
    assert tok.encode_chat(HELLO) == tok.encode("FILE <user>hello")[:len(tok.encode_chat(HELLO))]


def test_named_templates_pick_default_and_an_override_picks_by_name(tmp_path, tokenizer_json):
    cfg = {"chat_template": [{"name": "tool_use", "template": "TOOLS {{ tools | length }} {{ messages[0].content }}"},
                             {"name": "default", "template": "DEFAULT {{ messages[0].content }}"}]}
    path = folder(tmp_path, tokenizer_json, cfg)
    assert Tokenizer(path).render_chat(HELLO) == "DEFAULT hello"
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    assert Tokenizer(path, "tool_use").render_chat(HELLO, tools=tools) == "TOOLS 2 hello"
    with pytest.raises(ModelLoadError, match="neither a file nor a named template.*default, tool_use"):
        Tokenizer(path, "nope")


def test_an_override_file_replaces_the_models_template(tmp_path, tokenizer_json):
    (tmp_path / "m").mkdir()
    path = folder(tmp_path / "m", tokenizer_json, {"chat_template": "MODEL {{ messages[0].content }}"})
    override = tmp_path / "mine.jinja"
    override.write_text("MINE {{ messages[0].content }}{% if add_generation_prompt %}>{% endif %}")
    assert Tokenizer(path, str(override)).render_chat(HELLO) == "MINE hello>"
    assert Tokenizer(path).render_chat(HELLO) == "MODEL hello"


def test_no_template_or_a_malformed_list_is_clear(tmp_path, tokenizer_json):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    bare = Tokenizer(folder(tmp_path / "a", tokenizer_json))
    with pytest.raises(InvalidRequest, match="no chat template"):
        bare.render_chat(HELLO)
    with pytest.raises(ModelLoadError, match="must be a string or a list"):
        Tokenizer(folder(tmp_path / "b", tokenizer_json, {"chat_template": [{"name": "default"}]}))


def test_serve_stops_on_an_unknown_template_with_one_clear_error(tmp_path, tokenizer_json):
    from ops.deployment import DeploymentError, load_deployment
    from ops.model_files import front_door_tokenizer

    (tmp_path / "prefill").mkdir()
    folder(tmp_path / "prefill", tokenizer_json, {"chat_template": [{"name": "default", "template": "D"}]})
    dep = load_deployment(None, {"front_door.chat_template": "chatml"})
    with pytest.raises(DeploymentError, match="'chatml' is neither a file nor a named template.*default"):
        front_door_tokenizer(str(tmp_path), dep)
    named = load_deployment(None, {"front_door.chat_template": "default"})
    assert front_door_tokenizer(str(tmp_path), named).render_chat(HELLO) == "D"


def test_a_tool_calling_conversation_reaches_the_template_with_its_calls(tmp_path, tokenizer_json):
    """An assistant's tool_calls and a tool message's tool_call_id are given to the template under
    Hugging Face's keys, and only when the message has them."""
    tok = Tokenizer(folder(tmp_path, tokenizer_json, jinja=(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.id }} {{ c.function.name }}{{ c.function.arguments }}>{% endfor %}"
        "{% if m.tool_call_id is defined %}<for {{ m.tool_call_id }}>{% endif %}{% endfor %}")))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    chat = [ChatMessage("user", "time?"), ChatMessage("assistant", "", (call,)),
            ChatMessage("tool", "12:00", tool_call_id="call_1")]
    assert tok.render_chat(chat, add_generation_prompt=False) == \
        '[user]time?[assistant]<call_1 get_time{"zone": "CET"}>[tool]12:00<for call_1>'
