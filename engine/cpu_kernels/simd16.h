// Sixteen fp32 lanes, the one vector the kernels compute with (gemv.cpp, attend_rows.h), for the
// instruction set this build targets: one 512-bit register with AVX-512 (the default build), two 256-bit
// ones with AVX2 and FMA (the build compiled with TANDEM_AVX2, engine/cpu_kernels/build.py). Each build
// is its own module; the loader picks the one the CPU runs (build.py: isa).
//
// Every operation does the same fp32 arithmetic, lane by lane and in the same order, in both builds
// (multiply-adds fused in both, sums of lanes as one fixed tree), so a kernel's result is the same bits
// on either CPU. Only bf16 products differ at the edges: AVX512_BF16's dot product treats subnormal
// inputs and outputs as zero, the AVX2 build's multiply-adds keep them.
//
// SIMD: the target attribute of every function that computes with V16 (the rest of a module is built for
// any x86-64, so loading it never executes an instruction the CPU lacks; the loader checks the flags).
// SIMD_BF16: the same for functions that multiply bf16 pairs (gemv.cpp: block_bf16).
#pragma once
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace {

#ifdef TANDEM_AVX2

#define SIMD __attribute__((target("avx2,fma")))
#define SIMD_BF16 __attribute__((target("avx2,fma")))
#define SIMD_INLINE __attribute__((target("avx2,fma"), always_inline)) inline
#define SIMD_BF16_INLINE SIMD_INLINE

struct V16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

// Register blocking of the products (gemv.cpp): 16 ymm registers hold 3 x 2 sums of two halves and W.
constexpr int kGemvRows = 3, kGemvPanels = 2;
// bf16: 5 x 1 sums of two halves, W's line widened in registers half a line at a time (fp32's lines are
// multiply-add operands from memory) and x's broadcast. Measured on the default model's products, 2-core
// AMD EPYC (scripts/bench_products.py --dtype bfloat16, two runs alternating with 3 x 2 and whole lines
// widened, whose sums spilled): 64 rows 124-172 -> 84-86 ms, 256 rows 507-541 -> 372-384 ms, 1-32 rows
// within the machine's noise; 2 x 2 was as fast up to 32 rows, 20% slower at 64 and 256. Products of 1-2
// rows are bound by memory, not registers: 4 panels per block keep more streams in flight (1 row,
// alternating: 8.4-11.5 ms with 4, 13.4-13.8 with 1).
constexpr int kGemvRowsBf16 = 5, kGemvPanelsBf16 = 1, kGemvFewRowsBf16 = 2, kGemvFewRowsPanelsBf16 = 4;
// (row, head) pairs and value chunks weighed at once (attend_rows.h: weigh_values): 2 x 2 sums of two halves.
constexpr int kWeighPairs = 2, kWeighChunks = 2;

SIMD_INLINE V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
SIMD_INLINE V16 set16(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
SIMD_INLINE V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
SIMD_INLINE __m256 widen8(const at::BFloat16* p) {  // bf16 -> fp32 exactly: the 16 bits become the high half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
SIMD_INLINE V16 load16(const at::BFloat16* p) { return {widen8(p), widen8(p + 8)}; }
SIMD_INLINE void store16(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
SIMD_INLINE V16 sub16(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
SIMD_INLINE V16 mul16(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
SIMD_INLINE V16 fma16(V16 a, V16 b, V16 c) {  // a * b + c, rounded once
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

// The mask of lanes first .. first + 7 of sixteen: all ones where the lane is below n, zero bits elsewhere.
SIMD_INLINE __m256 live8(int64_t n, int first) {
  const __m256i lane = _mm256_setr_epi32(first, first + 1, first + 2, first + 3, first + 4, first + 5, first + 6,
                                         first + 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 16 ? n : 16)), lane));
}
// max(a, b) in lanes [0, n), a elsewhere.
SIMD_INLINE V16 max_live16(V16 a, V16 b, int64_t n) {
  return {_mm256_blendv_ps(a.lo, _mm256_max_ps(a.lo, b.lo), live8(n, 0)),
          _mm256_blendv_ps(a.hi, _mm256_max_ps(a.hi, b.hi), live8(n, 8))};
}
// a + b in lanes [0, n), a elsewhere.
SIMD_INLINE V16 add_live16(V16 a, V16 b, int64_t n) {
  return {_mm256_blendv_ps(a.lo, _mm256_add_ps(a.lo, b.lo), live8(n, 0)),
          _mm256_blendv_ps(a.hi, _mm256_add_ps(a.hi, b.hi), live8(n, 8))};
}

// The 8 lanes' sum as one tree: lane l + 4 onto l, then l + 2, then l + 1.
SIMD_INLINE float sum8(__m256 v) {
  const __m128 w = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  const __m128 x = _mm_add_ps(_mm_movehl_ps(w, w), w);
  return _mm_cvtss_f32(_mm_add_ss(_mm_movehdup_ps(x), x));
}
// Sum of the 16 lanes: lane l + 8 onto l, then l + 4, l + 2, l + 1 (the AVX-512 build's order).
SIMD_INLINE float reduce_add16(V16 v) { return sum8(_mm256_add_ps(v.hi, v.lo)); }
SIMD_INLINE float reduce_max16(V16 v) {
  const __m256 m = _mm256_max_ps(v.hi, v.lo);
  const __m128 w = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
  const __m128 x = _mm_max_ps(_mm_movehl_ps(w, w), w);
  return _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(x), x));
}

// 2^e for integers e in [-126, 127], exactly.
SIMD_INLINE __m256 pow2_8(__m256i e) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}

// e^x for x <= 0 in 8 lanes, as exp16 below: 2^n is applied as 2^(n/2) * 2^(n - n/2), two exact
// scalings of normal numbers and the last rounding once (AVX-512's scalef rounds the same exact product once).
SIMD_INLINE __m256 exp8(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-100.f)), _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 g = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));  // f ln 2
  static constexpr float c[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 1.f / 2, 1.f, 1.f};
  __m256 p = _mm256_set1_ps(c[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(c[i]));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);  // n in [-145, 0]
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(half)), pow2_8(_mm256_sub_epi32(ni, half)));
}
SIMD_INLINE V16 exp16(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }

