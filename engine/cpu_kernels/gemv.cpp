// Decode-sized matrix products on AVX-512 CPUs: y[m, o] = sum_i W[o, i] * x[m, i] for 1 to 16 rows of x.
//
// A decode step of one sequence reads every weight once and does two flops per weight read, so its
// speed is the memory bandwidth the product reaches; a few rows (a small decode batch, a short prompt)
// are still bound by it. These loops stream W once in its plain row-major layout against every row of
// x, and reach about the bandwidth of a plain reduction over the same bytes (oneDNN's inner product
// reaches ~0.65-0.8 of it at one row, and takes about as long for 2-8 rows as for 16).
// Every row's sum runs in the same order whatever the row count (16-lane partial sums over `in`, then
// one horizontal add), so a row's result does not depend on the rows beside it.
// Called through engine/cpu_kernels/gemv.py, which checks the CPU flags and the shapes first.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>

#include "kernels.h"

namespace {

constexpr int64_t kRows = 4;     // W rows per register block of one x row (four independent accumulators)
constexpr int64_t kMaxRows = 16; // x rows a call takes (engine/cpu_kernels/gemv.py: MAX_ROWS)
constexpr int64_t kGrain = 16;   // blocks per parallel chunk: 64 rows, a few KiB to a few tens of KiB
// Software prefetch distance in bytes ahead of each of the block's rows. A bf16 row of these models is
// ~1-3 KiB, too short for the hardware's streamer to ramp up: with this prefetch a sequence of the
// model's products read ~0.9 of a plain reduction's bandwidth instead of ~0.75 (fp32 rows, twice as
// long, gained a few percent). Prefetches past the end of W are harmless: they never fault.
constexpr int64_t kAhead = 8192;

// Each loop iteration reads one 64-byte line of each of a block's Rows rows; ask for the lines kAhead
// bytes further on. `w`: the block's first row at the iteration's column; `row_bytes`: from one row to
// the next.
template <int Rows>
inline void prefetch_rows(const void* w, int64_t row_bytes) {
  const char* p = static_cast<const char*>(w) + kAhead;
  for (int r = 0; r < Rows; ++r) _mm_prefetch(p + r * row_bytes, _MM_HINT_T0);
}

// The row loops carry their own target attribute and the rest of the file is built for any x86-64,
// so loading this module never executes an AVX-512 instruction on a CPU without it.

// fp32: blocks [b0, b1) of W [out, in], x [in], y [out]; in % 16 == 0.
__attribute__((target("avx512f"), noinline))
void rows_f32(const float* W, const float* x, float* y, int64_t in, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* w = W + b * kRows * in;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
      prefetch_rows<kRows>(w + i, in * 4);
      const __m512 xv = _mm512_loadu_ps(x + i);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), xv, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + in + i), xv, a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 2 * in + i), xv, a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 3 * in + i), xv, a3);
    }
    float* yb = y + b * kRows;
    yb[0] = _mm512_reduce_add_ps(a0);
    yb[1] = _mm512_reduce_add_ps(a1);
    yb[2] = _mm512_reduce_add_ps(a2);
    yb[3] = _mm512_reduce_add_ps(a3);
  }
}

// bf16: blocks [b0, b1) of W [out, in], x [in], y [out] (fp32 sums, rounded to nearest even once at
// the end, as oneDNN's bf16 inner product does); in % 32 == 0. Needs AVX512_BF16.
__attribute__((target("avx512f,avx512bf16"), noinline))
void rows_bf16(const at::BFloat16* W, const at::BFloat16* x, at::BFloat16* y, int64_t in, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const at::BFloat16* w = W + b * kRows * in;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 32) {  // 32 bf16 = one 512-bit register; dpbf16 adds pairs into 16 fp32 lanes
      prefetch_rows<kRows>(w + i, in * 2);
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), xv);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + in + i), xv);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + 2 * in + i), xv);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + 3 * in + i), xv);
    }
    at::BFloat16* yb = y + b * kRows;
    yb[0] = at::BFloat16(_mm512_reduce_add_ps(a0));
    yb[1] = at::BFloat16(_mm512_reduce_add_ps(a1));
    yb[2] = at::BFloat16(_mm512_reduce_add_ps(a2));
    yb[3] = at::BFloat16(_mm512_reduce_add_ps(a3));
  }
}

