"""The engine's CPU kernels (engine/cpu_kernels): built here; one-row products, in-place paged decode
attention (with its rotary embedding and K/V write) and the norms equal a float64 or PyTorch reference
within the dtype's rounding (bit for bit where the rounding steps are the same); refused where they do
not apply."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.cpu_kernels import attention as cpu_attention
from engine.cpu_kernels import build
from engine.cpu_kernels import gemv as cpu_gemv
from engine.cpu_kernels import norm as cpu_norm
from engine.linear import Dense
from engine.model import rms_norm
from engine.rope import apply_rotary

HAS_ISA = build.isa() is not None
needs_kernel = pytest.mark.skipif(not (HAS_ISA and build.load() is not None),
                                  reason="the kernels need a CPU with AVX-512 or AVX2 and a C++ compiler (or a cache)")
SHAPES = [(16, 2), (48, 40), (960, 576), (576, 1536), (3072, 576), (96, 200)]  # the smallest, a partial block, the
# default model's, and an `in` that is not a whole number of the kernel's chunks (64 steps; bf16 128 values)


@pytest.mark.skipif(not (HAS_ISA and shutil.which("c++")), reason="needs AVX-512 or AVX2 and a C++ compiler")
def test_the_kernel_builds_where_the_cpu_and_a_compiler_allow_it():
    assert build.load() is not None


@pytest.mark.skipif(not shutil.which("c++"), reason="needs a C++ compiler")
def test_the_image_build_compiles_the_kernels_for_every_instruction_set_on_any_cpu():
    """`build --all` (deploy/Dockerfile.cpu) compiles the AVX-512 and the AVX2 module whatever this CPU
    runs, and each imports here: its vector code sits only in functions the loader picks by CPU flags."""
    build.build_all()
    for target in build.ISAS:
        module = build._import(build._build_dir(target) / f"{build.NAME}_{target}.so")
        assert callable(module.gemv) and callable(module.decode_layers)


@pytest.mark.skipif(not ({"avx512f", "avx2", "fma"} <= build.cpu_flags() and shutil.which("c++")),
                    reason="needs a CPU with both AVX-512 and AVX2 (and a compiler)")
def test_fp32_kernels_give_the_same_bits_with_avx512_and_avx2():
    """simd16.h: both builds do the same fp32 arithmetic in the same order (fused multiply-adds, lane sums
    as one tree, e^x with one rounding of its scaling), so a model's fp32 answers do not depend on the
    CPU's instruction set. Products of 1 to 49 rows (whole, chunked, whole again) and paged attention."""
    build.build_all()
    avx512, avx2 = (build._import(build._build_dir(t) / f"{build.NAME}_{t}.so") for t in ("avx512", "avx2"))
    torch.manual_seed(3)
    w = cpu_gemv.pack(torch.randn(3072, 576))  # [192, 576, 16]
    for rows in (1, 5, 7, 48, 49):
        x = torch.randn(rows, 576)
        assert torch.equal(avx512.gemv(x, w), avx2.gemv(x, w)), rows
    kv = torch.randn(2, 64, 16, 3, 64)  # one pool layer: [2, pages, tpp, Hkv, hd]
    q, tab = torch.randn(6, 9, 64), torch.randperm(64)[:60].view(6, 10)
    lens = torch.tensor([1, 15, 16, 33, 100, 160])
    assert torch.equal(avx512.decode_attention(q, kv, tab, lens), avx2.decode_attention(q, kv, tab, lens))


# one row, part of a group of x rows, a full group, a group and one, several, the most taken in chunks, one more
ROWS = [1, 3, 6, 7, 16, 40, 48, 49]
needs_bf16 = pytest.mark.skipif(not (cpu_gemv.takes(torch.bfloat16) and build.load() is not None),
                                reason="needs the kernels' bf16 products (AVX2, or AVX-512 with AVX512_BF16)")


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_equals_a_float64_product(shape, rows):
    torch.manual_seed(0)
    w, x = torch.randn(shape), torch.randn(rows, shape[1])
    assert cpu_gemv.supports(w)
    want = (x.double() @ w.double().T).float()  # [rows, out]
    torch.testing.assert_close(cpu_gemv.gemv(x, cpu_gemv.pack(w)), want, rtol=1e-5, atol=2e-4)


