// Batch-1 decode matrix-vector products on AVX-512 CPUs: y[o] = sum_i W[o, i] * x[i].
//
// A decode step of one sequence reads every weight once and does two flops per weight read, so its
// speed is the memory bandwidth the product reaches. These loops stream W in its plain row-major
// layout, four rows at a time against one register of x, and reach about the bandwidth of a plain
// reduction over the same bytes (oneDNN's inner product reaches ~0.65-0.8 of it at one row).
// Called through engine/cpu_kernels/gemv.py, which checks the CPU flags and the shapes first.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "kernels.h"

namespace {

constexpr int64_t kRows = 4;     // W rows per register block (four independent accumulators)
constexpr int64_t kGrain = 16;   // blocks per parallel chunk: 64 rows, a few KiB to a few tens of KiB
// Software prefetch distance in bytes ahead of each of the block's rows. A bf16 row of these models is
// ~1-3 KiB, too short for the hardware's streamer to ramp up: with this prefetch a sequence of the
// model's products read ~0.9 of a plain reduction's bandwidth instead of ~0.75 (fp32 rows, twice as
// long, gained a few percent). Prefetches past the end of W are harmless: they never fault.
constexpr int64_t kAhead = 8192;

// Each loop iteration reads one 64-byte line of each of the block's four rows; ask for the lines
// kAhead bytes further on. `w`: the block's first row at the iteration's column; `row_bytes`: from one
// row to the next.
inline void prefetch_block(const void* w, int64_t row_bytes) {
  const char* p = static_cast<const char*>(w) + kAhead;
  _mm_prefetch(p, _MM_HINT_T0);
  _mm_prefetch(p + row_bytes, _MM_HINT_T0);
  _mm_prefetch(p + 2 * row_bytes, _MM_HINT_T0);
  _mm_prefetch(p + 3 * row_bytes, _MM_HINT_T0);
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
      prefetch_block(w + i, in * 4);
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
      prefetch_block(w + i, in * 2);
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

}  // namespace

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& W) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && W.dim() == 2 && x.size(1) == W.size(1) && x.is_contiguous() &&
                  W.is_contiguous() && x.scalar_type() == W.scalar_type(),
              "gemv: x [1, in] and W [out, in], contiguous, of one dtype");
  const int64_t out = W.size(0), in = W.size(1);
  auto y = torch::empty({1, out}, x.options());
  if (W.scalar_type() == at::kFloat) {
    const float *w = W.data_ptr<float>(), *xv = x.data_ptr<float>();
    float* yv = y.data_ptr<float>();
    at::parallel_for(0, out / kRows, kGrain, [&](int64_t b0, int64_t b1) { rows_f32(w, xv, yv, in, b0, b1); });
  } else {
    const at::BFloat16 *w = W.data_ptr<at::BFloat16>(), *xv = x.data_ptr<at::BFloat16>();
    at::BFloat16* yv = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, out / kRows, kGrain, [&](int64_t b0, int64_t b1) { rows_bf16(w, xv, yv, in, b0, b1); });
  }
  return y;
}

