// Matrix products of a few rows on AVX-512 CPUs: y[m, o] = sum_i W[o, i] * x[m, i], against a weight
// packed once at load into panels of 16 output rows (engine/cpu_kernels/gemv.py: pack):
//   fp32: P [out/16, in, 16]         P[p, i, l]    = W[16p + l, i]
//   bf16: P [out/16, in/2, 16, 2]    P[p, j, l, t] = W[16p + l, 2j + t]   (the pairs AVX512_BF16 adds)
// Each step of `in` loads one 64-byte line per panel and adds it, times one value of x broadcast, into
// 16 output lanes, so no sum ever needs a horizontal add and each panel is one sequential stream. A
// block of up to 4 panels (64 outputs) meets up to 6 rows of x at a time: 24 accumulators, 4 loads of W
// and 6 broadcasts per 24 multiply-adds. One row (a decode step of one sequence) reads the weight at
// about a plain read's bandwidth; 16 to 128 rows in fp32 run near the CPU's multiply-add peak.
// Every output's sum runs over `in` in order, one lane of one accumulator, whatever the row count, so a
// row's result is the same bits whatever rows are beside it.
// Called through engine/cpu_kernels/gemv.py, which checks the CPU flags and the shapes first.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>

#include "kernels.h"

namespace {

constexpr int kLanes = 16;   // outputs per panel: one 512-bit register of fp32 sums
constexpr int kMaxPanels = 4;  // panels per block
constexpr int kMaxRows = 6;    // rows of x per pass over a block (4 x 6 accumulators + 4 of W + 1 of x)
// Software prefetch distance within each panel's stream: measured best of 0-4096 on the default
// model's products (fp32 and bf16, 1-16 rows); the hardware streamer alone lags by ~10-25%.
constexpr int64_t kAhead = 512;

// The row loops carry their own target attribute and the rest of the file is built for any x86-64,
// so loading this module never executes an AVX-512 instruction on a CPU without it.

// fp32: outputs [16*p0, 16*(p0 + NB)) of MR rows; P as above, x [MR, in] and y [MR, out] row-major.
template <int MR, int NB>
__attribute__((target("avx512f"), noinline))
void block_f32(const float* P, const float* x, float* y, int64_t in, int64_t out, int64_t p0) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  const float* w = P + p0 * in * kLanes;  // panel p0 + n starts n * in * kLanes further
  for (int64_t i = 0; i < in; ++i) {
    __m512 wv[NB];
    for (int n = 0; n < NB; ++n) {
      const float* line = w + (n * in + i) * kLanes;
      _mm_prefetch(reinterpret_cast<const char*>(line) + kAhead, _MM_HINT_T0);
      wv[n] = _mm512_loadu_ps(line);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * in + i]);
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xb, acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n) _mm512_storeu_ps(y + m * out + (p0 + n) * kLanes, acc[m][n]);
}

// bf16: as block_f32, two values of `in` per step (dpbf16 adds both products to each fp32 lane); the
// fp32 sums are rounded to nearest even once at the end, as oneDNN's bf16 inner product does.
template <int MR, int NB>
__attribute__((target("avx512f,avx512bf16"), noinline))
void block_bf16(const at::BFloat16* P, const at::BFloat16* x, at::BFloat16* y, int64_t in, int64_t out, int64_t p0) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  const at::BFloat16* w = P + p0 * in * kLanes;
  for (int64_t i = 0; i < in; i += 2) {
    __m512bh wv[NB];
    for (int n = 0; n < NB; ++n) {
      const at::BFloat16* line = w + (n * in + i) * kLanes;
      _mm_prefetch(reinterpret_cast<const char*>(line) + kAhead, _MM_HINT_T0);
      wv[n] = (__m512bh)_mm512_loadu_si512(line);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;  // x[m, i] and x[m, i + 1], broadcast as one 32-bit value
      std::memcpy(&pair, x + m * in + i, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], wv[n], xb);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * out + (p0 + n) * kLanes),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][n]));
}

template <typename T>
using Block = void (*)(const T*, const T*, T*, int64_t, int64_t, int64_t);
template <typename T>
using Blocks = Block<T>[kMaxRows][kMaxPanels];  // [rows - 1][panels - 1]

#define TANDEM_BLOCKS(f) \
  {{f<1, 1>, f<1, 2>, f<1, 3>, f<1, 4>}, {f<2, 1>, f<2, 2>, f<2, 3>, f<2, 4>}, \
   {f<3, 1>, f<3, 2>, f<3, 3>, f<3, 4>}, {f<4, 1>, f<4, 2>, f<4, 3>, f<4, 4>}, \
   {f<5, 1>, f<5, 2>, f<5, 3>, f<5, 4>}, {f<6, 1>, f<6, 2>, f<6, 3>, f<6, 4>}}
constexpr Blocks<float> kBlocksF32 = TANDEM_BLOCKS(block_f32);
constexpr Blocks<at::BFloat16> kBlocksBF16 = TANDEM_BLOCKS(block_bf16);
#undef TANDEM_BLOCKS

// y [M, out] = x [M, in] @ W.T. The panels are split evenly between threads; each thread walks its own
// in blocks of up to kMaxPanels, and every group of kMaxRows rows of x meets a block (then in cache)
// before the next block is read.
template <typename T>
void product(const torch::Tensor& x, const torch::Tensor& P, torch::Tensor& y, const Blocks<T>& blocks) {
  const int64_t M = x.size(0), in = x.size(1), out = y.size(1), panels = out / kLanes;
  const T *w = P.data_ptr<T>(), *xv = x.data_ptr<T>();
  T* yv = y.data_ptr<T>();
  at::parallel_for(0, panels, kMaxPanels, [&](int64_t q0, int64_t q1) {
    for (int64_t p = q0; p < q1; p += kMaxPanels) {
      const int64_t nb = std::min<int64_t>(kMaxPanels, q1 - p);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t mr = std::min<int64_t>(kMaxRows, M - m0);
        blocks[mr - 1][nb - 1](w, xv + m0 * in, yv + m0 * out, in, out, p);
      }
    }
  });
}

}  // namespace

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& P) {
  const bool f32 = P.scalar_type() == at::kFloat;
  const int64_t in = x.dim() == 2 ? x.size(1) : -1;
  const bool packed = f32 ? (P.dim() == 3 && P.size(1) == in && P.size(2) == kLanes)
                          : (P.dim() == 4 && P.size(1) * 2 == in && P.size(2) == kLanes && P.size(3) == 2);
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && packed && x.is_contiguous() && P.is_contiguous() &&
                  x.scalar_type() == P.scalar_type() && (f32 || P.scalar_type() == at::kBFloat16),
              "gemv: x [M, in] and a weight packed for it (fp32 [out/16, in, 16], bf16 [out/16, in/2, 16, 2]), "
              "contiguous, of one dtype");
  auto y = torch::empty({x.size(0), P.size(0) * kLanes}, x.options());
  if (f32) {
    product<float>(x, P, y, kBlocksF32);
  } else {
    product<at::BFloat16>(x, P, y, kBlocksBF16);
  }
  return y;
}
