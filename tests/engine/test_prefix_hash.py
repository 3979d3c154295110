"""Chained page hashes (tandem/prefix.py): what they distinguish, incremental use, and the wire form."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.kv_layout import KVLayout
from tandem.prefix import (HASH_BYTES, PrefixHashError, engine_salt, extend_page_hashes, hashes_from_hex,
                           hashes_to_hex, next_page_hash, page_hashes, scoped_salt, tenant_salt)
from tandem.sampling_params import MAX_CACHE_SALT

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", tokens_per_page=4)
SALT = engine_salt("sha256:" + "ab" * 32, LAYOUT.to_dict())
TOKENS = [(i * 7919) % 49152 for i in range(37)]  # 9 full pages of 4, and one token over


def test_one_hash_per_full_page_only():
    assert len(page_hashes(TOKENS, 4, SALT)) == 9
    assert len(page_hashes(TOKENS[:36], 4, SALT)) == 9
    assert len(page_hashes(TOKENS[:35], 4, SALT)) == 8
    assert page_hashes(TOKENS[:3], 4, SALT) == []
    hs = page_hashes(TOKENS, 4, SALT)
    assert all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hs)
    assert len(set(hs)) == len(hs)


def test_a_hash_names_the_page_and_everything_before_it():
    base = page_hashes(TOKENS, 4, SALT)
    assert page_hashes(TOKENS[:20] + [1, 2, 3, 4, 5], 4, SALT)[:5] == base[:5]  # same prefix, same hashes
    changed = page_hashes([TOKENS[0] + 1] + TOKENS[1:], 4, SALT)
    assert all(a != b for a, b in zip(base, changed))  # an early token changes every later page
    late = TOKENS[:30] + [TOKENS[30] + 1] + TOKENS[31:]
    assert page_hashes(late, 4, SALT)[:7] == base[:7] and page_hashes(late, 4, SALT)[7:] != base[7:]
    same_pages = page_hashes([5, 6, 7, 8] * 3, 4, SALT)
    assert len(set(same_pages)) == 3  # equal content at different positions is different KV


def test_token_ids_are_encoded_in_full_and_in_order():
    assert page_hashes([70000, 1, 2, 3], 4, SALT) != page_hashes([70000 - 65536, 1, 2, 3], 4, SALT)
    assert page_hashes([1, 2, 3, 4], 4, SALT) != page_hashes([2, 1, 3, 4], 4, SALT)
    assert page_hashes([0] * 8, 8, SALT) != page_hashes([0] * 8, 4, SALT)[1:]


def test_the_engine_salt_separates_weights_and_layouts():
    digest = "sha256:" + "ab" * 32
    other_weights = engine_salt("sha256:" + "cd" * 32, LAYOUT.to_dict())
    other_layout = engine_salt(digest, {**LAYOUT.to_dict(), "dtype": "bfloat16"})
    reordered = engine_salt(digest, dict(reversed(list(LAYOUT.to_dict().items()))))
    assert len(SALT) == HASH_BYTES and reordered == SALT
    assert len({SALT, other_weights, other_layout}) == 3
    hs = [page_hashes(TOKENS, 4, s) for s in (SALT, other_weights, other_layout)]
    assert not set(hs[0]) & set(hs[1]) and not set(hs[0]) & set(hs[2])


def test_a_cache_salt_starts_a_chain_of_its_own():
    """No salt is the engine's chain itself; each salt a chain sharing no page with any other."""
    assert tenant_salt(SALT, "") == SALT
    salts = [tenant_salt(SALT, t) for t in ("tenant-a", "tenant-b", "tenant-a ")]
    assert tenant_salt(SALT, "tenant-a") == salts[0] and len({SALT, *salts}) == 4
    other_engine = tenant_salt(engine_salt("sha256:" + "cd" * 32, LAYOUT.to_dict()), "tenant-a")
    chains = [set(page_hashes(TOKENS, 4, s)) for s in (SALT, *salts, other_engine)]
    assert all(not a & b for i, a in enumerate(chains) for b in chains[i + 1:])
    with pytest.raises(PrefixHashError, match="cache_salt and lora must be strings"):
        tenant_salt(SALT, b"tenant-a")


def test_a_lora_adapter_starts_a_chain_of_its_own_that_no_cache_salt_reaches():
    """An adapter's pages hold other K/V: its chain (with any salt) shares no page with the base model's
    chains, whatever cache salt either names, nor with another adapter's."""
    salts = ["", "tenant-a", "lora:sql", "sql"]
    base = [tenant_salt(SALT, t) for t in salts]
    adapted = [tenant_salt(SALT, t, lora) for lora in ("sql", "chat") for t in salts]
    assert tenant_salt(SALT, "", "sql") == adapted[0] and len({*base, *adapted}) == len(base) + len(adapted)
    chains = [set(page_hashes(TOKENS, 4, s)) for s in (*base, *adapted)]
    assert all(not a & b for i, a in enumerate(chains) for b in chains[i + 1:])


