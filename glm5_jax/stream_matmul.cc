// y[M, N] = x[M, K] @ w[layer] (w: [R, K, N] row-major, float32) in the order XLA:CPU's
// matmul of 8+ rows (Eigen's GEMM) sums: within each block of `kc` values of k, one fused
// multiply-add per k from zero; the blocks' sums added to y (from zero) one after another.
// Each weight is read once, straight from its stack at `layer` (no slice copied out of the
// stack, no packing pass); equal rows of x are computed once (a lone request's decode step
// mirrors its row over 8 lanes). Up to 64 distinct rows: each k-block's rows of w are read
// in storage order (whole rows up to 4 distinct rows of x, column chunks of 256 above), a
// work item per column chunk (its k-blocks in order) or, with few chunks, per chunk and
// k-block (the blocks' sums added in order at the end); more rows (prefill): register
// tiles over column chunks. Work items go to the calling thread and XLA's intra-op thread
// pool. A second entry point multiplies groups of rows each by its own matrix of a stack
// (the routed experts' blocks of a step, one call for all of them), a third batches of small
// products (a decode step's attention products). See glm5_jax/stream_matmul.py.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int kLanes = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int kLanes = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
#else
using vec = float;
constexpr int kLanes = 1;
inline vec vzero() { return 0.0f; }
inline vec vload(const float* p) { return *p; }
inline void vstore(float* p, vec a) { *p = a; }
inline vec vset1(float a) { return a; }
inline vec vfma(vec a, vec b, vec c) { return std::fma(a, b, c); }
inline vec vadd(vec a, vec b) { return a + b; }
#endif

constexpr int kAcc = 16;    // accumulator registers per tile (rows x vectors)
constexpr int kAhead = 8;   // rows of w prefetched ahead
constexpr int64_t kRowStreamMax = 64;      // most distinct rows streamed (else tiles)
constexpr int64_t kWideRows = 4;           // more rows than this: column chunks of 256
constexpr int64_t kMinSplit = 256 << 10;   // smaller weights (bytes): one thread
constexpr int64_t kMinBatchedSplit = 4 << 20;   // fewer multiply-adds: one thread

struct Problem {
  const float* x;   // [M, K]
  const float* w;   // [K, N], the layer's matrix
  float* y;         // [M, N]
  int64_t K, N, kc;
  std::vector<int64_t> rows;  // the distinct rows of x, computed
  float* partial = nullptr;   // RowStream: each k-block's sums [blocks, rows, N]
};

