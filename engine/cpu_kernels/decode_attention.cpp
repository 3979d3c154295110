// Decode attention over the paged pool without gathering it: one query row per sequence reads its
// keys and values where they lie (page table), in one pass per (sequence, kv head) for the query heads
// that share it; optionally preceded by the row's rotary embedding and its K/V write into the pool
// (decode_step_attention).
//
// The gathered path (engine/attention.py) copies every sequence's context out of the pool each layer
// and builds a mask before SDPA; at one row per sequence that copy and the dispatch around it cost
// more than the attention itself. Math in fp32 whatever the pool's dtype: scores, a max-subtracted
// softmax, then the weighted sum of values.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
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

// out[g][0 .. 16C) = inv[g] * sum over keys t in order of scores[g * width + t] * v_t[0 .. 16C), for the
// N heads g at once: each value row is read once, its C vectors kept in registers with the N * C sums.
template <typename T, int N, int C>
__attribute__((target("avx512f"), always_inline)) inline void weighted_values(
    const T* v, const int64_t* table, int64_t ctx, int64_t tpp, int64_t row_stride, const std::vector<float>& scores,
    int64_t width, const float* inv, int64_t hd, T* out) {
  __m512 acc[N][C];
  for (int g = 0; g < N; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < ctx; t0 += tpp) {
    const T* page = v + table[t0 / tpp] * tpp * row_stride;
    for (int64_t t = t0; t < std::min(ctx, t0 + tpp); ++t) {
      const T* vt = page + (t - t0) * row_stride;
      for (int c = 0; c < C; ++c) {
        const __m512 vc = load16(vt + 16 * c);
        for (int g = 0; g < N; ++g) acc[g][c] = _mm512_fmadd_ps(vc, _mm512_set1_ps(scores[g * width + t]), acc[g][c]);
      }
    }
  }
  for (int g = 0; g < N; ++g)
    for (int c = 0; c < C; ++c) {
      alignas(64) float o[16];
      _mm512_store_ps(o, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
      for (int l = 0; l < 16; ++l) out[g * hd + 16 * c + l] = static_cast<T>(o[l]);  // bf16: nearest even
    }
}

// Query heads [h, h + N) of one sequence, which share one kv head: out[g][hd] = softmax(q_g . K^T * scale) . V
// over `ctx` keys. Each key and value row is read once for the N heads, and the page table once per page
// (no division per key). Each head's arithmetic is the same whatever N (a key's dot product over hd in
// order, then its horizontal sum; the weighted sum over keys in order), so a row's result does not
// depend on how its heads were grouped, nor on the batch beside it.
template <typename T, int N>
__attribute__((target("avx512f"), noinline)) void attend_heads(const T* q, const T* k, const T* v,
                                                             const int64_t* table, int64_t ctx, int64_t tpp,
                                                             int64_t row_stride, int64_t hd, float scale,
                                                             std::vector<float>& scores, T* out) {
  const int64_t chunks = hd / 16, width = (ctx + 31) / 16 * 16;  // width: one head's scores, padded
  __m512 qv[N][kMaxHeadDim / 16];
  for (int g = 0; g < N; ++g)
    for (int64_t j = 0; j < chunks; ++j) qv[g][j] = _mm512_mul_ps(load16(q + g * hd + 16 * j), _mm512_set1_ps(scale));
  scores.resize(N * width);
  float top[N];
  for (int g = 0; g < N; ++g) top[g] = -INFINITY;
  for (int64_t t0 = 0; t0 < ctx; t0 += tpp) {  // row_stride: elements between consecutive tokens (Hkv * hd)
    const T* page = k + table[t0 / tpp] * tpp * row_stride;
    for (int64_t t = t0; t < std::min(ctx, t0 + tpp); ++t) {
      const T* kt = page + (t - t0) * row_stride;
      __m512 acc[N];
      for (int g = 0; g < N; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t j = 0; j < chunks; ++j) {
        const __m512 kj = load16(kt + 16 * j);
        for (int g = 0; g < N; ++g) acc[g] = _mm512_fmadd_ps(kj, qv[g][j], acc[g]);
      }
      for (int g = 0; g < N; ++g) {
        scores[g * width + t] = _mm512_reduce_add_ps(acc[g]);
        top[g] = std::max(top[g], scores[g * width + t]);
      }
    }
  }
  float inv[N];
  for (int g = 0; g < N; ++g) {  // exp in place; lanes past ctx are masked out of the sum
    float* s = scores.data() + g * width;
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < ctx; t += 16) {
      const __mmask16 live = ctx - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (ctx - t)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(top[g])));
      _mm512_storeu_ps(s + t, e);
      total = _mm512_mask_add_ps(total, live, total, e);
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(total);
  }
  int64_t j = 0;  // the weighted sums of values: 64 lanes of the N heads' outputs at a time, then 16
  for (; j + 4 <= chunks; j += 4)
    weighted_values<T, N, 4>(v + 16 * j, table, ctx, tpp, row_stride, scores, width, inv, hd, out + 16 * j);
  for (; j < chunks; ++j)
    weighted_values<T, N, 1>(v + 16 * j, table, ctx, tpp, row_stride, scores, width, inv, hd, out + 16 * j);
}

