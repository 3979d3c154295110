// Decode attention over the paged pool without gathering it: one query row per sequence reads its
// keys and values where they lie (page table), in one pass per (sequence, query head); optionally
// preceded by the row's rotary embedding and its K/V write into the pool (decode_step_attention).
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

// One (sequence, query head): out[hd] = softmax(q . K^T * scale) . V over `ctx` keys.
template <typename T>
__attribute__((target("avx512f"), noinline)) void attend_row(const T* q, const T* k, const T* v, const int64_t* table,
                                                           int64_t ctx, int64_t tpp, int64_t row_stride, int64_t hd,
                                                           float scale, std::vector<float>& scores, T* out) {
  const int64_t chunks = hd / 16;
  __m512 qv[kMaxHeadDim / 16];
  for (int64_t j = 0; j < chunks; ++j) qv[j] = _mm512_mul_ps(load16(q + 16 * j), _mm512_set1_ps(scale));
  scores.resize(ctx + 16);
  float top = -INFINITY;
  for (int64_t t = 0; t < ctx; ++t) {  // row_stride: elements between consecutive tokens (Hkv * hd)
    const T* kt = k + (table[t / tpp] * tpp + t % tpp) * row_stride;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < chunks; ++j) acc = _mm512_fmadd_ps(load16(kt + 16 * j), qv[j], acc);
    scores[t] = _mm512_reduce_add_ps(acc);
    top = std::max(top, scores[t]);
  }
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; t += 16) {  // exp in place; lanes past ctx are masked out of the sum
    const __mmask16 live = ctx - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (ctx - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores.data() + t), _mm512_set1_ps(top)));
    _mm512_storeu_ps(scores.data() + t, e);
    total = _mm512_mask_add_ps(total, live, total, e);
  }
  const float inv = 1.f / _mm512_reduce_add_ps(total);
  __m512 acc[kMaxHeadDim / 16];
  for (int64_t j = 0; j < chunks; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    const T* vt = v + (table[t / tpp] * tpp + t % tpp) * row_stride;
    const __m512 w = _mm512_set1_ps(scores[t]);
    for (int64_t j = 0; j < chunks; ++j) acc[j] = _mm512_fmadd_ps(load16(vt + 16 * j), w, acc[j]);
  }
  alignas(64) float o[kMaxHeadDim];
  for (int64_t j = 0; j < chunks; ++j) _mm512_store_ps(o + 16 * j, _mm512_mul_ps(acc[j], _mm512_set1_ps(inv)));
  for (int64_t j = 0; j < hd; ++j) out[j] = static_cast<T>(o[j]);  // bf16: rounded to nearest even
}

template <typename T>
void attend_all(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables, const torch::Tensor& ctx,
                torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), hd = q.size(2);
  const int64_t tpp = kv.size(2), Hkv = kv.size(3), group = H / Hkv, P = tables.size(1);
  const T* k = kv.data_ptr<T>();
  const T* v = k + kv.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* lens = ctx.data_ptr<int64_t>();
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H, kvh = h / group;
      attend_row<T>(qp + i * hd, k + kvh * hd, v + kvh * hd, tab + b * P, lens[b], tpp, Hkv * hd, hd, scale, scores,
                    op + i * hd);
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
  at::parallel_for(0, B, 8, [&](int64_t b0, int64_t b1) {  // rows write distinct slots (one per sequence)
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