// R rows x C vectors of columns [n0, n0 + C * kLanes), over k in [k0, k1): y += the block's sums.
template <int R, int C>
inline void Tile(const Problem& p, const int64_t* rows, int64_t n0, int64_t k0, int64_t k1) {
  vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = p.x + rows[r] * p.K;
  const float* wk = p.w + k0 * p.N + n0;
  for (int64_t k = k0; k < k1; ++k, wk += p.N) {
    for (int c = 0; c < C * kLanes; c += 16) __builtin_prefetch(wk + kAhead * p.N + c);
    vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload(wk + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const vec xb = vset1(xr[r][k]);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xb, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = p.y + rows[r] * p.N + n0;
    for (int c = 0; c < C; ++c) vstore(yr + c * kLanes, vadd(vload(yr + c * kLanes), acc[r][c]));
  }
}

// The same for the last columns [n0, n1) of fewer than one tile: scalar fused multiply-adds.
inline void TailTile(const Problem& p, int64_t row, int64_t n0, int64_t n1, int64_t k0,
                     int64_t k1) {
  const float* xr = p.x + row * p.K;
  float* yr = p.y + row * p.N;
  for (int64_t n = n0; n < n1; ++n) {
    float acc = 0.0f;
    for (int64_t k = k0; k < k1; ++k) acc = std::fma(xr[k], p.w[k * p.N + n], acc);
    yr[n] += acc;
  }
}

// The last columns [n0, n1) (fewer than kLanes) of up to 8 rows: one masked vector per row, each
// lane the chain that TailTile computes. Without AVX-512, TailTile row by row.
#if defined(__AVX512F__)
template <int R>
inline void MaskedTile(const Problem& p, const int64_t* rows, int64_t n0, int64_t n1, int64_t k0,
                       int64_t k1) {
  const __mmask16 mask = static_cast<__mmask16>((1u << (n1 - n0)) - 1u);
  vec acc[R];
  const float* xr[R];
  for (int r = 0; r < R; ++r) acc[r] = vzero(), xr[r] = p.x + rows[r] * p.K;
  const float* wk = p.w + k0 * p.N + n0;
  for (int64_t k = k0; k < k1; ++k, wk += p.N) {
    const vec wv = _mm512_maskz_loadu_ps(mask, wk);
    for (int r = 0; r < R; ++r) acc[r] = vfma(vset1(xr[r][k]), wv, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float* yr = p.y + rows[r] * p.N + n0;
    _mm512_mask_storeu_ps(yr, mask, vadd(_mm512_maskz_loadu_ps(mask, yr), acc[r]));
  }
}
#endif

inline void TailGroup(const Problem& p, const int64_t* rows, int64_t n_rows, int64_t n0,
                      int64_t n1, int64_t k0, int64_t k1) {
#if defined(__AVX512F__)
  switch (n_rows) {
#define GLM5_CASE(r) \
  case r:            \
    return MaskedTile<r>(p, rows, n0, n1, k0, k1);
    GLM5_CASE(1) GLM5_CASE(2) GLM5_CASE(3) GLM5_CASE(4) GLM5_CASE(5) GLM5_CASE(6)
    GLM5_CASE(7) GLM5_CASE(8)
#undef GLM5_CASE
    default:
      break;
  }
#endif
  for (int64_t r = 0; r < n_rows; ++r) TailTile(p, rows[r], n0, n1, k0, k1);
}

template <int C>
void RowGroup(const Problem& p, const int64_t* rows, int64_t n, int64_t n0, int64_t k0,
              int64_t k1) {
  switch (n) {
#define GLM5_CASE(r) \
  case r:            \
    if constexpr (r * C <= kAcc) return Tile<r, C>(p, rows, n0, k0, k1);
    GLM5_CASE(1) GLM5_CASE(2) GLM5_CASE(3) GLM5_CASE(4) GLM5_CASE(5) GLM5_CASE(6)
    GLM5_CASE(7) GLM5_CASE(8)
#undef GLM5_CASE
    default:
      break;
  }
}

// Columns [c0, c1) (c0 a multiple of the tile width), every distinct row, every k-block.
template <int C>
void Columns(const Problem& p, int64_t c0, int64_t c1) {
  constexpr int64_t kWidth = C * kLanes;
  constexpr int64_t kRows = kAcc / C;
  const int64_t u = static_cast<int64_t>(p.rows.size());
  for (int64_t n0 = c0; n0 < c1; n0 += kWidth) {
    const int64_t n1 = std::min(c1, n0 + kWidth);
    for (int64_t k0 = 0; k0 < p.K; k0 += p.kc) {
      const int64_t k1 = std::min(p.K, k0 + p.kc);
      for (int64_t g = 0; g < u; g += kRows) {
        const int64_t n_rows = std::min(kRows, u - g);
        if (n1 - n0 == kWidth) {
          RowGroup<C>(p, p.rows.data() + g, n_rows, n0, k0, k1);
          continue;
        }
        int64_t n = n0;  // the last columns: one vector at a time, then a masked one
        for (; n + kLanes <= n1; n += kLanes)
          for (int64_t h = g; h < g + n_rows; h += 8)
            RowGroup<1>(p, p.rows.data() + h, std::min<int64_t>(8, g + n_rows - h), n, k0, k1);
        if (n < n1)
          for (int64_t h = g; h < g + n_rows; h += 8)
            TailGroup(p, p.rows.data() + h, std::min<int64_t>(8, g + n_rows - h), n, n1, k0, k1);
      }
    }
  }
}

// Rows streamed: each row of w (up to `chunk` columns of it) is read once and used for
// every distinct row of x, kPass rows of w per pass over the sums, which live in a buffer in
// L1; w streams in the order it is stored, each cache line prefetched into L2 kAheadRows
// rows before it is used (into L1 it measured half as fast: docs/benchmarks.md).
constexpr int kPass = 8;         // rows of w per pass over the sums
constexpr int kAheadRows = 16;   // prefetch distance, rows of w

// One pass: rows [k, k + kPass) of w (columns [c0, c0 + w_cols)) into the sums of U rows of
// x, and the prefetch of rows [pf_lo, pf_hi) of the pass kAheadRows / kPass passes ahead:
// each group of a pass prefetches its share, so the prefetches spread over the whole pass
// (all in its first group, they wait on each other: a 16-row [512, 512] matmul from memory,
// one thread, 33 -> 37 G multiply-adds per second).
template <int U>
inline void Pass(const Problem& p, const float* const* xr, float* acc, int64_t w_cols,
                 int64_t c0, int64_t k, int pf_lo, int pf_hi) {
  const int64_t vec_cols = w_cols / kLanes * kLanes, N = p.N;
  const float* wr = p.w + k * N + c0;
  vec xb[U][kPass];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < kPass; ++j) xb[u][j] = vset1(xr[u][k + j]);
  for (int64_t n = 0; n < vec_cols; n += kLanes) {
    vec wv[kPass];
    for (int j = 0; j < kPass; ++j) wv[j] = vload(wr + j * N + n);
    for (int j = pf_lo; j < pf_hi; ++j) __builtin_prefetch(wr + (kAheadRows + j) * N + n, 0, 2);
    for (int u = 0; u < U; ++u) {
      vec a = vload(acc + u * w_cols + n);
      for (int j = 0; j < kPass; ++j) a = vfma(xb[u][j], wv[j], a);
      vstore(acc + u * w_cols + n, a);
    }
  }
  for (int64_t n = vec_cols; n < w_cols; ++n)
    for (int u = 0; u < U; ++u)
      for (int j = 0; j < kPass; ++j)
        acc[u * w_cols + n] = std::fma(xr[u][k + j], wr[j * N + n], acc[u * w_cols + n]);
}

inline void PassGroup(const Problem& p, const float* const* xr, int n_rows, float* acc,
                      int64_t w_cols, int64_t c0, int64_t k, int pf_lo, int pf_hi) {
  switch (n_rows) {
    case 1: return Pass<1>(p, xr, acc, w_cols, c0, k, pf_lo, pf_hi);
    case 2: return Pass<2>(p, xr, acc, w_cols, c0, k, pf_lo, pf_hi);
    case 3: return Pass<3>(p, xr, acc, w_cols, c0, k, pf_lo, pf_hi);
    default: return Pass<4>(p, xr, acc, w_cols, c0, k, pf_lo, pf_hi);
  }
}

// Columns [c0, c1) of k-block `block`'s sums, from zero, into p.partial[block], or (no
// p.partial: the caller runs the blocks in order) added to y: each pass's rows of w come
// from L2 (prefetched) for the first group of 4 rows of x and from L1 for the others.
void RowStream(const Problem& p, int64_t c0, int64_t c1, int64_t block) {
  const int64_t u_all = static_cast<int64_t>(p.rows.size());
  const int64_t w_cols = c1 - c0;
  thread_local std::vector<float> buffer;
  buffer.assign(u_all * w_cols + 16, 0.0f);
  float* acc = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / 4 % 16) % 16;
  std::vector<const float*> xr(u_all);
  for (int64_t u = 0; u < u_all; ++u) xr[u] = p.x + p.rows[u] * p.K;
  const int64_t k0 = block * p.kc, k1 = std::min(p.K, k0 + p.kc);
  int64_t k = k0;
  const int64_t n_groups = (u_all + 3) / 4;
  for (; k + kPass <= k1; k += kPass)
    for (int64_t gi = 0; gi < n_groups; ++gi) {
      const int64_t g = 4 * gi;
      PassGroup(p, xr.data() + g, static_cast<int>(std::min<int64_t>(4, u_all - g)),
                acc + g * w_cols, w_cols, c0, k, static_cast<int>(gi * kPass / n_groups),
                static_cast<int>((gi + 1) * kPass / n_groups));
    }
  for (; k < k1; ++k) {
    const float* wr = p.w + k * p.N + c0;
    for (int64_t u = 0; u < u_all; ++u)
      for (int64_t n = 0; n < w_cols; ++n)
        acc[u * w_cols + n] = std::fma(xr[u][k], wr[n], acc[u * w_cols + n]);
  }
  for (int64_t u = 0; u < u_all; ++u) {
    const float* a = acc + u * w_cols;
    if (p.partial) {
      std::memcpy(p.partial + (block * u_all + u) * p.N + c0, a, sizeof(float) * w_cols);
    } else {
      float* yr = p.y + p.rows[u] * p.N + c0;
      for (int64_t n = 0; n < w_cols; ++n) yr[n] += a[n];
    }
  }
}

