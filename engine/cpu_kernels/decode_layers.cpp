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
#include "kernels.h"

torch::Tensor decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights, const torch::Tensor& pool,
                            const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
                            const torch::Tensor& tables, const torch::Tensor& ctx, int64_t heads, double eps,
                            const pybind11::object& after_layer) {
  constexpr size_t kPerLayer = 6;  // attn_norm, qkv, o, mlp_norm, gate_up, down
  const int64_t layers = pool.size(0), hd = pool.size(5);
  const int64_t B = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weights.size() == kPerLayer * layers,
              "decode_layers: x [B, D] contiguous and six weights per pool layer");
  c10::optional<torch::Tensor> delta;  // the previous layer's MLP output, added to x by the next norm
  pybind11::gil_scoped_release no_gil;
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* w = weights.data() + i * kPerLayer;
    torch::Tensor h = rms_norm(x, delta, w[0], eps);                            // [B, D]
    torch::Tensor qkv = gemv(h, w[1]).view({B, -1, hd});                        // [B, H + 2*Hkv, hd]
    torch::Tensor out = decode_step_attention(qkv, cos, sin, pool[i], slots, tables, ctx);  // [B, H*hd]
    TORCH_CHECK(out.size(1) == heads * hd, "decode_layers: qkv's head count does not match `heads`");
    if (!after_layer.is_none()) {
      pybind11::gil_scoped_acquire gil;
      after_layer(i);
    }
    h = rms_norm(x, gemv(out, w[2]), w[3], eps);                                // x += o(out); [B, D]
    std::vector<torch::Tensor> gate_up = gemv(h, w[4]).chunk(2, -1);            // [B, I] each, strided views
    delta = gemv(at::silu(gate_up[0]).mul_(gate_up[1]), w[5]);  // silu's own output is contiguous: [B, D]
  }
  if (delta) x += *delta;
  return x;
}
