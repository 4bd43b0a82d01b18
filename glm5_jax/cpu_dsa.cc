// DeepSeek Sparse Attention's decode on XLA:CPU (XLA FFI custom calls; see
// glm5_jax/cpu_dsa.py), each with the bits of the XLA path it replaces:
//   Glm5TopK: `lax.top_k` of each row of x [..., N] (float32), values and positions. Its
//     order, which XLA:CPU's TopK keeps: descending in float32's total order (-NaN < -inf <
//     ... < -0.0 < +0.0 < ... < +inf < +NaN, by the bits), equal values in ascending
//     position. Each element becomes one 32-bit key (the order's, inverted: ascending key is
//     that order); the k-th smallest key by a radix selection, then the keys below it and
//     the first of those equal to it, in position order, sorted by a stable radix sort (ties
//     keep ascending positions). XLA:CPU runs a partial sort whose comparator converts both
//     floats at every comparison: [16, 2048] rows with 1K visible, k = 256 (a decode step's
//     indexer top-k at 1K context), ~1.8 ms there, ~0.07 ms here (fresh rows each call).
//   Glm5PagedIndexScores: the lightning indexer's scores over a paged key cache.
//   Glm5PagedSparseLogits / Glm5RowValues: sparse attention's two products, the logits over
//     the selected rows of a paged cache (which also writes those rows out, in slot order),
//     the values over the rows so written (contiguous: read once from the scattered pool).
// Rows or items go to the calling thread and XLA's intra-op thread pool when there are enough
// of them.

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMinSplit = 16 << 10;   // fewer elements in all: one thread
constexpr int64_t kRowsPerItem = 4;
constexpr int64_t kMinPagedSplit = 1 << 20;   // fewer multiply-adds: one thread

// `work` on the calling thread and on up to threads - 1 of the pool's, until `done` counts
// every item.
template <typename F>
void RunPool(ffi::ThreadPool& pool, int64_t threads, int64_t n_items, F work,
             const std::atomic<int64_t>& done) {
  const int64_t helpers = std::min(threads, n_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(F(work));
  work();
  while (done.load(std::memory_order_acquire) < n_items) std::this_thread::yield();
}

// Ascending key = descending total order of the float (the order's unsigned key, inverted).
inline uint32_t Key(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return ~((b & 0x80000000u) ? ~b : (b | 0x80000000u));
}

constexpr uint32_t kNegInfKey = 0xFF800000u;   // Key(-inf): keys below it rank above -inf

// Per-thread buffers of `Row`: the row's keys, the selection's candidates and its (key,
// position) pairs.
struct Scratch {
  std::vector<uint32_t> key, cand;
  std::vector<uint64_t> sel, tmp;
};

// The k smallest keys of key[0, n) in ascending (key, position) order: the k-th smallest key
// T by a radix selection (11 bits from the top over every key, then 11 and 10 over the keys
// that share the bits found so far), every key below T and the first of those equal to T in
// position order, then a stable radix sort (a byte at a time from the bottom; equal keys keep
// ascending positions). Result: (key << 32 | position), k of them.
const uint64_t* Smallest(Scratch& s, int64_t n, int64_t k) {
  const uint32_t* key = s.key.data();
  uint32_t t = 0xFFFFFFFFu;   // T; with k = n every key is at most 2^32 - 1: all taken
  int64_t need = n;           // of the keys equal to T: how many are taken
  if (k < n) {
    uint32_t* cand = s.cand.data();
    int64_t m = 0;
    need = k;
    uint32_t prefix = 0;
    for (const int shift : {21, 10, 0}) {
      const int bits = shift == 0 ? 10 : 11;
      uint32_t hist[2048] = {};
      if (shift == 21) {   // every key
        for (int64_t i = 0; i < n; ++i) ++hist[key[i] >> 21];
      } else {
        for (int64_t i = 0; i < m; ++i) ++hist[(key[cand[i]] >> shift) & ((1u << bits) - 1)];
      }
      uint32_t d = 0;
      for (; hist[d] < need; ++d) need -= hist[d];
      prefix |= d << shift;
      // The keys that share the bits found so far, in position order.
      const uint32_t top = shift == 0 ? 0xFFFFFFFFu : ~((1u << shift) - 1);
      if (shift == 21) {
        for (int64_t i = 0; i < n; ++i) {
          cand[m] = static_cast<uint32_t>(i);
          m += (key[i] & top) == prefix;
        }
      } else {
        int64_t w = 0;
        for (int64_t i = 0; i < m; ++i) {
          cand[w] = cand[i];
          w += (key[cand[i]] & top) == prefix;
        }
        m = w;
      }
    }
    t = prefix;
  }
  uint64_t* sel = s.sel.data();
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool take = key[i] < t || (key[i] == t && need > 0);
    need -= key[i] == t && take;
    sel[m] = (uint64_t{key[i]} << 32) | static_cast<uint32_t>(i);
    m += take;
  }
  uint64_t* tmp = s.tmp.data();
  for (int shift = 32; shift < 64; shift += 8) {
    uint32_t count[257] = {};
    for (int64_t i = 0; i < m; ++i) ++count[((sel[i] >> shift) & 0xFF) + 1];
    if (count[((sel[0] >> shift) & 0xFF) + 1] == m) continue;   // one digit: in order already
    for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
    for (int64_t i = 0; i < m; ++i) tmp[count[(sel[i] >> shift) & 0xFF]++] = sel[i];
    std::swap(sel, tmp);
  }
  return sel;
}