using ColumnsFn = void (*)(const Problem&, int64_t, int64_t);

// Tile width by distinct rows: wide tiles for one row (long contiguous reads of w), narrow
// ones for many (the accumulators of every row of a group stay in registers).
int TileVectors(int64_t distinct_rows) {
  if (distinct_rows <= 1) return 16;
  if (distinct_rows <= 2) return 8;
  if (distinct_rows <= 4) return 4;
  return 2;
}

struct Shared {
  Problem p;
  ColumnsFn fn = nullptr;            // tiles: one item per column chunk, every k-block
  int64_t chunk = 0, n_chunks = 0;   // RowStream (fn null): an item per chunk and k-block,
  int64_t n_items = 0, blocks = 0;   // or (whole_k) per chunk, its k-blocks in order
  bool whole_k = false;
  std::vector<float> partial;
  std::atomic<int64_t> next{0}, done{0};
};

void Work(Shared& s) {
  for (int64_t i; (i = s.next.fetch_add(1)) < s.n_items;) {
    const int64_t c0 = i % s.n_chunks * s.chunk, c1 = std::min(s.p.N, c0 + s.chunk);
    if (s.fn) s.fn(s.p, c0, c1);
    else if (s.whole_k) for (int64_t b = 0; b < s.blocks; ++b) RowStream(s.p, c0, c1, b);
    else RowStream(s.p, c0, c1, i / s.n_chunks);
    s.done.fetch_add(1, std::memory_order_release);
  }
}

