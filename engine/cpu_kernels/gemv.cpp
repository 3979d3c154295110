// Matrix products of a few rows on AVX-512 or AVX2 CPUs (simd16.h): y[m, o] = sum_i W[o, i] * x[m, i],
// against a weight packed once at load into panels of 16 output rows (engine/cpu_kernels/gemv.py: pack):
//   fp32: P [out/16, in, 16]         P[p, i, l]    = W[16p + l, i]
//   bf16: P [out/16, in/2, 16, 2]    P[p, j, l, t] = W[16p + l, 2j + t]   (the pairs AVX512_BF16 adds)
// Each step of `in` loads one 64-byte line per panel and adds it, times one value of x broadcast, into
// 16 output lanes, so no sum ever needs a horizontal add and each panel is one sequential stream. A
// block of up to Blocking::panels panels meets up to Blocking::rows rows of x at a time: with AVX-512 4
// panels (64 outputs) and 6 rows, 24 accumulators, 4 loads of W and 6 broadcasts per 24 multiply-adds;
// with AVX2's 16 half-width registers, fp32 2 panels and 3 rows (12 registers of sums), bf16 1 panel and
// 5 rows (simd16.h: its lines are widened in registers, half a line at a time; 1-2 rows take 4 panels).
// One row (a decode step of one sequence) reads the weight at about a plain read's bandwidth; 16 to 128
// rows in fp32 run near the CPU's multiply-add peak.
// From 7 to 48 rows (a decode batch, a short prompt) the block is taken in chunks of 64 lines per panel
// (16 KB, kept in L1 while every group of rows meets it), and the passes after a chunk's first prefetch
// the next chunk into L2, so the weight's arrival from memory overlaps the multiply-adds instead of
// taking turns with them. Whole, the first group's pass read the block from memory at the memory's pace
// and the others computed from L2: measured on the default model's products (30 layers, 2 cores),
// 32 rows 28-33 -> 25-28 ms, 16 rows 20-21 -> 18 ms; 1 and 512 rows unchanged (they take blocks whole;
// past 48 rows the chunks' sums and x's rows outgrow L1 and chunking lost 4-20%).
// Every output's sum runs over `in` in order, one lane of one accumulator (kept in fp32 between
// chunks), whatever the row count, so a row's result is the same bits whatever rows are beside it.
// The measurements above are AVX-512's (Intel, 2 cores). Called through engine/cpu_kernels/gemv.py, which
// checks the CPU flags and the shapes first.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "simd16.h"

namespace {

constexpr int kLanes = 16;  // outputs per panel: one V16 of fp32 sums (simd16.h)
// Rows of x per pass over a block and panels per block, for weights of type T (simd16.h), and the panels
// per block of a product of up to `few_rows` rows (one pass, few sums: more panel streams at once).
template <typename T>
struct Blocking {
  static constexpr int rows = kGemvRows, panels = kGemvPanels, few_rows = 0, few_rows_panels = kGemvPanels;
  using X = float;  // x as the block reads it
};
template <>
struct Blocking<at::BFloat16> {
  static constexpr int rows = kGemvRowsBf16, panels = kGemvPanelsBf16;
  static constexpr int few_rows = kGemvFewRowsBf16, few_rows_panels = kGemvFewRowsPanelsBf16;
  using X = BF16X;
};
template <typename T>
constexpr int kTablePanels = std::max(Blocking<T>::panels, Blocking<T>::few_rows_panels);
constexpr int64_t kLineBytes = 64;      // one step of a panel's stream, either dtype
constexpr int64_t kChunkLines = 64;     // steps per chunk: 4 panels x 64 lines = 16 KB, with x's rows in L1
constexpr int64_t kMaxChunkedRows = 48;  // past this the chunks' partial sums and x's rows outgrow L1
// Software prefetch distance within each panel's stream: measured best of 0-4096 on the default
// model's products (fp32 and bf16, 1-16 rows); the hardware streamer alone lags by ~10-25%.
constexpr int64_t kAhead = 512;

// One pass of up to Blocking::rows rows over steps [i0, i1) of `in` of a block, taken in chunks. The sums
// start at zero on the first chunk and from `part` after it, and go to `part` (fp32, row stride
// Blocking::panels * kLanes) until the last chunk, which writes y. From `next` to `next_end` (one panel
// stream's lines of the next chunk), one line per step goes to L2, in `next_count` streams
// `next_stride` bytes apart. A block taken whole (the kernels' `Chunked` false) reads none of this.
struct Pass {
  int64_t i0, i1;
  float* part;
  bool first, last;
  const char *next, *next_end;
  int64_t next_stride, next_count;
};

template <typename T, bool Chunked, int MR, int NB>
SIMD_INLINE void start(V16 (&acc)[MR][NB], const Pass& s) {
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n)
      acc[m][n] = !Chunked || s.first ? zero16() : load16(s.part + (m * Blocking<T>::panels + n) * kLanes);
}