inline bool IsNegInf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b == 0xFF800000u;
}

// The row's k largest. Trailing -inf (the positions a caller masked) are left out of the
// selection when at least k elements before them rank above -inf (neither -inf nor -NaN):
// the k largest are then among those.
void Row(const float* x, int64_t N, int64_t k, float* v, int32_t* idx, Scratch& s) {
  int64_t live = N;
  while (live > k && IsNegInf(x[live - 1])) --live;
  uint32_t* key = s.key.data();
  int64_t above = 0;
  for (int64_t n = 0; n < live; ++n) {
    key[n] = Key(x[n]);
    above += key[n] < kNegInfKey;
  }
  if (above < k)
    for (int64_t n = live; n < N; ++n) key[n] = Key(x[n]);
  else
    N = live;
  const uint64_t* sel = Smallest(s, N, k);
  for (int64_t j = 0; j < k; ++j) {
    const int32_t p = static_cast<int32_t>(sel[j] & 0xFFFFFFFFu);
    idx[j] = p;
    v[j] = x[p];
  }
}

struct Rows {
  const float* x;
  float* v;
  int32_t* idx;
  int64_t R, N, k, items;
  std::atomic<int64_t> next{0}, done{0};
};

void Work(Rows& s) {
  Scratch scratch;
  scratch.key.resize(s.N), scratch.cand.resize(s.N + 1);
  scratch.sel.resize(s.k + 1), scratch.tmp.resize(s.k);
  for (int64_t i; (i = s.next.fetch_add(1)) < s.items;) {
    for (int64_t r = i * kRowsPerItem; r < std::min(s.R, (i + 1) * kRowsPerItem); ++r)
      Row(s.x + r * s.N, s.N, s.k, s.v + r * s.k, s.idx + r * s.k, scratch);
    s.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error TopKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                    ffi::ResultBuffer<ffi::F32> v, ffi::ResultBuffer<ffi::S32> idx) {
  const auto xd = x.dimensions(), vd = v->dimensions();
  if (xd.size() == 0 || vd.size() != xd.size())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "top_k: x must be [..., N]");
  auto s = std::make_shared<Rows>();
  s->N = xd.back(), s->k = vd.back();
  s->R = s->N == 0 ? 0 : static_cast<int64_t>(x.element_count()) / s->N;
  if (s->k > s->N || s->k < 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "top_k: k must be in [0, N]");
  if (s->R == 0 || s->k == 0) return ffi::Error::Success();
  s->x = x.typed_data(), s->v = v->typed_data(), s->idx = idx->typed_data();
  s->items = (s->R + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t threads =
      s->R * s->N < kMinSplit ? 1 : std::max<int64_t>(1, pool.num_threads());
  RunPool(pool, threads, s->items, [s] { Work(*s); }, s->done);
  return ffi::Error::Success();
}

// The indexer's scores over a paged key cache, straight from the pool: for item (b, t),
// scores[b, t, s] = sum_j w[b, t, j] relu(sum_d q[b, t, j, d] k[rows[b, s], d]) for the
// positions s <= limit[b, t], 0 past it (the caller masks them: they are never selected).
// Each sum is a fused multiply-add chain from zero (over d, then over j, in order): XLA:CPU's
// order for these dots (`index_scores`' einsums), probed bit for bit by cpu_dsa.py. The
// rows of 16 positions are gathered (transposed) into L1 once and every head reads them.
struct Paged {
  const float *q, *w, *pool;
  const int32_t *rows, *limit;
  float* out;
  int64_t B, T, J, D, S, R;
  std::atomic<int64_t> next{0}, done{0};
};

// f(std::integral_constant<int, n>{}) for n in [1, 8]: loops over up to 8 heads with a
// compile-time count, so that their accumulators stay in registers (with a runtime count they
// went through the stack: the values product ran ~3x slower).
template <typename F>
inline void WithCount(int64_t n, F&& f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

#if defined(__AVX512F__)
// r[i] (row i of a 16 x 16 block) -> r[c] (column c): unpacks within 128-bit lanes, then a
// 4 x 4 transpose of the lanes.
inline void Transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {   // r[4 i + m], 128-bit lane L: rows 4 i .. 4 i + 3 of column 4 L + m
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]),
                  c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 x0 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x44);
    const __m512 x1 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xEE);
    const __m512 y0 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x44);
    const __m512 y1 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xEE);
    t[m] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    t[4 + m] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    t[8 + m] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    t[12 + m] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