// The distinct rows of x [M, K] into p.rows (y's rows among them zeroed); returns, for each
// row equal to an earlier one, that row's index (else -1).
std::vector<int64_t> Distinct(Problem& p, int64_t M) {
  std::vector<int64_t> copy_of(M, -1);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t u : p.rows)
      if (std::memcmp(p.x + m * p.K, p.x + u * p.K, sizeof(float) * p.K) == 0) {
        copy_of[m] = u;
        break;
      }
    if (copy_of[m] < 0) p.rows.push_back(m);
  }
  for (int64_t u : p.rows) std::memset(p.y + u * p.N, 0, sizeof(float) * p.N);
  return copy_of;
}

// Each repeated row of y copied from the row it repeats.
void Mirror(const Problem& p, const std::vector<int64_t>& copy_of) {
  for (int64_t m = 0; m < static_cast<int64_t>(copy_of.size()); ++m)
    if (copy_of[m] >= 0)
      std::memcpy(p.y + m * p.N, p.y + copy_of[m] * p.N, sizeof(float) * p.N);
}

// The register-tile routine and its width (columns) for `distinct_rows` rows.
ColumnsFn TileFn(int64_t distinct_rows, int64_t* width) {
  const int vecs = TileVectors(distinct_rows);
  *width = vecs * kLanes;
  return vecs == 16 ? &Columns<16> : vecs == 8 ? &Columns<8> : vecs == 4 ? &Columns<4>
                                                                          : &Columns<2>;
}

// Streamed rows' column chunk: N in `parts` chunks (whole vectors), at most 2048 columns up
// to kWideRows distinct rows of x and 256 above (their sums stay in L1).
int64_t RowChunk(int64_t distinct_rows, int64_t N, int64_t parts) {
  const int64_t width = (N + parts - 1) / parts;
  return std::min<int64_t>(distinct_rows > kWideRows ? 256 : 2048,
                           (width + kLanes - 1) / kLanes * kLanes);
}

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

