// The arithmetic of paged attention for a tile of query rows (decode_attention.cpp cuts a pass into tiles
// and work items, and holds the entry points): scores of sixteen keys at once, the softmax, the weighted
// sum of values. Included by decode_attention.cpp only; everything here has internal linkage.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kMaxHeadDim = 256;

__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

__attribute__((target("avx512f"))) inline __m512 load16(const at::BFloat16* p) {
  // bf16 -> fp32 exactly: the 16 bits become the high half of the float
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// e^x for x <= 0 in 16 lanes: 2^(x log2 e) split as 2^n * 2^f with |f| <= 1/2, 2^f by its Taylor series
// to degree 7 (relative error < 1e-8, below fp32's), 2^n applied exactly by scalef (underflows to 0).
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 g = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));  // f ln 2
  static constexpr float c[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 1.f / 2, 1.f, 1.f};
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// The sums of sixteen keys' dot products at once. a[i] holds key i's 16 partial sums (lane l: the products
// of dims l, l + 16, ...); returns [16] the keys' sums in key order. Each key's lanes are added as one fixed
// tree (lane l + 8 onto l, then l + 4, then l + 2, then l + 1: the order of GCC's _mm512_reduce_add_ps),
// with two keys' vectors combined per shuffle, so sixteen sums take 31 shuffles and 15 adds where one
// horizontal sum per key took ~8 instructions each.
__attribute__((target("avx512f"))) inline __m512 sum16(const __m512 (&a)[16]) {
  __m512 p[8], q[4], s[2];
  for (int m = 0; m < 8; ++m)  // p[m]: per 128-bit quarter, u of keys 2m (lanes 0-7) and 2m+1: u_i = a_{i+8} + a_i
    p[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int n = 0; n < 4; ++n)  // q[n]: quarter j holds w of key 4n + j: w_i = u_{i+4} + u_i
    q[n] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * n], p[2 * n + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(p[2 * n], p[2 * n + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int m = 0; m < 2; ++m)  // s[m]: quarter j holds (x0, x1) of keys 8m + j and 8m + 4 + j: x0 = w0 + w2, x1 = w1 + w3
    s[m] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * m], q[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(q[2 * m], q[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // x0 + x1: lane 4j + i holds key 4i + j; put the keys in order
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// Key rows t0 .. t0 + 15 of one kv head through the page table (one division per sixteen keys); rows
// past `n` repeat the first, so every pointer is valid (their scores are masked out by the caller).
template <typename T>
inline void key_rows(const T* base, const int64_t* table, int64_t t0, int64_t n, int64_t tpp, int64_t row_stride,
                     const T* (&rows)[16]) {
  int64_t page = t0 / tpp, at = t0 % tpp;
  for (int i = 0; i < 16; ++i) {
    rows[i] = i < n ? base + (table[page] * tpp + at) * row_stride : rows[0];
    if (++at == tpp) at = 0, ++page;
  }
}

// One query's scores against sixteen fp32 key rows: [16] = (q . k_i for each i), the dot product's lanes in
// order over hd's chunks, then sum16. qs: the query, already scaled, 64-byte aligned.
__attribute__((target("avx512f"), always_inline)) inline __m512 scores16(const float* const (&rows)[16],
                                                                        const float* qs, int64_t chunks) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < chunks; ++j) {
    const __m512 qj = _mm512_load_ps(qs + 16 * j);
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(load16(rows[i] + 16 * j), qj, acc[i]);
  }
  return sum16(acc);
}

constexpr int kMaxRows = 16;        // query rows of one sequence in one call of attend_rows (a tile)
constexpr int kMaxHeadsAtOnce = 4;  // query heads sharing one kv head in one call
constexpr int64_t kKeyBlock = 128;  // keys whose values stay in L1 while every (row, head) of a tile uses them

// acc[m][16c .. 16(c + 1)) += scores[m][t] * v_t[16c .. 16(c + 1)) for keys t in [t0, t1), in order,
// skipping t >= ctx[m], for M (row, head) pairs m and the C value chunks at `v` (acc: fp32, 64-byte
// aligned). Each value chunk is read once for the M pairs; the sums stay in registers across the block
// and in `acc` between blocks, so they are those of one pass over the keys in order whatever the blocks.
template <typename T, int M, int C>
__attribute__((target("avx512f"))) void weigh_values(const T* v, const int64_t* table, const int64_t* ctx, int64_t t0,
                                                     int64_t t1, int64_t tpp, int64_t row_stride, const float* const* scores,
                                                     float* const* acc) {
  __m512 a[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) a[m][c] = _mm512_load_ps(acc[m] + 16 * c);
  for (int64_t t = t0; t < t1;) {
    const int64_t first = t / tpp * tpp, end = std::min(t1, first + tpp);
    const T* page = v + table[t / tpp] * tpp * row_stride;
    for (; t < end; ++t) {
      __m512 vc[C];
      for (int c = 0; c < C; ++c) vc[c] = load16(page + (t - first) * row_stride + 16 * c);
      for (int m = 0; m < M; ++m) {
        if (t >= ctx[m]) continue;
        const __m512 w = _mm512_set1_ps(scores[m][t]);
        for (int c = 0; c < C; ++c) a[m][c] = _mm512_fmadd_ps(vc[c], w, a[m][c]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) _mm512_store_ps(acc[m] + 16 * c, a[m][c]);
}

template <typename T>
using WeighFn = void (*)(const T*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                         const float* const*, float* const*);

// weigh_values for 1-6 pairs (at most 24 accumulators: 6 pairs of 4 chunks)
template <typename T, int C>
WeighFn<T> weigh_fn(int64_t pairs) {
  static constexpr WeighFn<T> fns[] = {weigh_values<T, 1, C>, weigh_values<T, 2, C>, weigh_values<T, 3, C>,
                                       weigh_values<T, 4, C>, weigh_values<T, 5, C>, weigh_values<T, 6, C>};
  return fns[pairs - 1];
}

// R (<= kMaxRows) query rows that read the same page table (one row of a decode batch; consecutive rows
// of a prompt), row r over its own first ctx[r] keys, for the N (<= kMaxHeadsAtOnce) query heads
// [h, h + N) that share one kv head: out[r][g][hd] = softmax(q_rg . K^T * scale) . V. q and out rows
// are `q_stride` apart. Each key row is read once for all R rows and N heads, each value row once per
// six (row, head) pairs from L1 (values are taken kKeyBlock keys at a time), the page table once per
// page. A (row, head)'s arithmetic is the same whatever R and N: its scores (scores16), their maximum,
// the exponentials and their sum in blocks of 16 in order, the weighted sum over its keys in order; so
// a row's result does not depend on the rows or heads it was computed with, nor on the batch around it.
template <typename T, int N>
__attribute__((target("avx512f"), noinline)) void attend_rows(const T* q, int64_t q_stride, int64_t R, const T* k,
                                                    const T* v, const int64_t* table, const int64_t* ctx, int64_t tpp,
                                                    int64_t row_stride, int64_t hd, float scale,
                                                    std::vector<float>& scratch, T* out) {
  const int64_t chunks = hd / 16, pairs = R * N;
  int64_t longest = 0;
  for (int r = 0; r < R; ++r) longest = std::max(longest, ctx[r]);
  const int64_t width = (longest + 15) / 16 * 16;  // one (row, head)'s scores, padded to whole blocks of 16
  scratch.resize(pairs * width + (2 * pairs + 16) * hd + 16);
  float* scores = scratch.data();  // [pairs][width]; then, 64-byte aligned (scratch has room for that):
  float* qs = scores + pairs * width;  // [pairs][hd] the scaled queries,
  qs += (64 - reinterpret_cast<uintptr_t>(qs) % 64) % 64 / sizeof(float);
  float* sums = qs + pairs * hd;     // [pairs][hd] the weighted sums of values,
  float* wide = sums + pairs * hd;   // [16][hd] bf16 keys widened to fp32
  for (int64_t m = 0; m < pairs; ++m)
    for (int64_t j = 0; j < chunks; ++j)
      _mm512_store_ps(qs + m * hd + 16 * j,
                      _mm512_mul_ps(load16(q + m / N * q_stride + m % N * hd + 16 * j), _mm512_set1_ps(scale)));
  __m512 top[kMaxRows * kMaxHeadsAtOnce];
  for (int64_t m = 0; m < pairs; ++m) top[m] = _mm512_set1_ps(-INFINITY);
  for (int64_t t0 = 0; t0 < longest; t0 += 16) {
    const T* rows[16];
    key_rows(k, table, t0, std::min<int64_t>(16, longest - t0), tpp, row_stride, rows);
    const float* keys[16];  // the same rows in fp32: bf16 ones widened once here, not once per (row, head)
    for (int i = 0; i < 16; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        keys[i] = rows[i];
      } else {
        for (int64_t j = 0; j < chunks; ++j) _mm512_store_ps(wide + i * hd + 16 * j, load16(rows[i] + 16 * j));
        keys[i] = wide + i * hd;
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      if (t0 >= ctx[r]) continue;
      const __mmask16 live = ctx[r] - t0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (ctx[r] - t0)) - 1);
      for (int64_t g = 0; g < N; ++g) {
        const int64_t m = r * N + g;
        const __m512 sc = scores16(keys, qs + m * hd, chunks);
        _mm512_storeu_ps(scores + m * width + t0, sc);
        top[m] = _mm512_mask_max_ps(top[m], live, top[m], sc);
      }
    }
  }
  float inv[kMaxRows * kMaxHeadsAtOnce];
  int64_t pair_ctx[kMaxRows * kMaxHeadsAtOnce];
  for (int64_t m = 0; m < pairs; ++m) {  // exp in place; lanes past the row's context are masked out of the sum
    float* s = scores + m * width;
    const int64_t n = pair_ctx[m] = ctx[m / N];
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top[m]));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 live = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), most));
      _mm512_storeu_ps(s + t, e);
      total = _mm512_mask_add_ps(total, live, total, e);
    }
    inv[m] = 1.f / _mm512_reduce_add_ps(total);
  }
  std::fill(sums, sums + pairs * hd, 0.f);
  const float* score_rows[kMaxRows * kMaxHeadsAtOnce];
  float* sum_rows[kMaxRows * kMaxHeadsAtOnce];
  const int64_t block = pairs <= 6 ? longest : kKeyBlock;  // one group of pairs reads each value once anyway
  for (int64_t b0 = 0; b0 < longest; b0 += block) {
    const int64_t b1 = std::min(longest, b0 + block);
    for (int64_t m0 = 0; m0 < pairs; m0 += 6) {  // groups of up to 6 pairs, 4 value chunks at a time
      const int64_t n = std::min<int64_t>(6, pairs - m0);
      for (int64_t j = 0, c; j < chunks; j += c) {
        c = chunks - j >= 4 ? 4 : 1;
        for (int64_t m = 0; m < n; ++m) {
          score_rows[m] = scores + (m0 + m) * width;
          sum_rows[m] = sums + (m0 + m) * hd + 16 * j;
        }
        const WeighFn<T> weigh = c == 4 ? weigh_fn<T, 4>(n) : weigh_fn<T, 1>(n);
        weigh(v + 16 * j, table, pair_ctx + m0, b0, b1, tpp, row_stride, score_rows, sum_rows);
      }
    }
  }
  for (int64_t m = 0; m < pairs; ++m)
    for (int64_t c = 0; c < chunks; ++c) {
      alignas(64) float o[16];
      _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(sums + m * hd + 16 * c), _mm512_set1_ps(inv[m])));
      T* dst = out + m / N * q_stride + m % N * hd + 16 * c;
      for (int l = 0; l < 16; ++l) dst[l] = static_cast<T>(o[l]);  // bf16: nearest even
    }
}

}  // namespace