def test_a_scoped_salt_stays_inside_its_scope():
    """Per-key isolation: every salt under a scope starts with it, a client's own salt only splits the
    scope further (and never reaches the workers as it was sent), and no scope leaves salts as they are."""
    a, b = "key-" + "a" * 32, "key-" + "b" * 32
    assert scoped_salt("", "merchant") == "merchant" and scoped_salt("", "") == ""
    assert scoped_salt(a, "") == a
    under_a = {scoped_salt(a, s) for s in ("", "merchant", "merchant ", b)}
    assert len(under_a) == 4 and all(s.startswith(a) for s in under_a) and "merchant" not in "".join(under_a)
    assert scoped_salt(a, "merchant") == scoped_salt(a, "merchant") != scoped_salt(b, "merchant")
    assert not under_a & {scoped_salt(b, s) for s in ("", "merchant", a)}
    assert len(scoped_salt(a, "x" * MAX_CACHE_SALT)) == len(a) + 33 <= MAX_CACHE_SALT


@pytest.mark.parametrize("digest, layout, match", [
    ("", LAYOUT.to_dict(), "weights_digest"),
    (None, LAYOUT.to_dict(), "weights_digest"),
    ("sha256:x", {}, "kv_layout_dict"),
    ("sha256:x", [("dtype", "float32")], "kv_layout_dict"),
    ("sha256:x", {"dtype": object()}, "JSON"),
])
def test_engine_salt_refuses_bad_input(digest, layout, match):
    with pytest.raises(PrefixHashError, match=match):
        engine_salt(digest, layout)


def test_limit_caps_the_number_of_hashes():
    full = page_hashes(TOKENS, 4, SALT)
    assert page_hashes(TOKENS, 4, SALT, limit=3) == full[:3]
    assert page_hashes(TOKENS, 4, SALT, limit=0) == []
    assert page_hashes(TOKENS, 4, SALT, limit=100) == full


def test_growing_a_sequence_token_by_token_hashes_each_page_once():
    want = page_hashes(TOKENS, 4, SALT)
    hashes: list[bytes] = []
    appended = []
    for n in range(len(TOKENS) + 1):
        new = extend_page_hashes(hashes, TOKENS[:n], 4, SALT)
        appended.append(len(new))
        assert hashes == want[:n // 4]
    assert sum(appended) == 9 and max(appended) == 1
    assert next_page_hash(SALT, TOKENS[:4]) == want[0]
    assert next_page_hash(want[0], TOKENS[4:8]) == want[1]


def test_extend_respects_limit_and_returns_only_new_hashes():
    hashes = page_hashes(TOKENS, 4, SALT, limit=2)
    new = extend_page_hashes(hashes, TOKENS, 4, SALT, limit=5)
    assert new == page_hashes(TOKENS, 4, SALT)[2:5] and len(hashes) == 5
    assert extend_page_hashes(hashes, TOKENS, 4, SALT, limit=5) == []


def test_hashes_are_the_same_in_another_process():
    code = ("import sys; from tandem.prefix import page_hashes, hashes_to_hex; "
            "print(hashes_to_hex(page_hashes(list(range(100)), 16, bytes(range(16)))))")
    outs = set()
    for seed in ("1", "2"):  # Python's own str/bytes hash differs per seed; ours must not
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                text=True).stdout.strip())
    assert outs == {hashes_to_hex(page_hashes(list(range(100)), 16, bytes(range(16))))}


@pytest.mark.parametrize("tokens, match", [
    ([1, 2, -1, 4], "-1"), ([1, 2, 2**32, 4], str(2**32)), ([1, 2.0, 3, 4], "2.0"), (["a", 1, 2, 3], "'a'"),
])
def test_bad_token_ids_are_refused_by_value(tokens, match):
    with pytest.raises(PrefixHashError, match="0..4294967295") as e:
        page_hashes(tokens, 4, SALT)
    assert match in str(e.value)


@pytest.mark.parametrize("kwargs, match", [
    ({"tokens_per_page": 0}, "tokens_per_page"), ({"tokens_per_page": "4"}, "tokens_per_page"),
    ({"salt": b"short"}, "salt must be 16 bytes"), ({"salt": "ab" * 16}, "salt must be 16 bytes"),
    ({"limit": -1}, "limit"),
])
def test_bad_arguments_are_refused(kwargs, match):
    args = {"token_ids": TOKENS, "tokens_per_page": 4, "salt": SALT, **kwargs}
    with pytest.raises(PrefixHashError, match=match):
        page_hashes(**args)


def test_wire_form_round_trips():
    hs = page_hashes(TOKENS, 4, SALT)
    text = hashes_to_hex(hs)
    assert len(text) == 2 * HASH_BYTES * len(hs) and hashes_from_hex(text) == hs
    assert hashes_to_hex([]) == "" and hashes_from_hex("") == []


@pytest.mark.parametrize("text, match", [
    ("ab" * 15, "not a multiple of 32"), ("AB" * 16, "lowercase hex"), ("zz" * 16, "'z'"),
    ("ab" * 14 + " ab ", "' '"),
    (b"ab" * 16, "expected a hex string"), (None, "expected a hex string"),
])
def test_malformed_wire_text_is_refused(text, match):
    with pytest.raises(PrefixHashError, match=match) as e:
        hashes_from_hex(text, what="cached_prefix")
    assert str(e.value).startswith("cached_prefix:")


def test_only_whole_hashes_go_on_the_wire():
    with pytest.raises(PrefixHashError, match=r"hashes\[1\] must be 16 bytes"):
        hashes_to_hex([SALT, b"x" * 15])