// Several rows of x: blocks of two W rows, each against MB <= 8 rows of x (2*MB accumulators).
// W rows [2*b0, 2*b1) of W [out, in]; x [MB, in] and y [MB, out] rows `in` and `out` apart.
template <int MB>
__attribute__((target("avx512f"), noinline))
void group_f32(const float* W, const float* x, float* y, int64_t in, int64_t out, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* w = W + 2 * b * in;
    __m512 a0[MB], a1[MB];
    for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
      prefetch_rows<2>(w + i, in * 4);
      const __m512 w0 = _mm512_loadu_ps(w + i), w1 = _mm512_loadu_ps(w + in + i);
      for (int m = 0; m < MB; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * in + i);
        a0[m] = _mm512_fmadd_ps(w0, xv, a0[m]);
        a1[m] = _mm512_fmadd_ps(w1, xv, a1[m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      y[m * out + 2 * b] = _mm512_reduce_add_ps(a0[m]);
      y[m * out + 2 * b + 1] = _mm512_reduce_add_ps(a1[m]);
    }
  }
}

template <int MB>
__attribute__((target("avx512f,avx512bf16"), noinline))
void group_bf16(const at::BFloat16* W, const at::BFloat16* x, at::BFloat16* y, int64_t in, int64_t out, int64_t b0,
                int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const at::BFloat16* w = W + 2 * b * in;
    __m512 a0[MB], a1[MB];
    for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 32) {
      prefetch_rows<2>(w + i, in * 2);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i), w1 = (__m512bh)_mm512_loadu_si512(w + in + i);
      for (int m = 0; m < MB; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * in + i);
        a0[m] = _mm512_dpbf16_ps(a0[m], w0, xv);
        a1[m] = _mm512_dpbf16_ps(a1[m], w1, xv);
      }
    }
    for (int m = 0; m < MB; ++m) {
      y[m * out + 2 * b] = at::BFloat16(_mm512_reduce_add_ps(a0[m]));
      y[m * out + 2 * b + 1] = at::BFloat16(_mm512_reduce_add_ps(a1[m]));
    }
  }
}

constexpr int kMaxGroup = 8;     // x rows per pass over a W block: 16 accumulators, 2 W registers, 1 of x

template <typename T>
using Group = void (*)(const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t);
constexpr Group<float> kGroupF32[kMaxGroup] = {group_f32<1>, group_f32<2>, group_f32<3>, group_f32<4>,
                                               group_f32<5>, group_f32<6>, group_f32<7>, group_f32<8>};
constexpr Group<at::BFloat16> kGroupBF16[kMaxGroup] = {group_bf16<1>, group_bf16<2>, group_bf16<3>, group_bf16<4>,
                                                       group_bf16<5>, group_bf16<6>, group_bf16<7>, group_bf16<8>};

// y [M, out] = x [M, in] @ W.T. One row: four-row blocks of W. More: blocks of two W rows against
// kMaxGroup rows of x at a time; past kMaxGroup rows, every group on one block before the next block,
// so the block is read from memory once and the weight stream never waits for a second pass.
template <typename T, typename Row>
void product(const torch::Tensor& x, const torch::Tensor& W, torch::Tensor& y, Row one_row,
             const Group<T> (&groups)[kMaxGroup]) {
  const int64_t M = x.size(0), out = W.size(0), in = W.size(1);
  const T *w = W.data_ptr<T>(), *xv = x.data_ptr<T>();
  T* yv = y.data_ptr<T>();
  if (M == 1) {
    at::parallel_for(0, out / kRows, kGrain, [&](int64_t b0, int64_t b1) { one_row(w, xv, yv, in, b0, b1); });
    return;
  }
  at::parallel_for(0, out / 2, kGrain, [&](int64_t b0, int64_t b1) {
    if (M <= kMaxGroup) return groups[M - 1](w, xv, yv, in, out, b0, b1);
    for (int64_t b = b0; b < b1; ++b) {  // every group on one block while it is in L1, the stream going on
      for (int64_t m0 = 0; m0 < M; m0 += kMaxGroup) {
        groups[std::min<int64_t>(kMaxGroup, M - m0) - 1](w, xv + m0 * in, yv + m0 * out, in, out, b, b + 1);
      }
    }
  });
}

}  // namespace

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& W) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows && W.dim() == 2 && x.size(1) == W.size(1) &&
                  x.is_contiguous() && W.is_contiguous() && x.scalar_type() == W.scalar_type(),
              "gemv: x [M, in] with 1 <= M <= 16 and W [out, in], contiguous, of one dtype");
  auto y = torch::empty({x.size(0), W.size(0)}, x.options());
  if (W.scalar_type() == at::kFloat) {
    product<float>(x, W, y, rows_f32, kGroupF32);
  } else {
    product<at::BFloat16>(x, W, y, rows_bf16, kGroupBF16);
  }
  return y;
}