// The sums of four 16-lane vectors, [4] in order, each as reduce_add16 sums it (the AVX-512 build's sum16
// tree): u = lo + hi, w_i = u_{i+4} + u_i, x0 = w0 + w2, x1 = w1 + w3, x0 + x1; two vectors per shuffle.
SIMD_INLINE __m128 sum4(const V16 (&a)[4]) {
  __m256 u[4];
  for (int k = 0; k < 4; ++k) u[k] = _mm256_add_ps(a[k].hi, a[k].lo);
  const __m256 p0 = _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x31), _mm256_permute2f128_ps(u[0], u[1], 0x20));
  const __m256 p1 = _mm256_add_ps(_mm256_permute2f128_ps(u[2], u[3], 0x31), _mm256_permute2f128_ps(u[2], u[3], 0x20));
  // p0: w of vectors 0 | 1, p1: of 2 | 3; q: (x0, x1) of vectors 0, 2 | 1, 3
  const __m256 q = _mm256_add_ps(_mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(3, 2, 3, 2)),
                                 _mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(1, 0, 1, 0)));
  const __m128 lo = _mm256_castps256_ps128(q), hi = _mm256_extractf128_ps(q, 1);
  const __m128 r =
      _mm_add_ps(_mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)), _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm_shuffle_ps(r, r, _MM_SHUFFLE(3, 1, 2, 0));  // vectors 0, 2, 1, 3 -> in order
}

// One query's scores against sixteen fp32 key rows: [16] = (q . k_i for each i), each dot product's lanes
// in order over hd's chunks, then summed as sum4 sums them. qs: the query, already scaled. Four keys at a
// time: sixteen keys' sums of two halves would need twice the 16 registers.
SIMD_INLINE V16 scores16(const float* const (&rows)[16], const float* qs, int64_t chunks) {
  alignas(32) float out[16];
  for (int g = 0; g < 16; g += 4) {
    V16 acc[4] = {zero16(), zero16(), zero16(), zero16()};
    for (int64_t j = 0; j < chunks; ++j) {
      const V16 qj = load16(qs + 16 * j);
      for (int i = 0; i < 4; ++i) acc[i] = fma16(load16(rows[g + i] + 16 * j), qj, acc[i]);
    }
    _mm_store_ps(out + g, sum4(acc));
  }
  return load16(out);
}