@needs_bf16
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_equals_a_float64_product_of_the_same_values(shape, rows):
    torch.manual_seed(0)
    w, x = torch.randn(shape).bfloat16(), torch.randn(rows, shape[1]).bfloat16()
    assert cpu_gemv.supports(w)
    got = cpu_gemv.gemv(x, cpu_gemv.pack(w))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    want = (x.double() @ w.double().T).bfloat16()  # fp32 sums rounded once: within one bf16 step of the exact
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_is_the_same_bits_whatever_rows_are_beside_it(dtype):
    """Each row's sums run in one order for any row count: a sequence's logits do not depend on the
    batch it decodes in, nor on the row group of the kernel it lands in."""
    if not cpu_gemv.takes(dtype):
        pytest.skip("needs the kernels' bf16 products")
    torch.manual_seed(2)
    for out, inner in [(3072, 576), (112, 200)]:  # 200: chunks of 64, 64, 64, 8 steps (bf16: 128, 72 values)
        w, x = cpu_gemv.pack(torch.randn(out, inner).to(dtype)), torch.randn(52, inner).to(dtype)
        alone = torch.cat([cpu_gemv.gemv(x[r:r + 1], w) for r in range(52)])  # [52, out]
        for rows in (2, 5, 6, 7, 11, 16, 40, 47, 48, 49, 52):  # whole blocks, chunks (7-48), whole again
            assert torch.equal(cpu_gemv.gemv(x[:rows], w), alone[:rows]), (out, inner, rows)


def test_packing_puts_sixteen_output_rows_side_by_side():
    w = torch.arange(32 * 4, dtype=torch.float32).reshape(32, 4)  # W[o, i] = 4o + i
    p = cpu_gemv.pack(w)  # [2, 4, 16]
    assert p.shape == (2, 4, 16) and p[1, 3, 5] == w[16 + 5, 3]
    b = cpu_gemv.pack(w.bfloat16())  # [2, 2, 16, 2]
    assert b.shape == (2, 2, 16, 2) and b[1, 1, 5, 0] == w[16 + 5, 2] and b[1, 1, 5, 1] == w[16 + 5, 3]


@needs_kernel
@pytest.mark.parametrize("x, w", [(torch.randn(2, 64), torch.randn(32, 64)),
                                  (torch.randn(2, 64), torch.randn(2, 48, 16)),
                                  (torch.randn(2, 64).bfloat16(), torch.randn(2, 64, 16))],
                         ids=["not-packed", "inner-size-differs", "dtypes-differ"])
def test_a_weight_not_packed_for_x_is_refused(x, w):
    with pytest.raises(RuntimeError, match="a weight packed for it"):
        cpu_gemv.gemv(x, w)


@needs_kernel
@pytest.mark.parametrize("w", [torch.randn(24, 32), torch.randn(16, 33).bfloat16(), torch.randn(16, 32).half(),
                               torch.randn(32)],
                         ids=["rows-not-multiple-of-16", "bf16-inner-odd", "fp16", "1-d"])
def test_weights_it_cannot_multiply_are_refused(w):
    assert not cpu_gemv.supports(w)


@needs_kernel
def test_a_bf16_dense_layer_gives_few_rows_what_the_batched_kernel_gives_them():
    """In bf16 a few rows go to this kernel, more to oneDNN's: the same product within rounding."""
    if not cpu_gemv.takes(torch.bfloat16) or cpu_gemv.ROWS_FASTER[torch.bfloat16] == cpu_gemv.EVERY_ROW_COUNT:
        pytest.skip("needs bf16 products split between the kernel and oneDNN (AVX-512 with AVX512_BF16)")
    torch.manual_seed(1)
    rows = cpu_gemv.ROWS_FASTER[torch.bfloat16] + 8  # more than the kernel is given
    w, b, x = (torch.randn(960, 576).bfloat16(), torch.randn(960).bfloat16(), torch.randn(rows, 576).bfloat16())
    layer = Dense(w, b)
    assert layer._packed is not None and layer.weight is not None  # two copies: packed, and oneDNN's
    one, batch = layer(x[:3]), layer(x)  # [3, 960], [rows, 960]
    torch.testing.assert_close(one.float(), batch[:3].float(), rtol=2 ** -6, atol=2e-2)


