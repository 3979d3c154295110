// RMSNorm of a few rows, optionally after the residual add, in one call: the decode step's norms as
// PyTorch ops are eight dispatches each (cast, square, mean, add, rsqrt, two products, cast back) on
// rows of a few hundred values, so dispatch, not arithmetic, is their cost.
//
// The rounding follows the reference's op order (Hugging Face's Llama): the residual add rounds to the
// model's dtype, statistics in fp32, the normalized row rounded to the model's dtype, then the weight
// product rounded again. Only the order of the fp32 sum of squares differs: sixteen running sums (value j
// into sum j % 16, which the compiler turns into vector adds), then added as a fixed tree. One running
// sum took a chain of D dependent adds per row: 9-10 us a 32-row norm of the default model, now 5-6.
#include <ATen/Parallel.h>

#include <cmath>

#include "kernels.h"

namespace {

constexpr int64_t kRowsPerTask = 8;  // fewer rows stay on the calling thread (a thread's wake-up costs more)

constexpr int kSums = 16;

// sum of x[j]^2 in fp32: x[j] into running sum j % kSums, then sums l + 8 onto l, l + 4, l + 2, l + 1.
template <typename T>
float sum_of_squares(const T* x, int64_t D) {
  float sums[kSums] = {};
  int64_t j = 0;
  for (; j + kSums <= D; j += kSums)
    for (int l = 0; l < kSums; ++l) sums[l] += static_cast<float>(x[j + l]) * static_cast<float>(x[j + l]);
  for (int l = 0; j + l < D; ++l) sums[l] += static_cast<float>(x[j + l]) * static_cast<float>(x[j + l]);
  for (int half = kSums / 2; half > 0; half /= 2)
    for (int l = 0; l < half; ++l) sums[l] += sums[l + half];
  return sums[0];
}

template <typename T>
void norm_rows(T* x, const T* delta, const T* w, T* out, int64_t r0, int64_t r1, int64_t D, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    T* xr = x + r * D;
    if (delta != nullptr) {
      for (int64_t j = 0; j < D; ++j) xr[j] = static_cast<T>(static_cast<float>(xr[j]) + static_cast<float>(delta[r * D + j]));
    }
    const float inv = 1.f / std::sqrt(sum_of_squares(xr, D) / static_cast<float>(D) + eps);
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