void PagedItem(const Paged& p, int64_t item, float* kt) {
  const int64_t b = item / p.T;
  const float* q = p.q + item * p.J * p.D;
  const float* w = p.w + item * p.J;
  const int32_t* rows = p.rows + b * p.S;
  float* out = p.out + item * p.S;
  const int64_t live = std::min<int64_t>(p.S, std::max<int64_t>(0, int64_t{p.limit[item]} + 1));
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t s0 = 0; s0 < live; s0 += 16) {
    const int64_t n = std::min<int64_t>(16, live - s0);
    const float* row[16];
    for (int64_t i = 0; i < 16; ++i) {   // positions past `live` repeat the last one
      const int64_t r = rows[s0 + std::min(i, n - 1)];
      row[i] = p.pool + std::min<int64_t>(std::max<int64_t>(r, 0), p.R - 1) * p.D;   // clip
    }
    // The next 16 positions' rows toward L2: the table's blocks are scattered over the pool
    // (a call at 1K context, 16 requests: ~250 -> ~150 us).
    for (int64_t s = s0 + 16; s < std::min(live, s0 + 32); ++s) {
      const float* next = p.pool + std::min<int64_t>(std::max<int64_t>(rows[s], 0), p.R - 1) * p.D;
      for (int64_t d = 0; d < p.D; d += 16) __builtin_prefetch(next + d, 0, 2);
    }
    for (int64_t d0 = 0; d0 < p.D; d0 += 16) {   // kt[d] = k[s0 .. s0 + 15, d]
      const int64_t nd = std::min<int64_t>(16, p.D - d0);
      const __mmask16 md = static_cast<__mmask16>((1u << nd) - 1);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_ps(md, row[i] + d0);
      Transpose16(r);
      for (int64_t c = 0; c < nd; ++c) _mm512_store_ps(kt + 16 * (d0 + c), r[c]);
    }
    __m512 score = zero;
    for (int64_t j0 = 0; j0 < p.J; j0 += 8) WithCount(p.J - j0, [&](auto count) {
      constexpr int nj = decltype(count)::value;
      __m512 acc[nj];
      for (int jj = 0; jj < nj; ++jj) acc[jj] = zero;
      for (int64_t d = 0; d < p.D; ++d) {
        const __m512 k = _mm512_load_ps(kt + 16 * d);
        for (int jj = 0; jj < nj; ++jj)
          acc[jj] = _mm512_fmadd_ps(_mm512_set1_ps(q[(j0 + jj) * p.D + d]), k, acc[jj]);
      }
      for (int jj = 0; jj < nj; ++jj)   // max(0, x): a NaN passes, as in XLA's relu
        score = _mm512_fmadd_ps(_mm512_max_ps(zero, acc[jj]), _mm512_set1_ps(w[j0 + jj]), score);
    });
    _mm512_mask_storeu_ps(out + s0, static_cast<__mmask16>((1u << n) - 1), score);
  }
  std::fill(out + live, out + p.S, 0.0f);
}
#else
void PagedItem(const Paged& p, int64_t item, float* kt) {
  const int64_t b = item / p.T;
  const float* q = p.q + item * p.J * p.D;
  const float* w = p.w + item * p.J;
  const int32_t* rows = p.rows + b * p.S;
  float* out = p.out + item * p.S;
  const int64_t live = std::min<int64_t>(p.S, std::max<int64_t>(0, int64_t{p.limit[item]} + 1));
  (void)kt;
  for (int64_t s = 0; s < live; ++s) {
    const int64_t r = std::min<int64_t>(std::max<int64_t>(rows[s], 0), p.R - 1);
    const float* k = p.pool + r * p.D;
    float score = 0.0f;
    for (int64_t j = 0; j < p.J; ++j) {
      float acc = 0.0f;
      for (int64_t d = 0; d < p.D; ++d) acc = std::fma(q[j * p.D + d], k[d], acc);
      const float relu = acc != acc ? acc : std::max(acc, 0.0f);
      score = std::fma(relu, w[j], score);
    }
    out[s] = score;
  }
  std::fill(out + live, out + p.S, 0.0f);
}
#endif

