// Exact reductions over the last axis of float32 rows x [R, V], in one vectorized pass:
//   Glm5RowMax:    XLA:CPU's `reduce max` (the same bits): the largest value, +0 above -0;
//                  a row holding a NaN gives a NaN (its first; the caller takes XLA's
//                  reduction for such a row, whose NaN depends on XLA's order); an empty
//                  row gives -inf.
//   Glm5RowArgmax: `jnp.argmax`'s index: the first NaN if the row has one, else the lowest
//                  position holding the largest value (+0 and -0 equal); 0 for an empty row.
// XLA:CPU runs these reductions element by element (its maximum over 16 rows of 32,768:
// ~270-420 us; this pass ~50 us). See glm5_jax/row_reduce.py.

#include <cstdint>
#include <cstring>
#include <limits>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// A float's bits as an int32 in the float's total order (-NaN < -inf < -0 < +0 < +inf < NaN).
inline int32_t Key(uint32_t bits) {
  return static_cast<int32_t>(bits ^ ((static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31))
                                      & 0x7FFFFFFFu));
}

inline uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

inline float Float(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// The float whose key is k (Key is its own inverse: the sign bit it reads stays).
inline float FromKey(int32_t k) {
  return Float(static_cast<uint32_t>(Key(static_cast<uint32_t>(k))));
}

// The first NaN's position in x[0, n), or -1.
int64_t FirstNan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] != x[i]) return i;
  return -1;
}

// The largest key of x[0, n) and whether x holds a NaN.
int32_t MaxKey(const float* x, int64_t n, bool* nan) {
  int32_t best = std::numeric_limits<int32_t>::min();
  bool any_nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512i b0 = _mm512_set1_epi32(best), b1 = b0;
  __mmask16 u0 = 0, u1 = 0;
  const __m512i low = _mm512_set1_epi32(0x7FFFFFFF);
  for (; i + 32 <= n; i += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
    const __m512i i0 = _mm512_castps_si512(x0), i1 = _mm512_castps_si512(x1);
    const __m512i k0 = _mm512_xor_si512(i0, _mm512_and_si512(_mm512_srai_epi32(i0, 31), low));
    const __m512i k1 = _mm512_xor_si512(i1, _mm512_and_si512(_mm512_srai_epi32(i1, 31), low));
    b0 = _mm512_max_epi32(b0, k0);
    b1 = _mm512_max_epi32(b1, k1);
    u0 |= _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q);
    u1 |= _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
  }
  best = _mm512_reduce_max_epi32(_mm512_max_epi32(b0, b1));
  any_nan = (u0 | u1) != 0;
#endif
  for (; i < n; ++i) {
    const int32_t k = Key(Bits(x[i]));
    best = k > best ? k : best;
    any_nan |= x[i] != x[i];
  }
  *nan = any_nan;
  return best;
}

// The first position in x[0, n) equal (==) to m (not NaN), or n.
int64_t FirstEqual(const float* x, int64_t n, float m) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return n;
}

float RowMax(const float* x, int64_t n) {
  if (n == 0) return -std::numeric_limits<float>::infinity();
  bool nan;
  const int32_t k = MaxKey(x, n, &nan);
  return nan ? x[FirstNan(x, n)] : FromKey(k);
}

int32_t RowArgmax(const float* x, int64_t n) {
  if (n == 0) return 0;
  bool nan;
  const int32_t k = MaxKey(x, n, &nan);
  return static_cast<int32_t>(nan ? FirstNan(x, n) : FirstEqual(x, n, FromKey(k)));
}

ffi::Error Shape(ffi::Buffer<ffi::F32>& x, int64_t* rows, int64_t* n) {
  const auto d = x.dimensions();
  if (d.size() != 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "row_reduce: x must be [R, V]");
  *rows = d[0], *n = d[1];
  return ffi::Error::Success();
}

ffi::Error RowMaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  int64_t rows, n;
  if (auto e = Shape(x, &rows, &n); e.failure()) return e;
  for (int64_t r = 0; r < rows; ++r) y->typed_data()[r] = RowMax(x.typed_data() + r * n, n);
  return ffi::Error::Success();
}

ffi::Error RowArgmaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> y) {
  int64_t rows, n;
  if (auto e = Shape(x, &rows, &n); e.failure()) return e;
  for (int64_t r = 0; r < rows; ++r) y->typed_data()[r] = RowArgmax(x.typed_data() + r * n, n);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5RowMax, RowMaxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5RowArgmax, RowArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
