// DeepSeek Sparse Attention's decode on XLA:CPU (XLA FFI custom calls; see
// glm5_jax/cpu_dsa.py), each with the bits of the XLA path it replaces:
//   Glm5TopK: `lax.top_k` of each row of x [..., N] (float32), values and positions. Its
//     order, which XLA:CPU's TopK keeps: descending in float32's total order (-NaN < -inf <
//     ... < -0.0 < +0.0 < ... < +inf < +NaN, by the bits), equal values in ascending
//     position. Each element becomes one 32-bit key (the order's, inverted: ascending key is
//     that order); the k-th smallest key by a radix selection, then the keys below it and
//     the first of those equal to it, in position order, sorted (ties keep ascending
//     positions). XLA:CPU runs a partial sort whose comparator converts both floats at every
//     comparison: [16, 2048] rows with 1K visible, k = 256 (a decode step's indexer top-k at
//     1K context), ~1.8 ms there, ~0.07 ms here (fresh rows each call).
//   Glm5PagedIndexScores: the lightning indexer's scores over a paged key cache.
//   Glm5PagedIndexTopK: the two above in one call, as the engine's decode step uses them
//     (`deterministic_topk`'s mask between them): each query's top-k positions.
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
#include <limits>
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

constexpr int64_t kSelectCand = 512;   // Smallest: candidates selected by nth_element

// Per-thread buffers of `Row`: the row's keys, the selection's candidates and its (key,
// position) pairs.
struct Scratch {
  std::vector<uint32_t> key, cand, few, top = std::vector<uint32_t>(2048);
  std::vector<uint64_t> sel, tmp;
  void Size(int64_t n, int64_t k) {   // rows of n, k selected
    key.resize(n), cand.resize(n + 16), few.resize(kSelectCand), sel.resize(k + 16), tmp.resize(k);
  }
};

// The k smallest keys of key[0, n) in ascending (key, position) order: the k-th smallest key
// T by a radix selection (11 bits from the top over every key, then, among the keys that
// share those bits, by nth_element when they are at most kSelectCand, else 11 and 10 more
// bits), every key below T and the first of those equal to T in position order, sorted:
// into bins by their top 11 bits (pass 1's counts), each bin's few by value (a (key,
// position) pair is unique: equal keys keep ascending positions); with k = n, by a stable
// radix sort (a byte at a time from the bottom). Result: (key << 32 | position), k of them.
#if defined(__AVX512F__)
inline __m512i Positions(int64_t i) {   // i, i + 1, .., i + 15
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i)),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
#endif

const uint64_t* Smallest(Scratch& s, int64_t n, int64_t k) {
  if (k == 0) return s.sel.data();
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
      uint32_t hist_rest[2048];
      uint32_t* hist = shift == 21 ? s.top.data() : hist_rest;   // pass 1's: kept for the sort
      std::fill(hist, hist + 2048, 0u);
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
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512i tops = _mm512_set1_epi32(static_cast<int>(top)),
                      want = _mm512_set1_epi32(static_cast<int>(prefix));
        for (; i + 16 <= n; i += 16) {   // cand has 16 slots of slack
          const __mmask16 hit = _mm512_cmpeq_epi32_mask(
              _mm512_and_si512(_mm512_loadu_si512(key + i), tops), want);
          _mm512_storeu_si512(cand + m, _mm512_maskz_compress_epi32(hit, Positions(i)));
          m += __builtin_popcount(hit);
        }
#endif
        for (; i < n; ++i) {
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
      if (shift == 21 && m <= kSelectCand) {   // few share the top bits: select among them
        uint32_t* few = s.few.data();
        for (int64_t i = 0; i < m; ++i) few[i] = key[cand[i]];
        std::nth_element(few, few + need - 1, few + m);
        prefix = few[need - 1];
        int64_t below = 0;   // the keys below T: all of them before the (need-1)-th
        for (int64_t i = 0; i < need - 1; ++i) below += few[i] < prefix;
        need -= below;
        break;
      }
    }
    t = prefix;
  }
  uint64_t* sel = s.sel.data();
  int64_t m = 0, i = 0;