// One step's line of the next chunk in each stream this pass carries; `at` walks from s.next.
__attribute__((always_inline)) inline void prefetch_next(const Pass& s, const char*& at) {
  if (at == s.next_end) return;
  for (int64_t j = 0; j < s.next_count; ++j) _mm_prefetch(at + j * s.next_stride, _MM_HINT_T1);
  at += kLineBytes;
}

// Partial sums of a chunk that is not the last, kept for the next.
template <typename T, int MR, int NB>
SIMD_INLINE void keep(const V16 (&acc)[MR][NB], const Pass& s) {
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n) store16(s.part + (m * Blocking<T>::panels + n) * kLanes, acc[m][n]);
}

// fp32: outputs [16*p0, 16*(p0 + NB)) of MR rows; P as above, x [MR, in] and y [MR, out] row-major.
template <bool Chunked, int MR, int NB>
SIMD __attribute__((noinline))
void block_f32(const float* P, const float* x, float* y, int64_t in, int64_t out, int64_t p0, const Pass& s) {
  V16 acc[MR][NB];
  start<float, Chunked>(acc, s);
  const float* w = P + p0 * in * kLanes;  // panel p0 + n starts n * in * kLanes further
  const char* ahead = s.next;
  for (int64_t i = Chunked ? s.i0 : 0, end = Chunked ? s.i1 : in; i < end; ++i) {
    if (Chunked) prefetch_next(s, ahead);
    V16 wv[NB];
    for (int n = 0; n < NB; ++n) {
      const float* line = w + (n * in + i) * kLanes;
      _mm_prefetch(reinterpret_cast<const char*>(line) + kAhead, _MM_HINT_T0);
      wv[n] = load16(line);
    }
    for (int m = 0; m < MR; ++m) {
      const V16 xb = set16(x[m * in + i]);
      for (int n = 0; n < NB; ++n) acc[m][n] = fma16(wv[n], xb, acc[m][n]);
    }
  }
  if (Chunked && !s.last) return keep<float>(acc, s);
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n) store16(y + m * out + (p0 + n) * kLanes, acc[m][n]);
}

// Step `Step` of the lines of NB panels at `in` step i (simd16.h: add_pair_step16) into MR rows' sums.
// One function per step, not a loop over steps: with the loop GCC stored every sum to the stack each step.
template <int Step, int MR, int NB>
SIMD_BF16_INLINE void add_line(V16 (&acc)[MR][NB], const at::BFloat16* w, const BF16X* x, int64_t in, int64_t i) {
  PairStep16 wv[NB];
  for (int n = 0; n < NB; ++n) wv[n] = load_pair_step16(w + (n * in + i) * kLanes, Step);
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = add_pair_step16(acc[m][n], wv[n], x + m * in + i, Step);
}

// bf16: as block_f32, two values of `in` per line, taken in kPairSteps steps (simd16.h: add_pair_step16;
// each fp32 lane gains both products, t = 1's first); x as simd16.h's BF16X. The fp32 sums are rounded
// to nearest even once at the end, as oneDNN's bf16 inner product does.
template <bool Chunked, int MR, int NB>
SIMD_BF16 __attribute__((noinline))
void block_bf16(const at::BFloat16* P, const BF16X* x, at::BFloat16* y, int64_t in, int64_t out, int64_t p0,
                const Pass& s) {
  V16 acc[MR][NB];
  start<at::BFloat16, Chunked>(acc, s);
  const at::BFloat16* w = P + p0 * in * kLanes;
  const char* ahead = s.next;
  for (int64_t i = Chunked ? s.i0 : 0, end = Chunked ? s.i1 : in; i < end; i += 2) {
    if (Chunked) prefetch_next(s, ahead);
    for (int n = 0; n < NB; ++n)
      _mm_prefetch(reinterpret_cast<const char*>(w + (n * in + i) * kLanes) + kAhead, _MM_HINT_T0);
    add_line<0>(acc, w, x, in, i);
    if constexpr (kPairSteps > 1) add_line<1>(acc, w, x, in, i);
  }
  if (Chunked && !s.last) return keep<at::BFloat16>(acc, s);
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n) store_bf16x16(y + m * out + (p0 + n) * kLanes, acc[m][n]);
}

template <typename T>
using Block = void (*)(const T*, const typename Blocking<T>::X*, T*, int64_t, int64_t, int64_t, const Pass&);
template <typename T>  // [chunked][rows-1][panels-1]
using Blocks = std::array<std::array<std::array<Block<T>, kTablePanels<T>>, Blocking<T>::rows>, 2>;