ffi::Error StreamMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                            ffi::ResultBuffer<ffi::F32> y, int64_t kc) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "stream_matmul: x must be [M, K] and w [R, K, N]");
  const int64_t M = xd[0], K = xd[1], N = wd[2];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0])
    return ffi::Error(ffi::ErrorCode::kOutOfRange, "stream_matmul: layer out of range");
  if (kc <= 0) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "stream_matmul: kc <= 0");

  auto s = std::make_shared<Shared>();
  Problem& p = s->p;
  p.x = x.typed_data();
  p.w = w.typed_data() + l * K * N;
  p.y = y->typed_data();
  p.K = K, p.N = N, p.kc = kc;
  const std::vector<int64_t> copy_of = Distinct(p, M);

  const int64_t u = static_cast<int64_t>(p.rows.size());
  const int64_t threads =
      K * N * 4 < kMinSplit ? 1 : std::max<int64_t>(1, pool.num_threads());
  const int64_t blocks = (K + kc - 1) / kc;
  if (u <= kRowStreamMax) {
    // Rows of each k-block in column chunks, at least as many as it takes to give every
    // thread an item. With chunks enough for every thread (or one k-block), an item is a
    // chunk over its k-blocks in order, their sums added to y as they come; else an item
    // per chunk and k-block, the blocks' sums kept and added in order below.
    const int64_t per_block = blocks >= threads ? 1 : (threads + blocks - 1) / blocks;
    s->chunk = RowChunk(u, N, per_block);
    s->n_chunks = (N + s->chunk - 1) / s->chunk;
    s->blocks = blocks;
    s->whole_k = blocks == 1 || s->n_chunks >= 2 * threads;
    s->n_items = s->whole_k ? s->n_chunks : s->n_chunks * blocks;
    if (!s->whole_k) {
      s->partial.resize(blocks * u * N);
      p.partial = s->partial.data();
    }
  } else {
    int64_t width;
    s->fn = TileFn(u, &width);
    const int64_t tiles = (N + width - 1) / width;
    s->chunk = std::max<int64_t>(1, tiles / (4 * threads)) * width;
    s->n_chunks = s->n_items = (N + s->chunk - 1) / s->chunk;
  }
  RunPool(pool, threads, s->n_items, [s] { Work(*s); }, s->done);
  if (p.partial)  // y = ((0 + block 0) + block 1) + ...: Eigen's order
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t r = 0; r < u; ++r) {
        float* yr = p.y + p.rows[r] * N;
        const float* pr = p.partial + (b * u + r) * N;
        for (int64_t n = 0; n < N; ++n) yr[n] += pr[n];
      }
  Mirror(p, copy_of);
  return ffi::Error::Success();
}

// Groups: y[g] = x[g] @ w[index[g]] for g < count (x: [G, B, K], w: [R, K, N]), each group
// as StreamMatmulImpl computes it (the same bits), y[g] = 0 past count; consecutive groups
// of one matrix as one problem; one work list over every problem's column chunks, so the
// threads stream one matrix after another without a call, and a wake-up, per matrix. An
// item is a column chunk of one problem over its k-blocks in order (whole rows of w up to 4
// distinct rows of x: a matrix of `small`'s experts).
struct Grouped {
  struct Item {
    int64_t g, c0, c1;
  };
  std::vector<Problem> p;
  std::vector<ColumnsFn> fn;   // per problem: tiles, or null (rows streamed)
  std::vector<Item> items;
  int64_t blocks = 0;
  std::atomic<int64_t> next{0}, done{0};
};

void WorkGrouped(Grouped& s) {
  const int64_t n_items = static_cast<int64_t>(s.items.size());
  for (int64_t i; (i = s.next.fetch_add(1)) < n_items;) {
    const Grouped::Item& it = s.items[i];
    const Problem& p = s.p[it.g];
    if (s.fn[it.g]) s.fn[it.g](p, it.c0, it.c1);
    else for (int64_t b = 0; b < s.blocks; ++b) RowStream(p, it.c0, it.c1, b);
    s.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> index,
                             ffi::Buffer<ffi::S32> count, ffi::ResultBuffer<ffi::F32> y,
                             int64_t kc) {
  const auto xd = x.dimensions(), wd = w.dimensions(), id = index.dimensions();
  if (xd.size() != 3 || wd.size() != 3 || xd[2] != wd[1] || id.size() != 1 || id[0] != xd[0])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "stream_grouped_matmul: x must be [G, B, K], w [R, K, N], index [G]");
  const int64_t G = xd[0], B = xd[1], K = xd[2], N = wd[2];
  const int64_t used = count.typed_data()[0];
  if (used < 0 || used > G)
    return ffi::Error(ffi::ErrorCode::kOutOfRange, "stream_grouped_matmul: count not in [0, G]");
  if (kc <= 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "stream_grouped_matmul: kc <= 0");
  for (int64_t g = 0; g < used; ++g)
    if (index.typed_data()[g] < 0 || index.typed_data()[g] >= wd[0])
      return ffi::Error(ffi::ErrorCode::kOutOfRange, "stream_grouped_matmul: index out of range");
  float* y_all = y->typed_data();
  std::memset(y_all + used * B * N, 0, sizeof(float) * (G - used) * B * N);
  if (used == 0) return ffi::Error::Success();

  // A run of consecutive groups with the same matrix is one problem (its rows contiguous in
  // x and y): the matrix is read once.
  std::vector<int64_t> first;
  for (int64_t g = 0; g < used; ++g)
    if (g == 0 || index.typed_data()[g] != index.typed_data()[g - 1]) first.push_back(g);
  const int64_t problems = static_cast<int64_t>(first.size());
  first.push_back(used);
  auto s = std::make_shared<Grouped>();
  s->p.resize(problems);
  s->fn.assign(problems, nullptr);
  s->blocks = (K + kc - 1) / kc;
  std::vector<std::vector<int64_t>> copy_of(problems);
  const int64_t threads =
      problems * K * N * 4 < kMinSplit ? 1 : std::max<int64_t>(1, pool.num_threads());
  const int64_t per_group = (2 * threads + problems - 1) / problems;   // items a problem needs
  for (int64_t g = 0; g < problems; ++g) {
    Problem& p = s->p[g];
    p.x = x.typed_data() + first[g] * B * K;
    p.w = w.typed_data() + index.typed_data()[first[g]] * K * N;
    p.y = y_all + first[g] * B * N;
    p.K = K, p.N = N, p.kc = kc;
    copy_of[g] = Distinct(p, (first[g + 1] - first[g]) * B);
    const int64_t u = static_cast<int64_t>(p.rows.size());
    int64_t chunk;
    if (u <= kRowStreamMax) {
      chunk = RowChunk(u, N, per_group);
    } else {
      int64_t width;
      s->fn[g] = TileFn(u, &width);
      const int64_t tiles = (N + width - 1) / width;
      chunk = std::max<int64_t>(1, tiles / (2 * per_group)) * width;
    }
    for (int64_t c0 = 0; c0 < N; c0 += chunk)
      s->items.push_back({g, c0, std::min(N, c0 + chunk)});
  }
  RunPool(pool, threads, static_cast<int64_t>(s->items.size()), [s] { WorkGrouped(*s); },
          s->done);
  for (int64_t g = 0; g < problems; ++g) Mirror(s->p[g], copy_of[g]);
  return ffi::Error::Success();
}

