"""Incremental text: pieces concatenate to the full decode, UTF-8 is never split, stop strings held back."""

from __future__ import annotations

from engine.detokenizer import TextStream


def test_pieces_concatenate_to_full_decode(default_engine):
    tok = default_engine.tokenizer
    text = "Héllo wörld — ünïcode 😀 and 中文字符, numbers 12345.\n  indented"
    ids = tok.encode(text)
    stream = TextStream(tok)
    pieces = [stream.add(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_prefix_is_held_back_then_released(default_engine):
    tok = default_engine.tokenizer
    ids = tok.encode("alpha beta gamma")
    stream = TextStream(tok, stop=(" betx",))
    out = "".join(stream.add(i) for i in ids)
    assert not stream.stopped
    assert out + stream.flush() == "alpha beta gamma"


def test_stop_string_cut_and_excluded(default_engine):
    tok = default_engine.tokenizer
    stream = TextStream(tok, stop=("gam", "zzz"))
    out = "".join(stream.add(i) for i in tok.encode("alpha beta gamma delta"))
    assert stream.stopped and out == "alpha beta " and stream.flush() == ""


def test_a_request_may_keep_its_stop_string(default_engine):
    tok = default_engine.tokenizer
    stream = TextStream(tok, stop=("gam", "zzz"), keep_stop=True)
    out = "".join(stream.add(i) for i in tok.encode("alpha beta gamma delta"))
    assert stream.stopped and out + stream.flush() == "alpha beta gam"


def test_a_request_may_keep_special_tokens_in_its_text(default_engine):
    from engine.tokenizer import ChatMessage

    tok = default_engine.tokenizer
    ids = tok.encode_chat([ChatMessage("user", "Hi")])
    kept = TextStream(tok, skip_special_tokens=False)
    text = "".join(kept.add(i) for i in ids) + kept.flush()
    assert text == tok.decode(ids, skip_special_tokens=False) and "<|im_start|>" in text
    plain = TextStream(tok)
    assert "".join(plain.add(i) for i in ids) + plain.flush() == tok.decode(ids) != text
