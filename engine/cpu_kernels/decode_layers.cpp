// A pass of rows (decode rows, a prompt's rows, or both) through every decoder layer in one call, on CPU.
//
// The same kernels, in the same order, as engine/model.py's layer loop takes for a decode pass
// (residual + RMSNorm, few-row products, the rotary + K/V write + paged attention step, SiLU-gated
// MLP), so a decode pass is bit for bit that loop's up to the loop's own few-row limits. What it removes
// is the Python between them: about ten interpreted calls per layer, ~1 ms of a step that reads the
// weights in 4-8 ms. The GIL is released for the whole pass (a prompt of hundreds of rows takes a
// second; the worker's other Python threads, its server and a writer's copies, run meanwhile) and taken
// back only for `after_layer`: when not None, it is called with each layer's index once its K/V are in
// the pool (a writer takes them while the next layers compute; a Python exception it raises ends the
// pass and reaches the caller).
//
// LoRA rows (engine/lora.py) take their adapters' updates after each of the four products, with the ATen
// calls, in the order, engine/lora.py's LoraRows.add makes them: so a pass with adapter rows stays in
// one call, and its rows get the layer loop's bits as a pass without them does.
#include "kernels.h"

namespace {

// y [T, out] = the product `k` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer` for x [T, in], plus each
// group's update at its rows (group: rows, then a_t, b_t per layer and product; rows: none for all of
// them, a 0/1 mask [T, 1] in y's dtype, or int64 indices [n]), in place.
torch::Tensor lora_add(const LoraGroups& lora, int64_t layer, int64_t k, const torch::Tensor& x, torch::Tensor y) {
  for (const auto& group : lora) {
    const auto& a = group[1 + 8 * layer + 2 * k];
    if (!a) continue;
    const auto& b = *group[2 + 8 * layer + 2 * k];
    const auto& rows = group[0];
    if (!rows) {
      y.addmm_(x.mm(*a), b);  // [T, n*r] -> [T, out]
    } else if (rows->scalar_type() == at::kLong) {
      y.index_add_(0, *rows, x.index_select(0, *rows).mm(*a).mm(b));  // [n, out] into its rows
    } else {
      y.addmm_(x.mm(*a).mul_(*rows), b);  // the other rows' [n*r] zeroed: they add exactly 0
    }
  }
  return y;
}

}  // namespace

torch::Tensor decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights, const torch::Tensor& pool,
                            const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
                            const torch::Tensor& tables, const torch::Tensor& ctx, int64_t heads, double eps,
                            const LoraGroups& lora, const pybind11::object& after_layer) {
  constexpr size_t kPerLayer = 6;  // attn_norm, qkv, o, mlp_norm, gate_up, down
  const int64_t layers = pool.size(0), hd = pool.size(5);
  const int64_t B = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weights.size() == kPerLayer * layers,
              "decode_layers: x [B, D] contiguous and six weights per pool layer");
  for (const auto& group : lora)
    TORCH_CHECK(group.size() == static_cast<size_t>(1 + 8 * layers), "decode_layers: a LoRA group is its rows and "
                "eight updates' tensors per pool layer");
  c10::optional<torch::Tensor> delta;  // the previous layer's MLP output, added to x by the next norm
  pybind11::gil_scoped_release no_gil;
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* w = weights.data() + i * kPerLayer;
    torch::Tensor h = rms_norm(x, delta, w[0], eps);                            // [B, D]
    torch::Tensor qkv = lora_add(lora, i, 0, h, gemv(h, w[1])).view({B, -1, hd});  // [B, H + 2*Hkv, hd]
    torch::Tensor out = decode_step_attention(qkv, cos, sin, pool[i], slots, tables, ctx);  // [B, H*hd]
    TORCH_CHECK(out.size(1) == heads * hd, "decode_layers: qkv's head count does not match `heads`");
    if (!after_layer.is_none()) {
      pybind11::gil_scoped_acquire gil;
      after_layer(i);
    }
    h = rms_norm(x, lora_add(lora, i, 1, out, gemv(out, w[2])), w[3], eps);    // x += o(out); [B, D]
    std::vector<torch::Tensor> gate_up = lora_add(lora, i, 2, h, gemv(h, w[4])).chunk(2, -1);  // [B, I] views
    torch::Tensor act = at::silu(gate_up[0]).mul_(gate_up[1]);  // silu's own output is contiguous: [B, I]
    delta = lora_add(lora, i, 3, act, gemv(act, w[5]));         // [B, D]
  }
  if (delta) x += *delta;
  return x;
}