#if defined(__AVX512F__)
  const __m512i tv = _mm512_set1_epi32(static_cast<int>(t));
  const __m512i kPairsLo =
      _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i kPairsHi =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (; i + 16 <= n; i += 16) {   // sel has 16 slots of slack
    const __m512i kv = _mm512_loadu_si512(key + i);
    __mmask16 take = _mm512_cmplt_epu32_mask(kv, tv);
    for (uint32_t eq = _mm512_cmpeq_epi32_mask(kv, tv); eq && need > 0; eq &= eq - 1, --need)
      take |= static_cast<__mmask16>(eq & -eq);   // equal to T: the first `need`, in order
    const __m512i ck = _mm512_maskz_compress_epi32(take, kv);
    const __m512i cp = _mm512_maskz_compress_epi32(take, Positions(i));
    // (key << 32 | position): each position's 32 bits then its key's, 8 pairs at a time.
    _mm512_storeu_si512(sel + m, _mm512_permutex2var_epi32(cp, kPairsLo, ck));
    _mm512_storeu_si512(sel + m + 8, _mm512_permutex2var_epi32(cp, kPairsHi, ck));
    m += __builtin_popcount(take);
  }
#endif
  for (; i < n; ++i) {
    const bool take = key[i] < t || (key[i] == t && need > 0);
    need -= key[i] == t && take;
    sel[m] = (uint64_t{key[i]} << 32) | static_cast<uint32_t>(i);
    m += take;
  }
  uint64_t* tmp = s.tmp.data();
  if (k < n) {   // by the top 11 bits (pass 1's counts: every key of a bin below T's is taken),
    uint32_t* end = s.top.data();   // then each bin's few in order (their values are unique)
    const uint32_t last = t >> 21;
    uint64_t least = sel[0];   // the smallest key's bin: those below it are empty
    for (int64_t i = 1; i < m; ++i) least = std::min(least, sel[i]);
    const uint32_t first = static_cast<uint32_t>(least >> 53);
    for (uint32_t b = first, total = 0; b <= last; ++b) {
      const uint32_t count = b < last ? end[b] : static_cast<uint32_t>(m) - total;
      end[b] = total;   // the bin's start, then its end as it fills
      total += count;
    }
    for (int64_t i = 0; i < m; ++i) tmp[end[sel[i] >> 53]++] = sel[i];
    for (uint32_t b = first, start = 0; b <= last; start = end[b++])
      if (end[b] - start > 16) {
        std::sort(tmp + start, tmp + end[b]);
      } else {
        for (uint32_t i = start + 1; i < end[b]; ++i)   // insertion
          for (uint32_t j = i; j > start && tmp[j - 1] > tmp[j]; --j) std::swap(tmp[j - 1], tmp[j]);
      }
    return tmp;
  }
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
#if defined(__AVX512F__)
  const __m512i neg_inf = _mm512_set1_epi32(static_cast<int>(0xFF800000u));
  while (live - 16 >= k &&
         _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(x + live - 16), neg_inf) == 0xFFFF)
    live -= 16;
#endif
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
  scratch.Size(s.N, s.k);
  for (int64_t i; (i = s.next.fetch_add(1)) < s.items;) {
    Row(s.x + i * s.N, s.N, s.k, s.v + i * s.k, s.idx + i * s.k, scratch);   // an item a row
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
  s->items = s->R;
  const int64_t threads =
      s->R * s->N < kMinSplit ? 1 : std::max<int64_t>(1, pool.num_threads());
  RunPool(pool, threads, s->items, [s] { Work(*s); }, s->done);
  return ffi::Error::Success();
}