// bf16 products (gemv.cpp: block_bf16) take a panel line of pairs (16 lanes x (t = 0, 1), gemv.cpp's
// bf16 packing) in kPairSteps steps: here two, the t = 1 values widened to fp32 and multiplied-added
// into every sum of a block, then the t = 0 values (AVX512_BF16's order for each sum), so only one
// half of each line is held in registers at a time. x comes widened to fp32 (BF16X), once per product.
using BF16X = float;
constexpr int kPairSteps = 2;
using PairStep16 = V16;
// Step `step` of a line: its t = 1 values (step 0) or t = 0 values (step 1), as fp32.
SIMD_INLINE PairStep16 load_pair_step16(const at::BFloat16* line, int step) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line) + 1);
  if (step == 0) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    return {_mm256_castsi256_ps(_mm256_and_si256(lo, high)), _mm256_castsi256_ps(_mm256_and_si256(hi, high))};
  }
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
// acc + step `step`'s products with x's pair (x[i], x[i + 1]): x[i + 1] times the t = 1 values, then x[i]
// times the t = 0 values, each a multiply-add.
SIMD_INLINE V16 add_pair_step16(V16 acc, PairStep16 w, const float* xpair, int step) {
  return fma16(w, set16(xpair[1 - step]), acc);
}

// The 16 sums rounded to bf16, nearest even.
SIMD_INLINE void store_bf16x16(at::BFloat16* p, V16 v) {
  alignas(32) float f[16];
  store16(f, v);
  for (int l = 0; l < 16; ++l) p[l] = static_cast<at::BFloat16>(f[l]);
}

#else  // AVX-512

#define SIMD __attribute__((target("avx512f")))
#define SIMD_BF16 __attribute__((target("avx512f,avx512bf16")))
#define SIMD_INLINE __attribute__((target("avx512f"), always_inline)) inline
#define SIMD_BF16_INLINE __attribute__((target("avx512f,avx512bf16"), always_inline)) inline

struct V16 {
  __m512 v;
};

// Register blocking of the products (gemv.cpp): 6 x 4 sums, 4 lines of W, one broadcast of x.
constexpr int kGemvRows = 6, kGemvPanels = 4;
constexpr int kGemvRowsBf16 = kGemvRows, kGemvPanelsBf16 = kGemvPanels, kGemvFewRowsBf16 = 0,
              kGemvFewRowsPanelsBf16 = kGemvPanels;
// (row, head) pairs and value chunks weighed at once (attend_rows.h: weigh_values): 6 x 4 sums.
constexpr int kWeighPairs = 6, kWeighChunks = 4;