void WorkPaged(Paged& p) {
  std::vector<float> buf(16 * p.D + 16);
  float* kt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  for (int64_t i; (i = p.next.fetch_add(1)) < p.B * p.T;) {
    PagedItem(p, i, kt);
    p.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PagedScoresImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> keys,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                           ffi::Buffer<ffi::S32> limit, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), wd = w.dimensions(), kd = keys.dimensions(),
             rd = rows.dimensions(), ld = limit.dimensions();
  if (qd.size() != 4 || wd.size() != 3 || kd.size() != 3 || rd.size() != 2 ||
      ld.size() != 2 || wd[0] != qd[0] || wd[1] != qd[1] || wd[2] != qd[2] ||
      kd[2] != qd[3] || rd[0] != qd[0] || ld[0] != qd[0] || ld[1] != qd[1])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "paged_scores: q [B, T, J, D], w [B, T, J], keys [L, R, D], rows [B, S], "
                      "limit [B, T]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0])
    return ffi::Error(ffi::ErrorCode::kOutOfRange, "paged_scores: layer out of range");
  if (kd[1] * kd[2] >= (int64_t{1} << 31))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged_scores: a layer over 2^31 floats");
  auto p = std::make_shared<Paged>();
  p->q = q.typed_data(), p->w = w.typed_data(), p->rows = rows.typed_data();
  p->limit = limit.typed_data(), p->out = out->typed_data();
  p->B = qd[0], p->T = qd[1], p->J = qd[2], p->D = qd[3], p->S = rd[1], p->R = kd[1];
  p->pool = keys.typed_data() + l * p->R * p->D;
  const int64_t items = p->B * p->T;
  if (items == 0 || p->S == 0) return ffi::Error::Success();
  if (p->R == 0) {
    std::fill(p->out, p->out + items * p->S, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t threads = items * p->S * p->J * p->D < kMinPagedSplit
                              ? 1 : std::max<int64_t>(1, pool.num_threads());
  RunPool(pool, threads, items, [p] { WorkPaged(*p); }, p->done);
  return ffi::Error::Success();
}

// Sparse attention's two products over rows of a paged cache, each row read straight from
// the pool: row(b, i) = pool[rows[b, clip(max(i, 0))]] (clipped, as XLA's gathers; an empty
// slot, -1, reads position 0 and is masked by the caller). Each output is a fused
// multiply-add chain from zero within each block of kc (the contraction), the blocks' sums
// added in order: XLA:CPU's order for these dots (stream_matmul.cc), probed by the caller.
struct Sparse {
  // Logits: x = q [B, C, H, D], the rows read from `pool` [N, W] through rows [B, S] and idx
  // [B, C, K], and written, [:V], to `gathered` [B, C, K, V]. Values: x = p [B, C, H, K],
  // pool = those rows ([B, C, K, V], W = V), rows and idx null.
  const float *x, *pool;
  const int32_t *rows, *idx;
  float* out;
  float* gathered;
  int64_t B, C, H, D, K, V, S, N, W, kc;
  std::atomic<int64_t> next{0}, done{0};
};

// The cache lines of a row of n floats toward L2 (the rows are scattered over the pool: the
// hardware prefetcher does not see them coming; into L1, the logits took ~1.6x as long).
inline void Fetch(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    __builtin_prefetch(row + i, 0, 2);
}

inline const float* SlotRow(const Sparse& p, int64_t b, int32_t i) {
  const int64_t pos = std::min<int64_t>(std::max<int32_t>(i, 0), p.S - 1);
  const int64_t r = std::min<int64_t>(std::max<int32_t>(p.rows[b * p.S + pos], 0), p.N - 1);
  return p.pool + r * p.W;
}

// Every slot's row of item (b, c), and the first 16 rows fetched ahead.
void SlotRows(const Sparse& p, int64_t item, const float** row_k) {
  const int64_t b = item / p.C;
  for (int64_t k = 0; k < p.K; ++k) row_k[k] = SlotRow(p, b, p.idx[item * p.K + k]);
  for (int64_t k = 0; k < std::min<int64_t>(16, p.K); ++k) Fetch(row_k[k], p.W);
}

#if defined(__AVX512F__)
// logits[b, c, h, k] = q[b, c, h] . row(b, idx[b, c, k])[:D]: 16 slots' rows transposed into
// L1 (kt[d] = their column d), then every head's chains over d.
void LogitsItem(const Sparse& p, int64_t item, float* kt, const float** row_k) {
  const float* q = p.x + item * p.H * p.D;
  float* out = p.out + item * p.H * p.K;
  SlotRows(p, item, row_k);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K; k0 += 16) {
    const int64_t n = std::min<int64_t>(16, p.K - k0);
    const float* row[16];
    for (int64_t i = 0; i < 16; ++i) row[i] = row_k[k0 + std::min(i, n - 1)];
    for (int64_t i = k0 + 16; i < std::min(p.K, k0 + 32); ++i) Fetch(row_k[i], p.D);
    for (int64_t d0 = 0; d0 < p.D; d0 += 16) {
      const int64_t nd = std::min<int64_t>(16, p.D - d0);
      const __mmask16 md = static_cast<__mmask16>((1u << nd) - 1);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_ps(md, row[i] + d0);
      if (d0 < p.V) {   // the values' rows, in slot order
        const __mmask16 mv = static_cast<__mmask16>((1u << std::min<int64_t>(16, p.V - d0)) - 1);
        float* g = p.gathered + (item * p.K + k0) * p.V + d0;
        for (int64_t i = 0; i < n; ++i) _mm512_mask_storeu_ps(g + i * p.V, mv, r[i]);
      }
      Transpose16(r);
      for (int64_t c = 0; c < nd; ++c) _mm512_store_ps(kt + 16 * (d0 + c), r[c]);
    }
    const __mmask16 mk = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t h0 = 0; h0 < p.H; h0 += 8) WithCount(p.H - h0, [&](auto count) {
      constexpr int nh = decltype(count)::value;
      __m512 y[nh], acc[nh];
      for (int hh = 0; hh < nh; ++hh) y[hh] = zero;
      for (int64_t e0 = 0; e0 < p.D; e0 += p.kc) {
        for (int hh = 0; hh < nh; ++hh) acc[hh] = zero;
        for (int64_t d = e0; d < std::min(p.D, e0 + p.kc); ++d) {
          const __m512 k = _mm512_load_ps(kt + 16 * d);
          for (int hh = 0; hh < nh; ++hh)
            acc[hh] = _mm512_fmadd_ps(_mm512_set1_ps(q[(h0 + hh) * p.D + d]), k, acc[hh]);
        }
        for (int hh = 0; hh < nh; ++hh) y[hh] = _mm512_add_ps(y[hh], acc[hh]);
      }
      for (int hh = 0; hh < nh; ++hh)
        _mm512_mask_storeu_ps(out + (h0 + hh) * p.K + k0, mk, y[hh]);
    });
  }
}