template <typename T, bool C, int MR, int NB>
constexpr Block<T> block_of() {
  if constexpr (std::is_same_v<T, float>) {
    return block_f32<C, MR, NB>;
  } else {
    return block_bf16<C, MR, NB>;
  }
}
template <typename T, bool C, int MR, size_t... N>
constexpr std::array<Block<T>, kTablePanels<T>> panels_of(std::index_sequence<N...>) {
  return {block_of<T, C, MR, static_cast<int>(N) + 1>()...};
}
template <typename T, bool C, size_t... M>
constexpr std::array<std::array<Block<T>, kTablePanels<T>>, Blocking<T>::rows> rows_of(std::index_sequence<M...>) {
  return {panels_of<T, C, static_cast<int>(M) + 1>(std::make_index_sequence<kTablePanels<T>>())...};
}
template <typename T>
constexpr Blocks<T> kBlocks = {rows_of<T, false>(std::make_index_sequence<Blocking<T>::rows>()),
                               rows_of<T, true>(std::make_index_sequence<Blocking<T>::rows>())};

// y [M, out] = x [M, in] @ W.T. The panels are split evenly between threads; each thread walks its own
// in blocks of up to Blocking::panels (few_rows_panels for a product of up to few_rows rows), and every
// group of Blocking::rows rows of x meets a block (then in cache) before the next block is read: whole, or
// chunk by chunk from 7 to kMaxChunkedRows rows, each chunk's passes after the first prefetching the next
// chunk (the rest of this block, or the next block's start).
// xv: x [M, in] as Blocking<T>::X.
template <typename T>
void product(const typename Blocking<T>::X* xv, int64_t M, int64_t in, const torch::Tensor& P, torch::Tensor& y,
             const Blocks<T>& blocks) {
  constexpr int kMaxRows = Blocking<T>::rows;
  const int64_t block_panels = M <= Blocking<T>::few_rows ? Blocking<T>::few_rows_panels  // never chunked
                                                         : Blocking<T>::panels;
  const int64_t out = y.size(1), panels = out / kLanes;
  const T* w = P.data_ptr<T>();
  T* yv = y.data_ptr<T>();
  const int64_t per_step = kLineBytes / (kLanes * sizeof(T));  // values of `in` per line: fp32 1, bf16 2
  const int64_t later = (M - 1) / kMaxRows;                     // passes after a chunk's first
  const bool chunked = later > 0 && M <= kMaxChunkedRows;
  const int64_t chunk = chunked ? kChunkLines * per_step : in;
  const int64_t panel_bytes = in * kLanes * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, panels, block_panels, [&](int64_t q0, int64_t q1) {
    alignas(64) float part[kMaxChunkedRows * Blocking<T>::panels * kLanes];  // [M, 16 * panels] sums between chunks
    for (int64_t p = q0; p < q1; p += block_panels) {
      const int64_t nb = std::min<int64_t>(block_panels, q1 - p);
      for (int64_t i0 = 0; i0 < in; i0 += chunk) {
        const int64_t i1 = std::min(in, i0 + chunk);
        const bool rest = i1 < in;  // the next chunk is this block's; else the next block's first
        const int64_t np = rest ? p : p + block_panels, nnb = std::min<int64_t>(block_panels, q1 - np);
        const char* next_start = nnb <= 0 ? nullptr
            : reinterpret_cast<const char*>(w) + np * panel_bytes + (rest ? i1 / per_step : 0) * kLineBytes;
        const int64_t next_lines = std::min(chunk, rest ? in - i1 : in) / per_step;
        for (int64_t m0 = 0, h = 0; m0 < M; m0 += kMaxRows, ++h) {
          const int64_t mr = std::min<int64_t>(kMaxRows, M - m0);
          Pass s{i0, i1, part + m0 * Blocking<T>::panels * kLanes, i0 == 0, i1 == in, nullptr, nullptr, 0, 0};
          if (chunked && h >= 1 && h <= nnb) {  // pass h takes panels h-1, h-1+later, ... of the next chunk
            s.next = next_start + (h - 1) * panel_bytes;
            s.next_end = s.next + next_lines * kLineBytes;
            s.next_stride = later * panel_bytes;
            s.next_count = (nnb - h + later) / later;
          }
          blocks[chunked][mr - 1][nb - 1](w, xv + m0 * in, yv + m0 * out, in, out, p, s);
        }
      }
    }
  });
}

// n values of x widened to fp32 at `out`, exactly.
SIMD void widen(const at::BFloat16* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store16(out + i, load16(x + i));
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

// bf16 x [M, in] as block_bf16 reads it (simd16.h: BF16X): itself, or widened into `wide`.
template <typename X = BF16X>
const X* bf16_input(const torch::Tensor& x, std::vector<float>& wide) {
  if constexpr (std::is_same_v<X, float>) {
    const int64_t in = x.size(1);
    wide.resize(x.numel());
    const at::BFloat16* xv = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, x.size(0), std::max<int64_t>(1, 16384 / in), [&](int64_t m0, int64_t m1) {
      widen(xv + m0 * in, wide.data() + m0 * in, (m1 - m0) * in);
    });
    return wide.data();
  } else {
    return x.data_ptr<X>();
  }
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
    product<float>(x.data_ptr<float>(), x.size(0), in, P, y, kBlocks<float>);
  } else {
    std::vector<float> wide;
    product<at::BFloat16>(bf16_input(x, wide), x.size(0), in, P, y, kBlocks<at::BFloat16>);
  }
  return y;
}
