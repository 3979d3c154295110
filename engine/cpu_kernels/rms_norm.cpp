// RMSNorm of a few rows, optionally after the residual add, in one call: the decode step's norms as
// PyTorch ops are eight dispatches each (cast, square, mean, add, rsqrt, two products, cast back) on
// rows of a few hundred values, so dispatch, not arithmetic, is their cost.
//
// The rounding follows the reference's op order (Hugging Face's Llama): the residual add rounds to the
// model's dtype, statistics in fp32, the normalized row rounded to the model's dtype, then the weight
// product rounded again. Only the order of the fp32 sum of squares differs.
#include <ATen/Parallel.h>

#include <cmath>

#include "kernels.h"

namespace {

constexpr int64_t kRowsPerTask = 8;  // fewer rows stay on the calling thread (a thread's wake-up costs more)

template <typename T>
void norm_rows(T* x, const T* delta, const T* w, T* out, int64_t r0, int64_t r1, int64_t D, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    T* xr = x + r * D;
    if (delta != nullptr) {
      for (int64_t j = 0; j < D; ++j) xr[j] = static_cast<T>(static_cast<float>(xr[j]) + static_cast<float>(delta[r * D + j]));
    }
    float ss = 0.f;
    for (int64_t j = 0; j < D; ++j) ss += static_cast<float>(xr[j]) * static_cast<float>(xr[j]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (int64_t j = 0; j < D; ++j) {
      const T normed = static_cast<T>(static_cast<float>(xr[j]) * inv);
      out[r * D + j] = static_cast<T>(static_cast<float>(w[j]) * static_cast<float>(normed));
    }
  }
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& delta, const torch::Tensor& w,
                       double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
                  w.scalar_type() == x.scalar_type(),
              "rms_norm: x [T, D] contiguous and weight [D] of its dtype");
  TORCH_CHECK(!delta || (delta->sizes() == x.sizes() && delta->is_contiguous() && delta->scalar_type() == x.scalar_type()),
              "rms_norm: delta shaped and typed as x, contiguous");
  auto out = torch::empty_like(x);
  const int64_t D = x.size(1);
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t r0, int64_t r1) {  // rows are independent
    if (x.scalar_type() == at::kFloat) {
      norm_rows<float>(x.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr, w.data_ptr<float>(),
                       out.data_ptr<float>(), r0, r1, D, static_cast<float>(eps));
    } else {
      norm_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), delta ? delta->data_ptr<at::BFloat16>() : nullptr,
                              w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), r0, r1, D,
                              static_cast<float>(eps));
    }
  });
  return out;
}
