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

// out[r][g][16j .. 16(j + C)) = inv[r][g] * sum over keys t < ctx[r], in order, of scores[r][g][t] * v_t,
// for the R rows and N heads at once: each value row is read once, its C vectors kept in registers.
template <typename T, int N, int R, int C>
__attribute__((target("avx512f"), always_inline)) inline void weighted_values(
    const T* v, const int64_t* table, const int64_t* ctx, int64_t longest, int64_t tpp, int64_t row_stride,
    const float* scores, int64_t width, const float (&inv)[R][N], int64_t hd, int64_t out_stride, T* out) {
  __m512 acc[R][N][C];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < N; ++g)
      for (int c = 0; c < C; ++c) acc[r][g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < longest; t0 += tpp) {
    const T* page = v + table[t0 / tpp] * tpp * row_stride;
    for (int64_t t = t0; t < std::min(longest, t0 + tpp); ++t) {
      __m512 vc[C];
      for (int c = 0; c < C; ++c) vc[c] = load16(page + (t - t0) * row_stride + 16 * c);
      for (int r = 0; r < R; ++r) {
        if (t >= ctx[r]) continue;
        for (int g = 0; g < N; ++g) {
          const __m512 w = _mm512_set1_ps(scores[(r * N + g) * width + t]);
          for (int c = 0; c < C; ++c) acc[r][g][c] = _mm512_fmadd_ps(vc[c], w, acc[r][g][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < N; ++g)
      for (int c = 0; c < C; ++c) {
        alignas(64) float o[16];
        _mm512_store_ps(o, _mm512_mul_ps(acc[r][g][c], _mm512_set1_ps(inv[r][g])));
        T* dst = out + r * out_stride + g * hd + 16 * c;
        for (int l = 0; l < 16; ++l) dst[l] = static_cast<T>(o[l]);  // bf16: nearest even
      }
}

// R query rows that read the same page table (one row of a decode batch; up to kMaxTile rows of a prompt),
// row r over its own first ctx[r] keys, for the N query heads [h, h + N) that share one kv head:
// out[r][g][hd] = softmax(q_rg . K^T * scale) . V. q and out rows are `q_stride` apart. Each key and value
// row is read once for all R rows and N heads, the page table once per page (no division per key). A
// (row, head)'s arithmetic is the same whatever R and N: its scores (scores16), their maximum, the
// exponentials and their sum in blocks of 16 in order, the weighted sum over its keys in order; so a row's
// result does not depend on the rows or heads it was computed with, nor on the batch around it.
template <typename T, int N, int R>
__attribute__((target("avx512f"), noinline)) void attend_rows(const T* q, int64_t q_stride, const T* k, const T* v,
                                                            const int64_t* table, const int64_t* ctx, int64_t tpp,
                                                            int64_t row_stride, int64_t hd, float scale,
                                                            std::vector<float>& scratch, T* out) {
  const int64_t chunks = hd / 16;
  int64_t longest = 0;
  for (int r = 0; r < R; ++r) longest = std::max(longest, ctx[r]);
  const int64_t width = (longest + 15) / 16 * 16;  // one (row, head)'s scores, padded to whole blocks of 16
  scratch.resize(R * N * width + (R * N + 16) * hd + 16);
  float* scores = scratch.data();  // [R][N][width]
  float* qs = scores + R * N * width;  // [R][N][hd]: the scaled queries, then [16][hd] `wide` (bf16 keys in fp32)
  qs += (64 - reinterpret_cast<uintptr_t>(qs) % 64) % 64 / sizeof(float);  // 64-byte aligned (scratch has room)
  float* wide = qs + R * N * hd;
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < N; ++g)
      for (int64_t j = 0; j < chunks; ++j)
        _mm512_store_ps(qs + ((r * N + g) * chunks + j) * 16,
                        _mm512_mul_ps(load16(q + r * q_stride + g * hd + 16 * j), _mm512_set1_ps(scale)));
  __m512 top[R][N];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < N; ++g) top[r][g] = _mm512_set1_ps(-INFINITY);
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
    for (int r = 0; r < R; ++r) {
      if (t0 >= ctx[r]) continue;
      const __mmask16 live = ctx[r] - t0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (ctx[r] - t0)) - 1);
      for (int g = 0; g < N; ++g) {
        const __m512 sc = scores16(keys, qs + (r * N + g) * hd, chunks);
        _mm512_storeu_ps(scores + (r * N + g) * width + t0, sc);
        top[r][g] = _mm512_mask_max_ps(top[r][g], live, top[r][g], sc);
      }
    }
  }
  float inv[R][N];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < N; ++g) {  // exp in place; lanes past the row's context are masked out of the sum
      float* s = scores + (r * N + g) * width;
      const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top[r][g]));
      __m512 total = _mm512_setzero_ps();
      for (int64_t t = 0; t < ctx[r]; t += 16) {
        const __mmask16 live = ctx[r] - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (ctx[r] - t)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), most));
        _mm512_storeu_ps(s + t, e);
        total = _mm512_mask_add_ps(total, live, total, e);
      }
      inv[r][g] = 1.f / _mm512_reduce_add_ps(total);
    }
  constexpr int C = R * N <= 6 ? 4 : R * N <= 12 ? 2 : 1;  // value chunks per pass: at most 24 accumulators
  int64_t j = 0;
  for (; j + C <= chunks; j += C)
    weighted_values<T, N, R, C>(v + 16 * j, table, ctx, longest, tpp, row_stride, scores, width, inv, hd, q_stride,
                                out + 16 * j);
  for (; j < chunks; ++j)
    weighted_values<T, N, R, 1>(v + 16 * j, table, ctx, longest, tpp, row_stride, scores, width, inv, hd, q_stride,
                                out + 16 * j);
}

}  // namespace
