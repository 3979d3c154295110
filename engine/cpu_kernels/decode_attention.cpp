// Attention over the paged pool without gathering it: each query row reads its keys and values where
// they lie (page table), in one pass per (tile of rows, kv head) for the query heads that share it:
// a decode row is a tile of its own, a prompt's consecutive rows (which read one page table) go up to
// kMaxRows to a tile, so a prompt's keys are read once per tile instead of once per row. Optionally
// preceded by each row's rotary embedding and its K/V write into the pool (decode_step_attention).
//
// The gathered path (engine/attention.py) copies every sequence's context out of the pool each layer
// and builds a mask before SDPA; at one row per sequence that copy and the dispatch around it cost
// more than the attention itself. Math in fp32 whatever the pool's dtype: scores, a max-subtracted
// softmax, then the weighted sum of values. Sixteen keys' scores are summed at once (sum16), with no
// horizontal add per key. Measured, 2 threads, 9 query heads on 3 kv heads, 30 layers, against the
// previous kernel (a row at a time, one horizontal sum per key; the same bits): a 512-row fp32 prompt
// 89 -> 58 ms, bf16 86 -> 65 ms; 2048 rows fp32 5 layers 431 -> 204 ms; decode rows within noise of it.
// Past 1024 keys a prompt's keys and values no longer stay in L2 from one tile to the next: tiles grow to
// 16 rows there, and values are weighed 128 keys at a time (attend_rows.h), the same bits.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attend_rows.h"
#include "kernels.h"

namespace {

// The rows of `tables` [B, P] cut into tiles: each run of consecutive rows with the same page table (a
// prompt chunk's rows; a decode batch's rows each stand alone) in as few tiles of at most `most` rows as
// there can be, of sizes that differ by at most one row. Returns each tile's first row, and B.
std::vector<int64_t> tile_starts(const torch::Tensor& tables, int64_t most) {
  const int64_t B = tables.size(0), P = tables.size(1);
  const int64_t* tab = tables.data_ptr<int64_t>();
  std::vector<int64_t> starts;
  for (int64_t b = 0, end; b < B; b = end) {
    for (end = b + 1; end < B && std::memcmp(tab + end * P, tab + b * P, P * sizeof(int64_t)) == 0;) ++end;
    const int64_t n = end - b, pieces = (n + most - 1) / most;
    for (int64_t i = 0; i < pieces; ++i) starts.push_back(b + n * i / pieces);
  }
  starts.push_back(B);
  return starts;
}

// Work items (tile, kv head, a run of up to kMaxHeadsAtOnce of its query heads); a run of one head each
// only when there are fewer (tile, kv head) pairs than threads. (Measured, 2 threads, 9 query heads on 3
// kv heads: runs of 3 beat single heads even at one sequence, where they leave one thread a third of the
// work idle: 0.46 against 0.77 ms at 4096 keys in fp32.) Tiles are taken first, last, second, second to
// last, ...: the threads get contiguous ranges of items, and a prompt's rows attend to 1, 2, ..., n keys,
// so in row order the last thread would get most of the keys (3/4 of a prompt's with 2 threads); in this
// order every pair of tiles holds about the same number. (A queue of items, largest first, balanced as
// well but split a sequence's kv heads, which share cache lines, between threads: decode 30% slower.)
// Each row's result is the same bits whatever tile, run or batch it is in (attend_rows).
template <typename T>
void attend_all(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables, const torch::Tensor& ctx,
                torch::Tensor& out) {
  const int64_t H = q.size(1), hd = q.size(2);
  const int64_t tpp = kv.size(2), Hkv = kv.size(3), group = H / Hkv, P = tables.size(1);
  // Tiles of 4 rows while a row's keys are few; past 1024 keys (1 MiB of K and V per kv head in fp32,
  // which no longer stay in L2 across tiles) up to kMaxRows rows, each key read once per tile, fewer where
  // that would leave under about 8 items per thread. Measured, 2 threads, 3 kv heads, fp32, one layer: a
  // 4096-row prompt 149 ms in tiles of 4, 103 in tiles of 16; its last 1024 rows 61 -> 46 ms; 2048 rows
  // 30.5 -> 25.3 ms; at 256 rows, tiles of 16 took 0.5 ms against 0.35 in tiles of 4.
  const int64_t longest = *std::max_element(ctx.data_ptr<int64_t>(), ctx.data_ptr<int64_t>() + ctx.size(0));
  const int64_t most =
      longest <= 1024 ? 4 : std::clamp<int64_t>(q.size(0) * Hkv / (8 * at::get_num_threads()), 4, kMaxRows);
  const std::vector<int64_t> starts = tile_starts(tables, most);
  const int64_t tiles = static_cast<int64_t>(starts.size()) - 1;
  const int64_t run = tiles * Hkv >= at::get_num_threads() ? std::min<int64_t>(group, kMaxHeadsAtOnce) : 1;
  const int64_t runs = (group + run - 1) / run;  // per kv head
  const T* k = kv.data_ptr<T>();
  const T* v = k + kv.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* lens = ctx.data_ptr<int64_t>();
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, tiles * Hkv * runs, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / (Hkv * runs), tile = r % 2 == 0 ? r / 2 : tiles - 1 - r / 2;  // tiles from both ends
      const int64_t b = starts[tile], rows = starts[tile + 1] - b;
      const int64_t kvh = i / runs % Hkv, h = kvh * group + i % runs * run;
      const int64_t n = std::min(run, (kvh + 1) * group - h);
      const int64_t first = b * H * hd + h * hd;  // q and out rows [n, hd] of heads h..h+n-1 of row b
      const T *qf = qp + first, *kh = k + kvh * hd, *vh = v + kvh * hd;
      const auto attend = n == 4 ? attend_rows<T, 4> : n == 3 ? attend_rows<T, 3> : n == 2 ? attend_rows<T, 2>
                                                                                       : attend_rows<T, 1>;
      attend(qf, H * hd, rows, kh, vh, tab + b * P, lens + b, tpp, Hkv * hd, hd, scale, scratch, op + first);
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