// out[b, c, h] = sum_k p[b, c, h, k] rows[b, c, k]: 32 columns at a time, the slots' rows in
// order (contiguous: the hardware prefetcher sees them coming), every head's chains.
void ValuesItem(const Sparse& p, int64_t item, float*, const float**) {
  const float* pr = p.x + item * p.H * p.K;
  const float* rows = p.pool + item * p.K * p.V;
  float* out = p.out + item * p.H * p.V;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t v0 = 0; v0 < p.V; v0 += 32) {
    const int64_t nv = std::min<int64_t>(32, p.V - v0);
    const __mmask16 m0 = static_cast<__mmask16>(nv >= 16 ? 0xFFFF : (1u << nv) - 1);
    const __mmask16 m1 = static_cast<__mmask16>(nv >= 32 ? 0xFFFF : nv > 16 ? (1u << (nv - 16)) - 1 : 0);
    for (int64_t h0 = 0; h0 < p.H; h0 += 8) WithCount(p.H - h0, [&](auto count) {
      constexpr int nh = decltype(count)::value;
      __m512 y[nh][2], acc[nh][2];
      for (int hh = 0; hh < nh; ++hh) y[hh][0] = y[hh][1] = zero;
      for (int64_t e0 = 0; e0 < p.K; e0 += p.kc) {
        for (int hh = 0; hh < nh; ++hh) acc[hh][0] = acc[hh][1] = zero;
        for (int64_t k = e0; k < std::min(p.K, e0 + p.kc); ++k) {
          const float* row = rows + k * p.V + v0;
          const __m512 r0 = _mm512_maskz_loadu_ps(m0, row), r1 = _mm512_maskz_loadu_ps(m1, row + 16);
          for (int hh = 0; hh < nh; ++hh) {
            const __m512 ph = _mm512_set1_ps(pr[(h0 + hh) * p.K + k]);
            acc[hh][0] = _mm512_fmadd_ps(ph, r0, acc[hh][0]);
            acc[hh][1] = _mm512_fmadd_ps(ph, r1, acc[hh][1]);
          }
        }
        for (int hh = 0; hh < nh; ++hh) {
          y[hh][0] = _mm512_add_ps(y[hh][0], acc[hh][0]);
          y[hh][1] = _mm512_add_ps(y[hh][1], acc[hh][1]);
        }
      }
      for (int hh = 0; hh < nh; ++hh) {
        _mm512_mask_storeu_ps(out + (h0 + hh) * p.V + v0, m0, y[hh][0]);
        _mm512_mask_storeu_ps(out + (h0 + hh) * p.V + v0 + 16, m1, y[hh][1]);
      }
    });
  }
}
#else
void LogitsItem(const Sparse& p, int64_t item, float*, const float**) {
  const int64_t b = item / p.C;
  for (int64_t k = 0; k < p.K; ++k)
    std::memcpy(p.gathered + (item * p.K + k) * p.V, SlotRow(p, b, p.idx[item * p.K + k]),
                sizeof(float) * p.V);
  for (int64_t h = 0; h < p.H; ++h)
    for (int64_t k = 0; k < p.K; ++k) {
      const float* q = p.x + (item * p.H + h) * p.D;
      const float* row = SlotRow(p, b, p.idx[item * p.K + k]);
      float y = 0.0f;
      for (int64_t e0 = 0; e0 < p.D; e0 += p.kc) {
        float acc = 0.0f;
        for (int64_t d = e0; d < std::min(p.D, e0 + p.kc); ++d) acc = std::fma(q[d], row[d], acc);
        y = y + acc;
      }
      p.out[(item * p.H + h) * p.K + k] = y;
    }
}