constexpr int64_t kMaxHeadsAtOnce = 4;

// Work items (sequence, kv head, a run of up to kMaxHeadsAtOnce of its query heads); a run of one head
// each only when there are fewer (sequence, kv head) pairs than threads. (Measured, 2 threads, 9 query
// heads on 3 kv heads: runs of 3 beat single heads even at one sequence, where they leave one thread
// a third of the work idle: 0.46 against 0.77 ms at 4096 keys in fp32.) Rows are taken first, last,
// second, second to last, ...: the threads get contiguous ranges of items, and a prompt's rows attend to
// 1, 2, ..., n keys, so in row order the last thread would get most of the keys (3/4 of a prompt's with
// 2 threads); in this order every pair of rows holds about the same number. A 512-row prompt's
// attention, 30 layers, 2 threads: 121 -> 81 ms; each row's result unchanged.
template <typename T>
void attend_all(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables, const torch::Tensor& ctx,
                torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), hd = q.size(2);
  const int64_t tpp = kv.size(2), Hkv = kv.size(3), group = H / Hkv, P = tables.size(1);
  const int64_t run = B * Hkv >= at::get_num_threads() ? std::min(group, kMaxHeadsAtOnce) : 1;
  const int64_t runs = (group + run - 1) / run;  // per kv head
  const T* k = kv.data_ptr<T>();
  const T* v = k + kv.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* lens = ctx.data_ptr<int64_t>();
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, B * Hkv * runs, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / (Hkv * runs), b = r % 2 == 0 ? r / 2 : B - 1 - r / 2;  // rows from both ends
      const int64_t kvh = i / runs % Hkv, h = kvh * group + i % runs * run;
      const int64_t n = std::min(run, (kvh + 1) * group - h);
      const int64_t first = b * H * hd + h * hd;  // q and out rows [n, hd] of heads h..h+n-1
      const auto heads = n == 4 ? attend_heads<T, 4> : n == 3 ? attend_heads<T, 3> : n == 2 ? attend_heads<T, 2>
                                                                                            : attend_heads<T, 1>;
      heads(qp + first, k + kvh * hd, v + kvh * hd, tab + b * P, lens[b], tpp, Hkv * hd, hd, scale, scores, op + first);
    }
  });
}

// y = round(round(x * cos) + round(partner * sin)) over one half of a head (each product and the sum
// rounded to T as PyTorch's ops round them; a plain loop the compiler vectorizes).
template <typename T>
inline void rotate_half(const T* x, const T* partner, const T* cos, const T* sin, int64_t n, T* y) {
  for (int64_t j = 0; j < n; ++j) {
    const T a = static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(cos[j]));
    const T b = static_cast<T>(static_cast<float>(partner[j]) * static_cast<float>(sin[j]));
    y[j] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
  }
}

