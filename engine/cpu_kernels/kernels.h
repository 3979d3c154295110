// Tandem's CPU kernels (engine/cpu_kernels): the contracts the Python wrappers check before calling.
// The module is built for one instruction set, AVX-512 or AVX2 with FMA (simd16.h; engine/cpu_kernels/
// build.py picks the CPU's). Every loop that uses it carries its own target attribute and the rest is
// built for any x86-64, so loading the module never executes an instruction the CPU lacks; the wrappers
// check the CPU flags.
#pragma once
#include <torch/extension.h>

// x: [M, in] contiguous, M >= 1; P: a weight W [out, in] packed by engine/cpu_kernels/gemv.py's `pack`
// (fp32 [out/16, in, 16]; bf16 [out/16, in/2, 16, 2]) of x's dtype -> [M, out] = x @ W.T of that dtype;
// each output's sum in an order independent of M. bf16 in the AVX-512 build needs AVX512_BF16.
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& P);

// One query row per sequence over its paged context:
//   q: [B, H, hd]; kv: [2, pages, tokens_per_page, Hkv, hd] (one layer of the pool, k then v);
//   tables: [B, P] int64 page ids; ctx: [B] int64 context lengths (1 <= ctx[b] <= P * tokens_per_page)
//   -> [B, H, hd]: softmax(q . k / sqrt(hd)) . v over keys 0..ctx[b]-1, query head h reading kv head
//   h / (H / Hkv). q and kv both float32 or both bfloat16 (math in fp32); hd % 16 == 0, hd <= 256.
//   A row's result is the same bits whatever rows are beside it.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
                               const torch::Tensor& ctx);

// A decode step's attention for one row per sequence, from the unrotated projections: rotates q and k
// (rotary tables cos, sin with the sign of rotate_half in sin, as engine/rope.py), writes k and v to the
// pool at slots[b], then decode_attention. qkv: [B, H + 2*Hkv, hd] (q heads, k heads, v heads; rows may
// be strided); cos, sin: [B, hd]; kv: one pool layer as above (written); slots: [B] int64 flat slot
// (page * tokens_per_page + row) -> [B, H * hd]. Same dtype and size rules as decode_attention.
torch::Tensor decode_step_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                    torch::Tensor kv, const torch::Tensor& slots, const torch::Tensor& tables,
                                    const torch::Tensor& ctx);

// RMSNorm of rows, after an optional residual add: if delta is given, x += delta in place (rounded to x's
// dtype); then -> [T, D] = weight * round(x * rsqrt(mean(x^2) + eps)), the statistics in fp32 and the
// rounding steps of the reference (module comment in rms_norm.cpp). x [T, D], delta [T, D], weight [D]
// contiguous, all float32 or all bfloat16. Plain C++: no CPU requirement.
torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& delta, const torch::Tensor& w,
                       double eps);

// A pass's LoRA rows (engine/lora.py LoraRows.flat): per adapter, its rows (none: all; a 0/1 mask [T, 1] in
// the pass's dtype; or int64 indices [n]), then for each layer the a_t [in, n*r] and b_t [n*r, out] of its
// qkv, o, gate_up and down products (none for both where the adapter leaves one alone).
using LoraGroups = std::vector<std::vector<c10::optional<torch::Tensor>>>;

// A pass's rows through every decoder layer, each attending as its own sequence: a decode row, or a prompt
// row whose slot, table and context end at its own position (all rows' K/V are written before any row
// attends, so a prompt's rows see each other causally). For each layer i, with weights[6*i ..] =
// (attn_norm [D], qkv [(H + 2*Hkv) * hd, D], o [D, H*hd], mlp_norm [D],
// gate_up [2*I, D], down [D, I]):
//   h = rms_norm(x, previous MLP output); attention = decode_step_attention(qkv h, cos, sin, pool[i], ...);
//   h = rms_norm(x, o attention); MLP output = down(silu(gate h) * up h)
// and finally x += the last MLP output. x: [B, D] (updated in place and returned); pool:
// [layers, 2, pages, tokens_per_page, Hkv, hd]; cos, sin: [B, hd]; slots [B], tables [B, P], ctx [B]
// as for decode_step_attention; `heads` = H. Products packed as gemv takes them, no biases. `lora`: each
// product's output then gains each group's update at its rows (x @ a_t @ b_t), as LoraRows.add. after_layer:
// None, or a Python callable called with i once layer i's K/V are in the pool, with the GIL (which the pass
// releases otherwise); an exception it raises ends the pass and propagates. Call it holding the GIL.
torch::Tensor decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights, const torch::Tensor& pool,
                            const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
                            const torch::Tensor& tables, const torch::Tensor& ctx, int64_t heads, double eps,
                            const LoraGroups& lora, const pybind11::object& after_layer);