// The indexer's scores over a paged key cache, straight from the pool: for item (b, t),
// scores[b, t, s] = sum_j w[b, t, j] relu(sum_d q[b, t, j, d] k[rows[b, s], d]) for the
// positions s <= limit[b, t], 0 past it (the caller masks them: they are never selected).
// Each sum is a fused multiply-add chain from zero (over d, then over j, in order): XLA:CPU's
// order for these dots (`index_scores`' einsums), probed bit for bit by cpu_dsa.py.
struct Paged {
  const float *q, *w, *pool;
  const int32_t *rows, *limit;
  float* out;                  // scores [B, T, S]; or, selecting (below), null
  const int32_t* start = nullptr;   // selecting: the first visible position [B, T]
  int32_t* idx = nullptr;           // selecting: the top-k positions [B, T, topk]
  int64_t B, T, J, D, S, R, topk = 0;
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
// r[i] (row i of an 8 x 8 block) -> r[c] (column c).
inline void Transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {   // rows 4 i .. 4 i + 3 of columns (0, 4) .. (3, 7), by lane
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// 8 positions at a time: 8 heads in the lanes of one 256-bit vector per position (q
// transposed once: qt[group, d] = the group's 8 heads' element d), each key element broadcast
// as it is read; then an 8 x 8 transposition gives each head's sums over the 8 positions, and
// the chain over heads runs on those (with 16 positions in the lanes the keys were transposed
// instead, two 16 x 16 blocks per 16 positions).
constexpr int64_t kScoreRows = 8;

void PagedItem(const Paged& p, int64_t item, float* qt, float* out) {
  const int64_t b = item / p.T;
  const float* q = p.q + item * p.J * p.D;
  const float* w = p.w + item * p.J;
  const int32_t* rows = p.rows + b * p.S;
  const int64_t live = std::min<int64_t>(p.S, std::max<int64_t>(0, int64_t{p.limit[item]} + 1));
  const int64_t groups = (p.J + 7) / 8;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t d = 0; d < p.D; ++d)
      for (int64_t jj = 0; jj < 8; ++jj)
        qt[(g * p.D + d) * 8 + jj] = 8 * g + jj < p.J ? q[(8 * g + jj) * p.D + d] : 0.0f;
  const auto row_of = [&](int64_t s) {   // clipped, as XLA's gather
    return p.pool + std::min<int64_t>(std::max<int64_t>(rows[s], 0), p.R - 1) * p.D;
  };
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t s0 = 0; s0 < live; s0 += kScoreRows) {
    const int64_t n = std::min<int64_t>(kScoreRows, live - s0);
    const float* row[kScoreRows];
    for (int64_t i = 0; i < kScoreRows; ++i) row[i] = row_of(s0 + std::min(i, n - 1));
    // Positions 48 ahead toward L2: the table's blocks are scattered over the pool (16 ahead:
    // the fused top-k call at 1K context, 16 requests, ~7% slower in the engine's profile).
    for (int64_t s = s0 + 48; s < std::min(live, s0 + 48 + kScoreRows); ++s)
      for (int64_t d = 0; d < p.D; d += 16) __builtin_prefetch(row_of(s) + d, 0, 2);
    __m256 score = zero;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc[kScoreRows];
      for (int i = 0; i < kScoreRows; ++i) acc[i] = zero;
      const float* qg = qt + g * p.D * 8;
      for (int64_t d = 0; d < p.D; ++d) {
        const __m256 qd = _mm256_load_ps(qg + 8 * d);
        for (int i = 0; i < kScoreRows; ++i)
          acc[i] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(row[i] + d), acc[i]);
      }
      Transpose8(acc);   // acc[jj]: head 8 g + jj over the 8 positions
      for (int64_t jj = 0; jj < std::min<int64_t>(8, p.J - 8 * g); ++jj)   // max(0, x): a NaN
        score = _mm256_fmadd_ps(_mm256_max_ps(zero, acc[jj]),           // passes, as XLA's relu
                                _mm256_set1_ps(w[8 * g + jj]), score);
    }
    _mm256_mask_storeu_ps(out + s0, static_cast<__mmask8>((1u << n) - 1), score);
  }
  std::fill(out + live, out + p.S, 0.0f);
}
#else
void PagedItem(const Paged& p, int64_t item, float* qt, float* out) {
  const int64_t b = item / p.T;
  const float* q = p.q + item * p.J * p.D;
  const float* w = p.w + item * p.J;
  const int32_t* rows = p.rows + b * p.S;
  const int64_t live = std::min<int64_t>(p.S, std::max<int64_t>(0, int64_t{p.limit[item]} + 1));
  (void)qt;
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

// Selecting: item i's scores masked as `deterministic_topk` masks them (-inf before start,
// past limit and for a NaN), their top-k by `Row` (lax.top_k's order), -1 for a slot whose
// score is -inf (fewer visible positions than slots).
void SelectItem(const Paged& p, int64_t i, float* scores, float* vals, Scratch& scratch) {
  const int64_t live = std::min<int64_t>(p.S, std::max<int64_t>(0, int64_t{p.limit[i]} + 1));
  const int64_t first = std::min<int64_t>(live, std::max<int64_t>(0, p.start[i]));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::fill(scores, scores + first, neg_inf);
  for (int64_t s = first; s < live; ++s)
    if (std::isnan(scores[s])) scores[s] = neg_inf;
  std::fill(scores + live, scores + p.S, neg_inf);
  const int64_t k = std::min(p.topk, p.S);
  int32_t* idx = p.idx + i * p.topk;
  Row(scores, p.S, k, vals, idx, scratch);
  for (int64_t j = 0; j < k; ++j)
    if (vals[j] == neg_inf) idx[j] = -1;
  std::fill(idx + k, idx + p.topk, -1);
}

void WorkPaged(Paged& p) {
  std::vector<float> buf((p.J + 7) / 8 * 8 * p.D + 16);   // PagedItem's qt, 64-byte aligned
  float* qt =
      reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  std::vector<float> scores(p.idx ? p.S : 0), vals(p.idx ? p.topk : 0);
  Scratch scratch;
  if (p.idx) scratch.Size(p.S, std::min(p.topk, p.S));
  for (int64_t i; (i = p.next.fetch_add(1)) < p.B * p.T;) {
    if (p.idx) {
      if (p.R == 0) std::fill(scores.begin(), scores.end(), 0.0f);   // an empty pool
      else PagedItem(p, i, qt, scores.data());
      SelectItem(p, i, scores.data(), vals.data(), scratch);
    } else {
      PagedItem(p, i, qt, p.out + i * p.S);
    }
    p.done.fetch_add(1, std::memory_order_release);
  }
}

// The checks and the run of both entry points: scores into `out`, or (idx not null) each
// item's top-k positions.
ffi::Error RunPaged(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& w,
                    ffi::Buffer<ffi::F32>& keys, ffi::Buffer<ffi::S32>& layer,
                    ffi::Buffer<ffi::S32>& rows, ffi::Buffer<ffi::S32>& limit,
                    const int32_t* start, float* out, int32_t* idx, int64_t topk) {
  const auto qd = q.dimensions(), wd = w.dimensions(), kd = keys.dimensions(),
             rd = rows.dimensions(), ld = limit.dimensions();
  if (qd.size() != 4 || wd.size() != 3 || kd.size() != 3 || rd.size() != 2 ||
      ld.size() != 2 || wd[0] != qd[0] || wd[1] != qd[1] || wd[2] != qd[2] ||
      kd[2] != qd[3] || rd[0] != qd[0] || ld[0] != qd[0] || ld[1] != qd[1] || topk < 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "paged_scores: q [B, T, J, D], w [B, T, J], keys [L, R, D], rows [B, S], "
                      "limit [B, T], topk >= 0");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0])
    return ffi::Error(ffi::ErrorCode::kOutOfRange, "paged_scores: layer out of range");
  if (kd[1] * kd[2] >= (int64_t{1} << 31))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged_scores: a layer over 2^31 floats");
  auto p = std::make_shared<Paged>();
  p->q = q.typed_data(), p->w = w.typed_data(), p->rows = rows.typed_data();
  p->limit = limit.typed_data(), p->out = out, p->start = start, p->idx = idx, p->topk = topk;
  p->B = qd[0], p->T = qd[1], p->J = qd[2], p->D = qd[3], p->S = rd[1], p->R = kd[1];
  p->pool = keys.typed_data() + l * p->R * p->D;
  const int64_t items = p->B * p->T;
  if (items == 0 || (idx ? topk : p->S) == 0) return ffi::Error::Success();
  if (p->S == 0) {   // selecting from no positions
    std::fill(idx, idx + items * topk, -1);
    return ffi::Error::Success();
  }
  if (p->R == 0 && !idx) {   // an empty pool: every score 0
    std::fill(out, out + items * p->S, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t threads = items * p->S * p->J * p->D < kMinPagedSplit
                              ? 1 : std::max<int64_t>(1, pool.num_threads());
  RunPool(pool, threads, items, [p] { WorkPaged(*p); }, p->done);
  return ffi::Error::Success();
}

ffi::Error PagedScoresImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> keys,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                           ffi::Buffer<ffi::S32> limit, ffi::ResultBuffer<ffi::F32> out) {
  return RunPaged(pool, q, w, keys, layer, rows, limit, nullptr, out->typed_data(), nullptr, 0);
}