// Rotates one row's q and k heads as engine/rope.py's apply_rotary does (x*cos + swap(x)*sin with the
// sign in the sin table), writes its k and v into the pool slot, and leaves the rotated q in `q_out`
// [H, hd].
template <typename T>
void rotate_and_store(const T* qkv, const T* cos, const T* sin, int64_t H, int64_t Hkv, int64_t hd, T* q_out,
                      T* k_slot, T* v_slot) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < H + Hkv; ++h) {
    const T* x = qkv + h * hd;
    T* y = h < H ? q_out + h * hd : k_slot + (h - H) * hd;
    rotate_half(x, x + half, cos, sin, half, y);                           // first half: partner j + half
    rotate_half(x + half, x, cos + half, sin + half, half, y + half);      // second half: partner j - half
  }
  std::copy(qkv + (H + Hkv) * hd, qkv + (H + 2 * Hkv) * hd, v_slot);
}

template <typename T>
void rotate_all(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& kv,
                const torch::Tensor& slots, torch::Tensor& q) {
  const int64_t B = qkv.size(0), H = q.size(1), hd = qkv.size(2), Hkv = kv.size(3);
  const int64_t slot_size = Hkv * hd;  // elements per token slot of one of k, v
  T* k = kv.data_ptr<T>();
  T* v = k + kv.stride(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  at::parallel_for(0, B, 8, [&](int64_t b0, int64_t b1) {  // rows write distinct slots (one per token)
    for (int64_t b = b0; b < b1; ++b) {
      rotate_and_store<T>(qkv.data_ptr<T>() + b * qkv.stride(0), cos.data_ptr<T>() + b * hd,
                          sin.data_ptr<T>() + b * hd, H, Hkv, hd, q.data_ptr<T>() + b * H * hd, k + sl[b] * slot_size,
                          v + sl[b] * slot_size);
    }
  });
}

}  // namespace

torch::Tensor decode_step_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                    torch::Tensor kv, const torch::Tensor& slots, const torch::Tensor& tables,
                                    const torch::Tensor& ctx) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2) && kv.dim() == 5 &&
                  kv.is_contiguous() && qkv.scalar_type() == kv.scalar_type() && qkv.size(2) == kv.size(4),
              "decode_step_attention: qkv [B, H + 2*Hkv, hd] with rows of whole heads, a contiguous pool layer");
  const int64_t B = qkv.size(0), hd = qkv.size(2), Hkv = kv.size(3), H = qkv.size(1) - 2 * Hkv;
  TORCH_CHECK(H > 0 && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * hd && sin.numel() == B * hd &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "decode_step_attention: cos, sin [B, hd] contiguous, of qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B,
              "decode_step_attention: slots [B] int64");
  auto q = torch::empty({B, H, hd}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rotate_all<float>(qkv, cos, sin, kv, slots, q);
  } else {
    rotate_all<at::BFloat16>(qkv, cos, sin, kv, slots, q);
  }
  return decode_attention(q, kv, tables, ctx).view({B, H * hd});
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
                               const torch::Tensor& ctx) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && q.scalar_type() == kv.scalar_type() && kv.is_contiguous(),
              "decode_attention: q [B, H, hd] and a contiguous layer [2, pages, tpp, Hkv, hd] of one dtype");
  TORCH_CHECK(q.size(2) == kv.size(4) && q.size(2) % 16 == 0 && q.size(2) <= kMaxHeadDim && q.size(1) % kv.size(3) == 0,
              "decode_attention: head size a multiple of 16 up to 256, query heads a multiple of kv heads");
  TORCH_CHECK(tables.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong && tables.is_contiguous() &&
                  tables.size(0) == q.size(0) && ctx.size(0) == q.size(0),
              "decode_attention: tables [B, P] and ctx [B] int64");
  auto qc = q.contiguous();
  auto out = torch::empty_like(qc);
  if (q.scalar_type() == at::kFloat) {
    attend_all<float>(qc, kv, tables, ctx, out);
  } else {
    attend_all<at::BFloat16>(qc, kv, tables, ctx, out);
  }
  return out;
}