@needs_kernel
def test_an_fp32_dense_layer_holds_one_copy_and_gives_a_row_the_same_bits_in_any_batch():
    """fp32 products of every row count go to this kernel, so the layer keeps only the packed weight, and
    a row's output does not depend on how many rows are beside it (1 to 600; a prompt longer than the
    one-call limit goes through the layer loop with the same products)."""
    torch.manual_seed(1)
    w, b, x = torch.randn(960, 576), torch.randn(960), torch.randn(600, 576)
    layer = Dense(w, b)
    assert layer._packed is not None and layer.weight is None
    alone = layer(x[:1])  # [1, 960]
    for rows in (3, 64, 65, 600):
        assert torch.equal(layer(x[:rows])[:1], alone)
    torch.testing.assert_close(layer(x), x.double().matmul(w.double().T).add(b.double()).float(),
                               rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dense_layer_reads_its_rows_back_from_the_packed_weight(dtype):
    """A tied head's embedding lookups read the packed copy (engine/model.py keeps no plain embedding)."""
    if not cpu_gemv.takes(dtype):
        pytest.skip("needs the kernels' bf16 products")
    w = torch.randn(96, 64).to(dtype)
    layer = Dense(w)
    ids = torch.tensor([0, 17, 95, 17, 40])
    assert layer.holds_rows and torch.equal(layer.rows(ids), w[ids])


def _reference_attention(q, kv, tables, lens):
    """float64 softmax(q k / sqrt(hd)) v per row over its first lens[b] keys, read through its table."""
    B, H, hd = q.shape
    tpp, Hkv = kv.shape[2], kv.shape[3]
    out = torch.empty(B, H, hd, dtype=torch.float64)
    for b in range(B):
        slots = [tables[b][t // tpp] * tpp + t % tpp for t in range(lens[b])]
        k = kv[0].flatten(0, 1)[slots].double()  # [L, Hkv, hd]
        v = kv[1].flatten(0, 1)[slots].double()
        for h in range(H):
            g = h // (H // Hkv)
            w = torch.softmax(k[:, g] @ q[b, h].double() / hd ** 0.5, dim=0)  # [L]
            out[b, h] = w @ v[:, g]
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tpp", [16, 12])  # 12: a block of sixteen keys spans two pages
def test_paged_decode_attention_equals_a_float64_reference(dtype, tpp):
    """Scrambled page tables, contexts of 1 to 700 tokens (not multiples of the page or of 16), grouped
    heads, a page past the context that holds garbage (never read)."""
    torch.manual_seed(2)
    H, Hkv, hd, pages = 9, 3, 64, 90
    kv = torch.randn(2, pages, tpp, Hkv, hd).to(dtype)  # one layer of a pool
    lens = [1, 17, 64, 700]
    order = torch.randperm(pages).tolist()
    tables, at = [], 0
    for n in lens:
        need = -(-n // tpp) + 1  # one spare page each: the kernel must stop at the context
        tables.append(order[at:at + need])
        at += need
    width = max(len(t) for t in tables)
    tab = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), H, hd).to(dtype)
    assert cpu_attention.supports(torch.empty(1, *kv.shape, dtype=dtype))
    got = cpu_attention.decode(q, kv, tab, torch.tensor(lens))
    want = _reference_attention(q, kv, tables, lens)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=4e-3)
    torch.testing.assert_close(got.double(), want.to(dtype).double(), **tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, Hkv", [(9, 3), (8, 1), (12, 2)])  # per kv head 3; 8 (4 + 4, alone 1s); 6 (4 + 2)
def test_a_rows_attention_is_the_same_bits_whatever_batch_it_is_in(dtype, H, Hkv):
    """Alone, a row's query heads may be split one per work item; in a batch they share one pass over
    their kv head's keys and values, and the batch's rows are taken from both ends. Each head's sums run
    in the same order either way. (An odd batch: its middle row is the last one taken.)"""
    torch.manual_seed(5)
    hd, tpp, B = 64, 16, 25
    kv = torch.randn(2, B * 4, tpp, Hkv, hd).to(dtype)
    tab = torch.randperm(B * 4).view(B, 4)
    lens = torch.randint(1, 4 * tpp + 1, (B,))
    q = torch.randn(B, H, hd).to(dtype)
    batched = cpu_attention.decode(q, kv, tab, lens)
    for b in range(B):
        alone = cpu_attention.decode(q[b:b + 1], kv, tab[b:b + 1], lens[b:b + 1])
        assert torch.equal(alone[0], batched[b])
    want = _reference_attention(q, kv, tab.tolist(), lens.tolist())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=4e-3)
    torch.testing.assert_close(batched.double(), want.to(dtype).double(), **tol)


def _each_row_alone_as_in_the_pass(kv: torch.Tensor, rows: list[tuple[list[int], int]], H: int) -> None:
    """Rows (page table, context length) over one pool layer kv, random queries of H heads, in one pass:
    each row alone gives the same bits as in the pass, and all of them the float64 result."""
    dtype, hd = kv.dtype, kv.shape[-1]
    tab = torch.tensor([t for t, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    q = torch.randn(len(rows), H, hd).to(dtype)
    together = cpu_attention.decode(q, kv, tab, lens)
    for b in range(len(rows)):
        assert torch.equal(cpu_attention.decode(q[b:b + 1], kv, tab[b:b + 1], lens[b:b + 1])[0], together[b])
    want = _reference_attention(q, kv, tab.tolist(), lens.tolist())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=4e-3)
    torch.testing.assert_close(together.double(), want.to(dtype).double(), **tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_that_share_a_page_table_attend_in_tiles_and_each_gets_its_bits_alone(dtype):
    """A prompt's rows read one page table: the kernel takes up to four of them per pass over the keys
    while their contexts are short.
    A pass here: 11 rows of one prompt (contexts 30..40: tiles of 3, 4, 4), a decode row, 6 rows of
    another sequence whose contexts are not in order (tiles of 3, 3), a decode row. Every row alone must
    give the same bits as in the pass, and all of them the float64 result."""
    torch.manual_seed(7)
    H, Hkv, hd, tpp = 9, 3, 64, 12
    kv = torch.randn(2, 40, tpp, Hkv, hd).to(dtype)
    order = torch.randperm(40).tolist()
    prompt, other, d1, d2 = order[:4], order[4:8], order[8:12], order[12:16]
    rows = ([(prompt, 30 + i) for i in range(11)] + [(d1, 17)] +
            [(other, n) for n in (5, 48, 1, 33, 48, 20)] + [(d2, 44)])
    _each_row_alone_as_in_the_pass(kv, rows, H)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, Hkv, hd", [(9, 3, 64), (8, 2, 80)])  # 80: value chunks of 4, then one alone
def test_long_contexts_attend_in_tiles_of_up_to_16_rows_and_each_row_gets_its_bits_alone(dtype, H, Hkv, hd):
    """Past 1024 keys a prompt's rows share a pass over the keys up to 16 at a time (on 2 threads, 130
    rows: tiles of 14-15), and their values are weighed 128 keys at a time by groups of 6 (row, head)
    pairs. A pass of 130 rows of one prompt (contexts 1100..1229) and a decode row: every row alone gives
    the same bits as in the pass, and all of them the float64 result."""
    torch.manual_seed(11)
    tpp, pages = 16, 90
    kv = torch.randn(2, pages, tpp, Hkv, hd).to(dtype)
    order = torch.randperm(pages).tolist()
    prompt, decode = order[:78], order[78:] + order[:66]
    rows = [(prompt, 1100 + i) for i in range(130)] + [(decode, 1030)]
    _each_row_alone_as_in_the_pass(kv, rows, H)


@needs_kernel
def test_pools_the_attention_kernel_cannot_read_are_refused():
    assert not cpu_attention.supports(torch.empty(2, 2, 4, 16, 3, 64, dtype=torch.float16))
    assert not cpu_attention.supports(torch.empty(2, 2, 4, 16, 3, 24))  # head size not a multiple of 16
    assert not cpu_attention.supports(torch.empty(2, 2, 4, 16, 3, 64).transpose(2, 3))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_decode_step_rotates_and_writes_as_pytorch_does_then_attends(dtype):
    """decode_step writes exactly what apply_rotary gives (bit for bit) and v into the slots, then attends
    over the context including the new token."""
    torch.manual_seed(3)
    H, Hkv, hd, tpp, pages = 9, 3, 64, 16, 16
    kv = torch.randn(2, pages, tpp, Hkv, hd).to(dtype)
    tables, lens = [[3, 7, 1], [0, 12]], [40, 17]  # the new token is each context's last
    slots = torch.tensor([t[(n - 1) // tpp] * tpp + (n - 1) % tpp for t, n in zip(tables, lens)])
    qkv = torch.randn(2, H + 2 * Hkv, hd).to(dtype)
    cos, sin = torch.randn(2, 1, hd).to(dtype), torch.randn(2, 1, hd).to(dtype)
    want_qk = apply_rotary(qkv[:, :H + Hkv], cos, sin)  # [2, H + Hkv, hd]
    tab = torch.tensor([t + [t[0]] * (3 - len(t)) for t in tables])
    got = cpu_attention.decode_step(qkv, cos.flatten(1), sin.flatten(1), kv, slots, tab, torch.tensor(lens))
    k_slots, v_slots = kv[0].flatten(0, 1), kv[1].flatten(0, 1)  # [pages * tpp, Hkv, hd]
    assert torch.equal(k_slots[slots], want_qk[:, H:]) and torch.equal(v_slots[slots], qkv[:, H + Hkv:])
    want = _reference_attention(want_qk[:, :H], kv, tables, lens).flatten(1)  # [2, H * hd]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=4e-3)
    torch.testing.assert_close(got.double(), want.to(dtype).double(), **tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_kernel_equals_the_pytorch_norm_after_the_same_residual_add(dtype):
    torch.manual_seed(4)
    x, delta, w = torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype), torch.randn(576).to(dtype)
    want_x = x + delta
    want = rms_norm(want_x, w, 1e-5)
    got = cpu_norm.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, want_x)  # the residual add is in place and rounds as PyTorch's add does
    torch.testing.assert_close(got, want, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)


def _decode_all(engine, prompts: list[list[int]], params, tag: str):
    """Prefill each prompt, then decode them together as one batch to the end: the sequences. `params`:
    every prompt's, or a list of each one's."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [engine.new_sequence(f"{tag}{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, each))]
    for s in seqs:
        engine.admit(s)
        engine.prefill([s])
    while not all(s.finished for s in seqs):
        engine.decode_step([s for s in seqs if not s.finished])
    for s in seqs:
        engine.release(s)
    return seqs


@needs_kernel
@pytest.mark.parametrize("dtype, batch", [("float32", 1), ("float32", 3), ("bfloat16", 1), ("bfloat16", 3),
                                          ("float32", 20)])  # 20: past the 16 rows the one call took before
def test_a_decode_step_in_one_call_equals_the_layer_loop_bit_for_bit(dtype, batch, monkeypatch):
    """engine/cpu_kernels/layers.py runs the loop's kernels in the loop's order: same tokens, same logprobs
    (to the last bit) as engine/model.py's layer loop, over sampled answers of 24 tokens decoded alone
    and as a batch. (The prompts' passes go the same way in both runs: only decode steps take the loop.)"""
    from engine.attention import PagedAttention
    from engine.cpu_kernels import layers as cpu_layers
    from engine.load import load_engine
    from tandem.sampling_params import SamplingParams

    engine = load_engine("smollm2-135m", dtype=dtype, kv_bytes=128 << 20)
    assert engine.model._one_call is not None  # the default model qualifies on this CPU
    calls, real = [], cpu_layers.run_pass
    monkeypatch.setattr(cpu_layers, "run_pass", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    base = ["Name three rivers of Europe and say where each one meets the sea.", "What is a prime number?",
            "Write one sentence about the moon."]
    questions = [base[i % 3] + (f" Start with the number {i}." if i >= 3 else "") for i in range(batch)]
    assert batch <= cpu_layers.max_rows(getattr(torch, dtype))
    prompts = [engine.tokenizer.encode(q) for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True, logprobs=True, top_logprobs=4)
    fused = _decode_all(engine, prompts, params, "fused")
    short = [len(p) for p in prompts if len(p) <= engine.model.one_call_rows]  # prompts that fit one call too
    assert calls == short + [batch] * 23  # every decode step after the prefill's first token, all rows at once
    rows = PagedAttention.in_place_rows
    monkeypatch.setattr(PagedAttention, "in_place_rows", lambda a: None if a.all_decode else rows(a))
    loop = _decode_all(engine, prompts, params, "loop")
    assert calls == short + [batch] * 23 + short  # the loop run: its prompts in one call, its decode steps not
    for f, g in zip(fused, loop):
        assert f.output_ids == g.output_ids and len(f.output_ids) == 24
        assert f.output_logprobs == g.output_logprobs


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_rows_in_one_call_get_the_layer_loops_bits(dtype, monkeypatch, tmp_path):
    """Rows of LoRA adapters take their updates inside the one call (decode_layers.cpp): a decode batch of
    two adapters' rows and base rows gives, to the last bit, the tokens and logprobs the layer loop gives."""
    from engine.attention import PagedAttention
    from engine.cpu_kernels import layers as cpu_layers
    from engine.load import load_engine
    from scripts.gpu_check.lora_check import write_adapter
    from tandem.sampling_params import SamplingParams

    base = load_engine("smollm2-135m", dtype=dtype, kv_bytes=8 << 20)
    modules = {n: write_adapter(str(tmp_path / n), base.cfg, seed) for n, seed in (("a", 1), ("b", 2))}
    engine = load_engine("smollm2-135m", dtype=dtype, kv_bytes=128 << 20, lora_modules=modules)
    calls, real = [], cpu_layers.run_pass
    monkeypatch.setattr(cpu_layers, "run_pass", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    prompts = [engine.tokenizer.encode(q) for q in ("What is a prime number?", "Name a river.", "Hello there.")]
    loras = ["a", "", "b"]  # each prompt's adapter ("": none)

    def decode_all(tag: str):
        return _decode_all(engine, prompts, [SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True,
                                                            logprobs=True, lora=lora) for lora in loras], tag)

    fused = decode_all("fused")
    assert calls == [len(p) for p in prompts] + [3] * 11  # prompts and decode steps, adapter rows and all
    rows = PagedAttention.in_place_rows
    monkeypatch.setattr(PagedAttention, "in_place_rows", lambda a: None if a.all_decode else rows(a))
    loop = decode_all("loop")
    for f, g in zip(fused, loop):
        assert f.output_ids == g.output_ids and f.output_logprobs == g.output_logprobs
    loras[:] = ["", "", ""]
    plain = decode_all("plain")
    assert all(plain[i].output_logprobs != fused[i].output_logprobs for i in (0, 2))  # the updates count
    assert plain[1].output_logprobs == fused[1].output_logprobs  # a base row's bits whatever rows are beside it


@needs_kernel
def test_layers_with_a_bias_or_without_the_few_row_kernel_keep_the_layer_loop():
    from engine.cpu_kernels.layers import layer_weights
    from engine.model import Layer

    def layer(bias=None, dtype=torch.float32):
        D = 64

        def dense(out, inp, b=None):
            return Dense(torch.randn(out, inp, dtype=dtype), b)

        return Layer(torch.ones(D, dtype=dtype), dense(3 * D, D, bias), dense(D, D), torch.ones(D, dtype=dtype),
                     dense(4 * D, D), dense(D, 2 * D))

    assert layer_weights([layer(), layer()]) is not None and len(layer_weights([layer(), layer()])) == 12
    assert layer_weights([layer(), layer(bias=torch.zeros(3 * 64))]) is None  # Qwen-style q/k/v biases
    assert layer_weights([layer(dtype=torch.float16)]) is None  # no few-row kernel for fp16