void ValuesItem(const Sparse& p, int64_t item, float*, const float**) {
  for (int64_t h = 0; h < p.H; ++h)
    for (int64_t v = 0; v < p.V; ++v) {
      const float* pr = p.x + (item * p.H + h) * p.K;
      float y = 0.0f;
      for (int64_t e0 = 0; e0 < p.K; e0 += p.kc) {
        float acc = 0.0f;
        for (int64_t k = e0; k < std::min(p.K, e0 + p.kc); ++k)
          acc = std::fma(pr[k], p.pool[(item * p.K + k) * p.V + v], acc);
        y = y + acc;
      }
      p.out[(item * p.H + h) * p.V + v] = y;
    }
}
#endif

template <void (*Item)(const Sparse&, int64_t, float*, const float**)>
void WorkSparse(Sparse& p) {
  std::vector<float> buf(16 * p.D + 16);
  std::vector<const float*> row_k(p.K);
  float* kt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  for (int64_t i; (i = p.next.fetch_add(1)) < p.B * p.C;) {
    Item(p, i, kt, row_k.data());
    p.done.fetch_add(1, std::memory_order_release);
  }
}

// The items of a product on the calling thread and the pool's (one thread below
// kMinPagedSplit multiply-adds); every output zero where there is nothing to sum.
template <void (*Item)(const Sparse&, int64_t, float*, const float**)>
void SparseRun(ffi::ThreadPool& pool, std::shared_ptr<Sparse> p, int64_t per_item,
               int64_t out_per_item) {
  const int64_t items = p->B * p->C;
  if (per_item == 0) {
    std::fill(p->out, p->out + items * out_per_item, 0.0f);
    if (p->gathered) std::fill(p->gathered, p->gathered + items * p->K * p->V, 0.0f);
    return;
  }
  const int64_t threads =
      items * per_item < kMinPagedSplit ? 1 : std::max<int64_t>(1, pool.num_threads());
  RunPool(pool, threads, items, [p] { WorkSparse<Item>(*p); }, p->done);
}