ffi::Error PagedTopKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> limit,
                         ffi::Buffer<ffi::S32> start, ffi::ResultBuffer<ffi::S32> idx) {
  const auto ld = limit.dimensions(), sd = start.dimensions(), id = idx->dimensions();
  if (sd.size() != 2 || ld.size() != 2 || sd[0] != ld[0] || sd[1] != ld[1] || id.size() != 3 ||
      id[0] != ld[0] || id[1] != ld[1])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "paged_topk: limit and start [B, T], positions out [B, T, topk]");
  return RunPaged(pool, q, w, keys, layer, rows, limit, start.typed_data(), nullptr,
                  idx->typed_data(), id[2]);
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
// logits[b, c, h, k] = q[b, c, h] . row(b, idx[b, c, k])[:D]: 8 heads in the lanes of one
// 256-bit vector (q transposed once: qt[d] = the 8 heads' element d), kLogitRows slots'
// chains at a time, each element of a row broadcast as it is read; no transposition of the
// rows (with 16 slots in the lanes, transposing them took about a third of the call: at
// `small`'s 16 requests and 1K context, ~300 -> ~190 us a call in the engine's profile). The
// sums go through a [K, 8] scratch, written out head by head.
constexpr int64_t kLogitRows = 8;

void LogitsItem(const Sparse& p, int64_t item, float* scratch, const float** row_k) {
  const float* q = p.x + item * p.H * p.D;
  float* out = p.out + item * p.H * p.K;
  float* qt = scratch;                                 // [D, 8]
  float* y_k = scratch + (8 * p.D + 15) / 16 * 16;     // [K, 8], 64-byte aligned
  SlotRows(p, item, row_k);
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t h0 = 0; h0 < std::max<int64_t>(p.H, 1); h0 += 8) {   // no heads: rows copied
    const int64_t nh = std::min<int64_t>(8, p.H - h0);
    for (int64_t d = 0; d < p.D; ++d)
      for (int64_t hh = 0; hh < 8; ++hh) qt[8 * d + hh] = hh < nh ? q[(h0 + hh) * p.D + d] : 0.0f;
    for (int64_t k0 = 0; k0 < p.K; k0 += kLogitRows) {
      const int64_t n = std::min<int64_t>(kLogitRows, p.K - k0);
      const float* row[kLogitRows];
      for (int64_t i = 0; i < kLogitRows; ++i) row[i] = row_k[k0 + std::min(i, n - 1)];
      if (h0 == 0) {   // first pass over the rows: the next ones fetched, these copied out
        for (int64_t i = k0 + 16; i < std::min(p.K, k0 + 16 + kLogitRows); ++i)
          Fetch(row_k[i], p.D);
        for (int64_t i = 0; i < n; ++i) {   // the values' rows, in slot order
          float* g = p.gathered + (item * p.K + k0 + i) * p.V;
          for (int64_t v0 = 0; v0 < p.V; v0 += 16) {
            const __mmask16 mv =
                static_cast<__mmask16>((1u << std::min<int64_t>(16, p.V - v0)) - 1);
            _mm512_mask_storeu_ps(g + v0, mv, _mm512_maskz_loadu_ps(mv, row[i] + v0));
          }
        }
      }
      __m256 y[kLogitRows], acc[kLogitRows];
      for (int i = 0; i < kLogitRows; ++i) y[i] = zero;
      for (int64_t e0 = 0; e0 < p.D; e0 += p.kc) {
        for (int i = 0; i < kLogitRows; ++i) acc[i] = zero;
        for (int64_t d = e0; d < std::min(p.D, e0 + p.kc); ++d) {
          const __m256 qd = _mm256_load_ps(qt + 8 * d);
          for (int i = 0; i < kLogitRows; ++i)
            acc[i] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(row[i] + d), acc[i]);
        }
        for (int i = 0; i < kLogitRows; ++i) y[i] = _mm256_add_ps(y[i], acc[i]);
      }
      for (int64_t i = 0; i < n; ++i) _mm256_store_ps(y_k + 8 * (k0 + i), y[i]);
    }
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t k = 0; k < p.K; ++k) out[(h0 + hh) * p.K + k] = y_k[8 * k + hh];
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
    const __mmask16 m1 =
        static_cast<__mmask16>(nv >= 32 ? 0xFFFF : nv > 16 ? (1u << (nv - 16)) - 1 : 0);
    for (int64_t h0 = 0; h0 < p.H; h0 += 8) WithCount(p.H - h0, [&](auto count) {
      constexpr int nh = decltype(count)::value;
      __m512 y[nh][2], acc[nh][2];
      for (int hh = 0; hh < nh; ++hh) y[hh][0] = y[hh][1] = zero;
      for (int64_t e0 = 0; e0 < p.K; e0 += p.kc) {
        for (int hh = 0; hh < nh; ++hh) acc[hh][0] = acc[hh][1] = zero;
        for (int64_t k = e0; k < std::min(p.K, e0 + p.kc); ++k) {
          const float* row = rows + k * p.V + v0;
          const __m512 r0 = _mm512_maskz_loadu_ps(m0, row);
          const __m512 r1 = _mm512_maskz_loadu_ps(m1, row + 16);
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
  std::vector<float> buf(8 * p.D + 8 * p.K + 32);   // LogitsItem's scratch, 64-byte aligned
  std::vector<const float*> row_k(p.K);
  float* scratch =
      reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  for (int64_t i; (i = p.next.fetch_add(1)) < p.B * p.C;) {
    Item(p, i, scratch, row_k.data());
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

namespace {
// The paged indexer's arguments: q, w, keys, layer, rows, limit.
auto PagedArgs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5PagedIndexScores, PagedScoresImpl,
                              PagedArgs().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5PagedIndexTopK, PagedTopKImpl,
                              PagedArgs().Arg<ffi::Buffer<ffi::S32>>()   // start
                                  .Ret<ffi::Buffer<ffi::S32>>());

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
