// The arithmetic of paged attention for a tile of query rows (decode_attention.cpp cuts a pass into tiles
// and work items, and holds the entry points): scores of sixteen keys at once, the softmax, the weighted
// sum of values. Included by decode_attention.cpp only; everything here has internal linkage.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "simd16.h"

namespace {

constexpr int64_t kMaxHeadDim = 256;

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

constexpr int kMaxRows = 16;        // query rows of one sequence in one call of attend_rows (a tile)
constexpr int kMaxHeadsAtOnce = 4;  // query heads sharing one kv head in one call
constexpr int64_t kKeyBlock = 128;  // keys whose values stay in L1 while every (row, head) of a tile uses them

// acc[m][16c .. 16(c + 1)) += scores[m][t] * v_t[16c .. 16(c + 1)) for keys t in [t0, t1), in order,
// skipping t >= ctx[m], for M (row, head) pairs m and the C value chunks at `v` (acc: fp32, 64-byte
// aligned). Each value chunk is read once for the M pairs; the sums stay in registers across the block
// and in `acc` between blocks, so they are those of one pass over the keys in order whatever the blocks.
template <typename T, int M, int C>
SIMD void weigh_values(const T* v, const int64_t* table, const int64_t* ctx, int64_t t0, int64_t t1, int64_t tpp,
                       int64_t row_stride, const float* const* scores, float* const* acc) {
  V16 a[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) a[m][c] = load16(acc[m] + 16 * c);
  for (int64_t t = t0; t < t1;) {
    const int64_t first = t / tpp * tpp, end = std::min(t1, first + tpp);
    const T* page = v + table[t / tpp] * tpp * row_stride;
    for (; t < end; ++t) {
      V16 vc[C];
      for (int c = 0; c < C; ++c) vc[c] = load16(page + (t - first) * row_stride + 16 * c);
      for (int m = 0; m < M; ++m) {
        if (t >= ctx[m]) continue;
        const V16 w = set16(scores[m][t]);
        for (int c = 0; c < C; ++c) a[m][c] = fma16(vc[c], w, a[m][c]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) store16(acc[m] + 16 * c, a[m][c]);
}

template <typename T>
using WeighFn = void (*)(const T*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                         const float* const*, float* const*);

// weigh_values for 1 to kWeighPairs pairs (simd16.h: as many sums as the registers hold)
template <typename T, int C, size_t... M>
WeighFn<T> weigh_fn(int64_t pairs, std::index_sequence<M...>) {
  static constexpr WeighFn<T> fns[] = {weigh_values<T, static_cast<int>(M) + 1, C>...};
  return fns[pairs - 1];
}
template <typename T, int C>
WeighFn<T> weigh_fn(int64_t pairs) {
  return weigh_fn<T, C>(pairs, std::make_index_sequence<kWeighPairs>());
}

// R (<= kMaxRows) query rows that read the same page table (one row of a decode batch; consecutive rows
// of a prompt), row r over its own first ctx[r] keys, for the N (<= kMaxHeadsAtOnce) query heads
// [h, h + N) that share one kv head: out[r][g][hd] = softmax(q_rg . K^T * scale) . V. q and out rows
// are `q_stride` apart. Each key row is read once for all R rows and N heads, each value row once per
// kWeighPairs (row, head) pairs from L1 (values are taken kKeyBlock keys at a time), the page table once per
// page. A (row, head)'s arithmetic is the same whatever R and N: its scores (scores16), their maximum,
// the exponentials and their sum in blocks of 16 in order, the weighted sum over its keys in order; so
// a row's result does not depend on the rows or heads it was computed with, nor on the batch around it.
template <typename T, int N>
SIMD __attribute__((noinline)) void attend_rows(const T* q, int64_t q_stride, int64_t R, const T* k, const T* v,
                                                const int64_t* table, const int64_t* ctx, int64_t tpp,
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
      store16(qs + m * hd + 16 * j, mul16(load16(q + m / N * q_stride + m % N * hd + 16 * j), set16(scale)));
  V16 top[kMaxRows * kMaxHeadsAtOnce];
  for (int64_t m = 0; m < pairs; ++m) top[m] = set16(-INFINITY);
  for (int64_t t0 = 0; t0 < longest; t0 += 16) {
    const T* rows[16];
    key_rows(k, table, t0, std::min<int64_t>(16, longest - t0), tpp, row_stride, rows);
    const float* keys[16];  // the same rows in fp32: bf16 ones widened once here, not once per (row, head)
    for (int i = 0; i < 16; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        keys[i] = rows[i];
      } else {
        for (int64_t j = 0; j < chunks; ++j) store16(wide + i * hd + 16 * j, load16(rows[i] + 16 * j));
        keys[i] = wide + i * hd;
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      if (t0 >= ctx[r]) continue;
      for (int64_t g = 0; g < N; ++g) {
        const int64_t m = r * N + g;
        const V16 sc = scores16(keys, qs + m * hd, chunks);
        store16(scores + m * width + t0, sc);
        top[m] = max_live16(top[m], sc, ctx[r] - t0);
      }
    }
  }
  float inv[kMaxRows * kMaxHeadsAtOnce];
  int64_t pair_ctx[kMaxRows * kMaxHeadsAtOnce];
  for (int64_t m = 0; m < pairs; ++m) {  // exp in place; lanes past the row's context are masked out of the sum
    float* s = scores + m * width;
    const int64_t n = pair_ctx[m] = ctx[m / N];
    const V16 most = set16(reduce_max16(top[m]));
    V16 total = zero16();
    for (int64_t t = 0; t < n; t += 16) {
      const V16 e = exp16(sub16(load16(s + t), most));
      store16(s + t, e);
      total = add_live16(total, e, n - t);
    }
    inv[m] = 1.f / reduce_add16(total);
  }
  std::fill(sums, sums + pairs * hd, 0.f);
  const float* score_rows[kMaxRows * kMaxHeadsAtOnce];
  float* sum_rows[kMaxRows * kMaxHeadsAtOnce];
  const int64_t block = pairs <= kWeighPairs ? longest : kKeyBlock;  // one group of pairs reads each value once anyway
  for (int64_t b0 = 0; b0 < longest; b0 += block) {
    const int64_t b1 = std::min(longest, b0 + block);
    for (int64_t m0 = 0; m0 < pairs; m0 += kWeighPairs) {  // groups of pairs, kWeighChunks value chunks at a time
      const int64_t n = std::min<int64_t>(kWeighPairs, pairs - m0);
      for (int64_t j = 0, c; j < chunks; j += c) {
        c = chunks - j >= kWeighChunks ? kWeighChunks : 1;
        for (int64_t m = 0; m < n; ++m) {
          score_rows[m] = scores + (m0 + m) * width;
          sum_rows[m] = sums + (m0 + m) * hd + 16 * j;
        }
        const WeighFn<T> weigh = c == kWeighChunks ? weigh_fn<T, kWeighChunks>(n) : weigh_fn<T, 1>(n);
        weigh(v + 16 * j, table, pair_ctx + m0, b0, b1, tpp, row_stride, score_rows, sum_rows);
      }
    }
  }
  for (int64_t m = 0; m < pairs; ++m)
    for (int64_t c = 0; c < chunks; ++c) {
      alignas(64) float o[16];
      store16(o, mul16(load16(sums + m * hd + 16 * c), set16(inv[m])));
      T* dst = out + m / N * q_stride + m % N * hd + 16 * c;
      for (int l = 0; l < 16; ++l) dst[l] = static_cast<T>(o[l]);  // bf16: nearest even
    }
}

}  // namespace