SIMD_INLINE V16 zero16() { return {_mm512_setzero_ps()}; }
SIMD_INLINE V16 set16(float v) { return {_mm512_set1_ps(v)}; }
SIMD_INLINE V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
SIMD_INLINE V16 load16(const at::BFloat16* p) {  // bf16 -> fp32 exactly: the 16 bits become the high half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
SIMD_INLINE void store16(float* p, V16 v) { _mm512_storeu_ps(p, v.v); }
SIMD_INLINE V16 sub16(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
SIMD_INLINE V16 mul16(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
SIMD_INLINE V16 fma16(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }

SIMD_INLINE __mmask16 live16(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
SIMD_INLINE V16 max_live16(V16 a, V16 b, int64_t n) { return {_mm512_mask_max_ps(a.v, live16(n), a.v, b.v)}; }
SIMD_INLINE V16 add_live16(V16 a, V16 b, int64_t n) { return {_mm512_mask_add_ps(a.v, live16(n), a.v, b.v)}; }
SIMD_INLINE float reduce_add16(V16 v) { return _mm512_reduce_add_ps(v.v); }  // l + 8 onto l, + 4, + 2, + 1
SIMD_INLINE float reduce_max16(V16 v) { return _mm512_reduce_max_ps(v.v); }

// e^x for x <= 0 in 16 lanes: 2^(x log2 e) split as 2^n * 2^f with |f| <= 1/2, 2^f by its Taylor series
// to degree 7 (relative error < 1e-8, below fp32's), 2^n applied exactly by scalef (underflows to 0).
SIMD_INLINE V16 exp16(V16 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x.v, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 g = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));  // f ln 2
  static constexpr float c[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 1.f / 2, 1.f, 1.f};
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(c[i]));
  return {_mm512_scalef_ps(p, n)};
}

// The sums of sixteen 16-lane vectors at once: [16] in order. Each a[i]'s lanes are added as one fixed
// tree (lane l + 8 onto l, then l + 4, then l + 2, then l + 1: the order of GCC's _mm512_reduce_add_ps),
// with two vectors combined per shuffle, so sixteen sums take 31 shuffles and 15 adds where one
// horizontal sum each took ~8 instructions.
SIMD_INLINE V16 sum16(const V16 (&a)[16]) {
  __m512 p[8], q[4], s[2];
  for (int m = 0; m < 8; ++m)  // p[m]: per 128-bit quarter, u of keys 2m (lanes 0-7) and 2m+1: u_i = a_{i+8} + a_i
    p[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m].v, a[2 * m + 1].v, _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(a[2 * m].v, a[2 * m + 1].v, _MM_SHUFFLE(1, 0, 1, 0)));
  for (int n = 0; n < 4; ++n)  // q[n]: quarter j holds w of key 4n + j: w_i = u_{i+4} + u_i
    q[n] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * n], p[2 * n + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(p[2 * n], p[2 * n + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  // s[m]: quarter j holds (x0, x1) of keys 8m + j and 8m + 4 + j: x0 = w0 + w2, x1 = w1 + w3
  for (int m = 0; m < 2; ++m)
    s[m] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * m], q[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(q[2 * m], q[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // x0 + x1: lane 4j + i holds key 4i + j; put the keys in order
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r)};
}

// One query's scores against sixteen fp32 key rows: [16] = (q . k_i for each i), each dot product's lanes
// in order over hd's chunks, then sum16. qs: the query, already scaled.
SIMD_INLINE V16 scores16(const float* const (&rows)[16], const float* qs, int64_t chunks) {
  V16 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = zero16();
  for (int64_t j = 0; j < chunks; ++j) {
    const V16 qj = load16(qs + 16 * j);
    for (int i = 0; i < 16; ++i) acc[i] = fma16(load16(rows[i] + 16 * j), qj, acc[i]);
  }
  return sum16(acc);
}

// bf16 products (gemv.cpp: block_bf16) take a panel line of pairs (16 lanes x (t = 0, 1), gemv.cpp's
// bf16 packing) in one step: one vdpbf16ps per sum, against x's pair as bf16 (BF16X).
using BF16X = at::BFloat16;
constexpr int kPairSteps = 1;
struct PairStep16 {
  __m512bh v;
};
SIMD_BF16_INLINE PairStep16 load_pair_step16(const at::BFloat16* line, int) {
  return {(__m512bh)_mm512_loadu_si512(line)};
}
// acc + the line's products with x's pair (x[i], x[i + 1]) broadcast as one 32-bit value: one vdpbf16ps
// (t = 1's product added first, then t = 0's).
SIMD_BF16_INLINE V16 add_pair_step16(V16 acc, PairStep16 w, const at::BFloat16* xpair, int) {
  int32_t pair;
  std::memcpy(&pair, xpair, sizeof(pair));
  return {_mm512_dpbf16_ps(acc.v, w.v, (__m512bh)_mm512_set1_epi32(pair))};
}

// The 16 sums rounded to bf16, nearest even.
SIMD_BF16_INLINE void store_bf16x16(at::BFloat16* p, V16 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v.v));
}

#endif

}  // namespace