// Batches of small products: y[g] = a[g] @ b[layer, g] (a: [G, M, K], b: [R, G, K, N], read in
// place: no slice copied out of a layer stack), each output the fused multiply-add chain in k
// that `matmul` computes (k-blocks of kc), in register tiles.
// XLA:CPU runs such a batch as one Eigen GEMM per element, paying its packing and call each
// time: a decode step's attention products (per request, [8, 144] x [144, 64]) ran at ~14 G
// multiply-adds/s (docs/benchmarks.md). An item is one product.
struct Batched {
  const float *a, *b;
  float* y;
  int64_t G, M, K, N, kc;
  ColumnsFn fn;
  std::vector<int64_t> rows;
  std::atomic<int64_t> next{0}, done{0};
};

void WorkBatched(Batched& s) {
  for (int64_t g; (g = s.next.fetch_add(1)) < s.G;) {
    Problem p;
    p.x = s.a + g * s.M * s.K;
    p.y = s.y + g * s.M * s.N;
    p.K = s.K, p.N = s.N, p.kc = s.kc;
    p.rows = s.rows;
    p.w = s.b + g * s.K * s.N;
    std::memset(p.y, 0, sizeof(float) * s.M * s.N);
    s.fn(p, 0, s.N);
    s.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error BatchedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a,
                             ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> y, int64_t kc) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 3 || bd.size() != 4 || ad[0] != bd[1] || ad[2] != bd[2])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "batched_matmul: a must be [G, M, K] and b [R, G, K, N]");
  if (kc <= 0) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "batched_matmul: kc <= 0");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= bd[0])
    return ffi::Error(ffi::ErrorCode::kOutOfRange, "batched_matmul: layer out of range");
  auto s = std::make_shared<Batched>();
  s->a = a.typed_data(), s->b = b.typed_data() + l * bd[1] * bd[2] * bd[3];
  s->y = y->typed_data();
  s->G = ad[0], s->M = ad[1], s->K = ad[2], s->N = bd[3], s->kc = kc;
  int64_t width;
  s->fn = TileFn(s->M, &width);
  for (int64_t m = 0; m < s->M; ++m) s->rows.push_back(m);
  if (s->G == 0 || s->M == 0 || s->N == 0) return ffi::Error::Success();
  const int64_t threads =
      s->G * s->M * s->K * s->N < kMinBatchedSplit ? 1 : std::max<int64_t>(1, pool.num_threads());
  RunPool(pool, threads, s->G, [s] { WorkBatched(*s); }, s->done);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5StreamMatmul, StreamMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kc"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5StreamGroupedMatmul, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kc"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5BatchedMatmul, BatchedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kc"));
