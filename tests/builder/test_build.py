"""`tandem build`: role engines, no-op rebuilds, refusals that write nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from builder.build import BuildError, BuildRequest, build
from builder.fingerprint import source_fingerprint
from tandem.manifest import ManifestError, check_pair, read_manifest
from tandem.roles import Role


def tandem(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, cwd=cwd)


def test_both_roles_have_manifest_weights_and_tokenizer(built_engines):
    for role in ("prefill", "decode"):
        folder = built_engines / role
        assert {"manifest.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"} <= \
            set(os.listdir(folder))
        m = read_manifest(str(folder))
        assert m.role.value == role and m.architecture == "LlamaForCausalLM" and m.dtype == "float32"
        assert m.weights_digest.startswith("sha256:") and m.tandem_version
        assert m.kv_layout.num_layers == 30 and m.kv_layout.num_kv_heads == 3 and m.kv_layout.head_dim == 64
        assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    p, d = read_manifest(str(built_engines / "prefill")), read_manifest(str(built_engines / "decode"))
    assert p.profile.max_num_tokens >= 4096 and p.profile.max_batch_size <= 16 and not p.profile.cuda_graph_batch_sizes
    assert d.profile.max_batch_size >= 128 and d.profile.max_num_tokens == d.profile.max_batch_size
    assert all(p.profile.reasons[k] for k in ("max_num_tokens", "max_batch_size", "cuda_graph_batch_sizes"))
    check_pair(p, d)
    # identical fp32 weights are stored once: decode's file is a hard link to prefill's
    assert os.stat(built_engines / "prefill" / "model.safetensors").st_ino == \
        os.stat(built_engines / "decode" / "model.safetensors").st_ino


def test_rebuild_is_a_noop_and_fast(built_engines):
    t = time.perf_counter()
    proc = tandem("build", "--out", str(built_engines))
    elapsed = time.perf_counter() - t
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("up to date") == 2
    assert elapsed < 5  # generous for a loaded CI machine; the command itself reports its own time


def test_int8_decode_engine_is_smaller_and_loads(tmp_path, default_engine):
    from engine.load import load_engine
    from tandem.sampling_params import SamplingParams

    build(BuildRequest(model="smollm2-135m", out=str(tmp_path), roles=(Role.DECODE,), weight_quant="int8-dynamic"),
          log=lambda *_: None)
    m = read_manifest(str(tmp_path / "decode"))
    assert m.profile.weight_quant == "int8-dynamic" and m.weights_bytes < 0.7 * default_engine.model.weight_bytes
    engine = load_engine(str(tmp_path / "decode"), kv_bytes=16 << 20)
    seq = engine.new_sequence("q", engine.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=3))
    engine.admit(seq)
    engine.prefill([seq])
    engine.release(seq)
    assert "Paris" in engine.tokenizer.decode(seq.output_ids)
    with pytest.raises(BuildError, match="decode-role option"):
        build(BuildRequest(model="smollm2-135m", out=str(tmp_path / "x"), roles=(Role.PREFILL,), weight_quant="int8"))


def test_missing_model_path_writes_nothing(tmp_path):
    out = tmp_path / "out"
    proc = tandem("build", "--model", str(tmp_path / "nope"), "--out", str(out))
    assert proc.returncode != 0 and "unknown model" in proc.stderr
    assert not out.exists()


def test_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("hello")
    with pytest.raises(BuildError, match="has no config.json"):
        build(BuildRequest(model=str(tmp_path / "src"), out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(BuildError, match="supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        build(BuildRequest(model=str(tmp_path), out=str(tmp_path / "out")))


def _hf_copy(built_engines, dst):
    shutil.copytree(built_engines / "prefill", dst)
    os.remove(dst / "manifest.json")
    return dst


def test_a_checkpoints_generation_config_is_copied_and_fingerprinted(built_engines, tmp_path):
    src = _hf_copy(built_engines, tmp_path / "src")
    before = source_fingerprint(str(src), [str(src / "model.safetensors")])
    (src / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    assert source_fingerprint(str(src), [str(src / "model.safetensors")]) != before  # a change rebuilds
    build(BuildRequest(model=str(src), out=str(tmp_path / "out"), roles=(Role.PREFILL,)))
    assert json.loads((tmp_path / "out" / "prefill" / "generation_config.json").read_text()) == {"temperature": 0.6}


def test_truncated_weights_are_refused(built_engines, tmp_path):
    src = _hf_copy(built_engines, tmp_path / "src")
    weights = src / "model.safetensors"
    os.truncate(weights, os.path.getsize(weights) // 2)
    with pytest.raises(BuildError, match="truncated or corrupted"):
        build(BuildRequest(model=str(src), out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_corrupted_gguf_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(BuildError, match="not a readable GGUF file"):
        build(BuildRequest(model=str(bad), out=str(tmp_path / "out")))


def test_corrupted_engine_weights_fail_the_digest_check(built_engines, tmp_path):
    from engine.errors import ModelLoadError
    from engine.load import load_engine

    eng = tmp_path / "eng"
    shutil.copytree(built_engines / "prefill", eng / "prefill")
    with open(eng / "prefill" / "model.safetensors", "r+b") as f:
        f.seek(10_000_000)
        f.write(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="do not match the manifest digest"):
        load_engine(str(eng / "prefill"), kv_bytes=None)


def test_output_folder_with_a_different_model_is_refused(built_engines, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((built_engines / "prefill" / "config.json").read_text())
    (other / "prefill").mkdir()
    manifest = json.loads((built_engines / "prefill" / "manifest.json").read_text())
    manifest["source_digest"] = "fp:someothermodel"
    manifest["model_name"] = "llama-7b"
    (other / "prefill" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BuildError, match="holds a different model \\(llama-7b"):
        build(BuildRequest(model="smollm2-135m", out=str(other)))
    assert json.loads((other / "prefill" / "manifest.json").read_text())["model_name"] == "llama-7b"


def test_mismatched_pair_is_refused_naming_field_and_values(tmp_path):
    out = str(tmp_path / "pair")
    build(BuildRequest(model="smollm2-135m", out=out, roles=(Role.PREFILL,), tokens_per_page=16), log=lambda *_: None)
    with pytest.raises(BuildError, match="'tokens_per_page': prefill has 16, decode has 32"):
        build(BuildRequest(model="smollm2-135m", out=out, roles=(Role.DECODE,), tokens_per_page=32))
    assert not os.path.exists(os.path.join(out, "decode"))
    # the same check guards a pair assembled by hand
    build(BuildRequest(model="smollm2-135m", out=str(tmp_path / "b"), roles=(Role.DECODE,), tokens_per_page=32),
          log=lambda *_: None)
    with pytest.raises(ManifestError, match="'tokens_per_page': prefill has 16, decode has 32"):
        check_pair(read_manifest(os.path.join(out, "prefill")), read_manifest(str(tmp_path / "b" / "decode")))


def test_dry_run_writes_nothing(tmp_path):
    proc = tandem("build", "--out", str(tmp_path / "dry"), "--dry-run")
    assert proc.returncode == 0 and "would build prefill, decode" in proc.stdout
    assert not (tmp_path / "dry").exists()
