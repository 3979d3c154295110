"""LoRA adapters (engine/lora.py) against PEFT, the reference: an adapter made and saved by PEFT on
transformers' load of the default model gives, in Tandem's engine, the tokens PEFT's model gives, greedy,
token for token; requests of the adapter and of the base model share passes and each gets its own
model's tokens; what the engine cannot apply is refused at load, naming it."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from engine.checkpoint import resolve
from engine.errors import InvalidRequest, ModelLoadError
from engine.load import load_engine
from engine import lora
from engine.lora import load_adapter
from engine.lora_files import check_against
from engine.tokenizer import ChatMessage
from tandem.sampling_params import SamplingParams
from tests.engine.test_exactness import CHAT_PROMPTS, hf_greedy

peft = pytest.importorskip("peft")
MAX_TOKENS = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model, folder: str, targets: list[str], seed: int, **config):
    """A LoRA of rank 8 on `targets`, random A and B (B scaled so the answers change but stay text),
    saved by PEFT into `folder`; returns PEFT's model (the reference)."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def adapters(hf_default_model, tmp_path_factory):
    """Two adapters of the default model, their folders and PEFT models: every projection, and the
    attention's q and v alone (use_rslora's scale)."""
    _, hf = hf_default_model
    root = tmp_path_factory.mktemp("lora")
    every, qv = str(root / "every"), str(root / "qv")
    return {"every": (every, make_adapter(hf, every, TARGETS, 1)),
            "qv": (qv, make_adapter(hf, qv, ["q_proj", "v_proj"], 2, use_rslora=True))}


@pytest.fixture(scope="module")
def engine(adapters):
    return load_engine("smollm2-135m", kv_bytes=128 << 20, lora_modules={k: v[0] for k, v in adapters.items()})


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.tokenizer.encode_chat([ChatMessage("user", p)]) for p in CHAT_PROMPTS[1:5]]


def run_mixed(engine, prompts: list[list[int]], loras: list[str]) -> list[list[int]]:
    """Every prompt with its adapter ("" for none), prefilled in one pass and decoded in shared steps."""
    seqs = [engine.new_sequence(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, lora=a))
            for i, (p, a) in enumerate(zip(prompts, loras))]
    for s in seqs:
        engine.admit(s)
    engine.prefill(seqs)
    while running := [s for s in seqs if not s.finished]:
        engine.decode_step(running)
    for s in seqs:
        engine.release(s)
    return [s.output_ids for s in seqs]


def test_an_adapters_greedy_tokens_are_pefts(engine, adapters, prompts, hf_default_model):
    eos = 2  # the model's end of turn, as tests/engine/test_exactness.py stops transformers
    for name, (_, reference) in adapters.items():
        got = run_mixed(engine, prompts, [name] * len(prompts))
        want = [hf_greedy(reference, p, MAX_TOKENS, eos) for p in prompts]
        assert got == want, name
    base = [hf_greedy(hf_default_model[1], p, MAX_TOKENS, eos) for p in prompts]
    assert run_mixed(engine, prompts, [""] * len(prompts)) == base
    assert got != base  # the adapters change the answers


def test_adapters_and_the_base_model_share_passes(engine, adapters, prompts):
    loras = ["every", "", "qv", "every"]
    alone = {a: run_mixed(engine, prompts, [a] * len(prompts)) for a in set(loras)}
    assert run_mixed(engine, prompts, loras) == [alone[a][i] for i, a in enumerate(loras)]


@pytest.mark.parametrize("mask_rows", [64, 0], ids=["by mask", "by index"])
def test_each_row_of_a_pass_takes_its_own_adapters_update(engine, monkeypatch, mask_rows):
    """LoraRows of a pass of rows of two adapters and of none: each row gains its adapter's update alone,
    whether the rows are picked by mask (a short pass) or by index (a long one)."""
    monkeypatch.setattr(lora, "MASK_ROWS", mask_rows)
    names, counts = ["every", "", "qv", "every"], [1, 2, 1, 2]
    rows = lora.rows_of(engine.model.loras, names, counts, torch.device("cpu"), torch.float32)
    assert {r.dtype for _, r in rows.groups} == {torch.float32 if mask_rows else torch.long}
    torch.manual_seed(0)
    qkv = engine.model.loras["every"].layers[3]["qkv"]
    x, y = torch.randn(6, qkv.a_t.shape[0]), torch.randn(6, qkv.b_t.shape[1])  # [T, in], [T, out]
    got = rows.add(3, "qkv", x, y.clone())
    per_row = [name for name, n in zip(names, counts) for _ in range(n)]
    for i, name in enumerate(per_row):
        u = engine.model.loras[name].layers[3]["qkv"] if name else None
        want = y[i] + (x[i] @ u.a_t @ u.b_t if u is not None else 0)
        assert torch.allclose(got[i], want, atol=1e-5), (i, name)


def test_an_unknown_adapter_is_refused_by_name(engine, prompts):
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'other'"):
        engine.new_sequence("x", prompts[0], SamplingParams(lora="other"))


def _edited(adapters, tmp_path, config: dict | None = None, tensors=None) -> str:
    """A copy of the "qv" adapter with its config updated by `config` and its tensors by `tensors(dict)`."""
    from safetensors.torch import load_file, save_file

    src, dst = adapters["qv"][0], str(tmp_path / "edited")
    os.makedirs(dst)
    with open(os.path.join(src, "adapter_config.json")) as f:
        conf = json.load(f) | (config or {})
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(conf, f)
    weights = load_file(os.path.join(src, "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, os.path.join(dst, "adapter_model.safetensors"))
    return dst


@pytest.mark.parametrize("config, tensors, says", [
    ({"use_dora": True}, None, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"bias": "lora_only"}, None, "bias 'lora_only'"),
    ({"peft_type": "IA3"}, None, "peft_type must be LORA"),
    ({"r": 0}, None, "r (the rank)"),
    ({"fan_in_fan_out": True}, None, "fan_in_fan_out"),
    ({"lora_alpha": "16"}, None, "lora_alpha must be a number"),
    ({"r": 4}, None, "lora_A [4, 576]"),
    (None, lambda w: w | {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 576)}, "lm_head"),
    (None, lambda w: {k: v for k, v in w.items() if "layers.3.self_attn.q_proj.lora_B" not in k}, "layer 3 q"),
    (None, lambda w: {}, "holds no LoRA update"),
])
def test_what_the_engine_cannot_apply_is_refused_at_load(adapters, tmp_path, config, tensors, says):
    folder, cfg = _edited(adapters, tmp_path, config, tensors), resolve("smollm2-135m").config
    for check in (lambda: load_adapter("edited", folder, cfg, torch.device("cpu"), torch.float32),
                  lambda: check_against("edited", folder, cfg)):  # the engine's load, and the front door's check
        with pytest.raises(ModelLoadError) as e:
            check()
        assert says in str(e.value) and "LoRA adapter 'edited'" in str(e.value), e.value