ffi::Error SparseLogitsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> idx,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> gathered,
                            int64_t v_dim, int64_t kc) {
  const auto xd = q.dimensions(), kd = keys.dimensions(), rd = rows.dimensions(),
             id = idx.dimensions(), gd = gathered->dimensions();
  if (xd.size() != 4 || kd.size() != 3 || rd.size() != 2 || id.size() != 3 ||
      gd.size() != 4 || rd[0] != xd[0] || id[0] != xd[0] || id[1] != xd[1] || xd[3] > kd[2] ||
      v_dim < 0 || v_dim > xd[3] || gd[0] != xd[0] || gd[1] != xd[1] || gd[2] != id[2] ||
      gd[3] != v_dim || kc <= 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "sparse_logits: q [B, C, H, D], keys [L, N, W], rows [B, S], idx [B, C, K], "
                      "rows out [B, C, K, v_dim], v_dim <= D <= W, kc > 0");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0])
    return ffi::Error(ffi::ErrorCode::kOutOfRange, "sparse_logits: layer out of range");
  if (xd[0] * xd[1] * id[2] > 0 && (kd[1] == 0 || rd[1] == 0))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "sparse_logits: no rows");
  auto p = std::make_shared<Sparse>();
  p->x = q.typed_data(), p->rows = rows.typed_data(), p->idx = idx.typed_data();
  p->out = out->typed_data(), p->gathered = gathered->typed_data();
  p->B = xd[0], p->C = xd[1], p->H = xd[2], p->K = id[2], p->S = rd[1], p->N = kd[1];
  p->W = kd[2], p->D = xd[3], p->V = v_dim, p->kc = kc;
  p->pool = keys.typed_data() + l * p->N * p->W;
  SparseRun<LogitsItem>(pool, p, p->K * std::max<int64_t>(p->H * p->D, 1), p->H * p->K);
  return ffi::Error::Success();
}

ffi::Error RowValuesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs,
                         ffi::Buffer<ffi::F32> rows, ffi::ResultBuffer<ffi::F32> out,
                         int64_t kc) {
  const auto xd = probs.dimensions(), gd = rows.dimensions();
  if (xd.size() != 4 || gd.size() != 4 || gd[0] != xd[0] || gd[1] != xd[1] || gd[2] != xd[3] ||
      kc <= 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "row_values: probs [B, C, H, K], rows [B, C, K, V], kc > 0");
  auto p = std::make_shared<Sparse>();
  p->x = probs.typed_data(), p->pool = rows.typed_data(), p->rows = nullptr, p->idx = nullptr;
  p->out = out->typed_data(), p->gathered = nullptr;
  p->B = xd[0], p->C = xd[1], p->H = xd[2], p->K = xd[3], p->V = p->W = gd[3], p->kc = kc;
  p->D = 0, p->S = p->N = 0;
  SparseRun<ValuesItem>(pool, p, p->H * p->K * p->V, p->H * p->V);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5TopK, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5PagedIndexScores, PagedScoresImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5PagedSparseLogits, SparseLogitsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("v_dim")
                                  .Attr<int64_t>("kc"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5RowValues, RowValuesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kc"));
