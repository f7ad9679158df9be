// MoeFFN int8 path (SPEC §4 quant path). Per expert, two int8 x int8 -> int32 matrix products;
// the dequantise / activate / requantise step is fused into the first product's store and the
// dequantise-to-output step into the second's.
//
// The VNNI products multiply UNSIGNED by signed bytes (vpdpbusd of AVX-512 VNNI and AVX-VNNI):
// x is fed as x + 128 (a bit flip) and 128 * colsum(W) is subtracted afterwards, folded into the
// bias. The avx2 path (vpmaddubsw, also u8 x s8) feeds x as it is, as |x| times sign(x) * w (see
// tile), and so does aarch64, which multiplies signed by signed (SDOT, or NEON's widening
// multiplies).
// Integer sums wrap modulo 2^32 like the device's int32 accumulator, so every path is exact and
// all give the same integers.
// The weights are repacked on every call (no cache that could go stale) into panels the 6 x 64
// register tile streams; packing, conversion and the two products are one parallel region each.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "ffn.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#endif

// GCC 12 reports its own AVX-512 intrinsics (the `__Y = __Y` idiom) as maybe-uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

constexpr const char *kOp = "moe_ffn";
constexpr int kMR = 6;          // rows of a register tile
constexpr int kNR = 64;         // columns of a register tile (4 vectors of 16 int32)
constexpr int64_t kRowChunk = 16 * kMR;  // rows of one parallel task

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The avx2 path: AVX2 without a byte dot product (vpmaddubsw and the sign trick, see tile).
#if defined(__AVX2__) && !defined(__AVXVNNI__) && !defined(__AVX512VNNI__)
#define MOE_INT8_SIGN 1
#endif

// How x and the requantised hidden values are fed to the products: q ^ kFlip as a byte (VNNI:
// unsigned q + 128; avx2 and aarch64: signed q itself).
#if defined(__aarch64__) || defined(MOE_INT8_SIGN)
constexpr uint8_t kFlip = 0;
#else
constexpr uint8_t kFlip = 0x80;
#endif

// Elements of the products' operands: rows of x and of the hidden values (Row), packed weight
// panels (Panel). On the avx2 path each row (K padded to 4 bytes) is followed by its absolute
// values, the unsigned operand of its products.
using Row = uint8_t;
using Panel = int8_t;
#if defined(MOE_INT8_SIGN)
constexpr int64_t kRowCopies = 2;
#else
constexpr int64_t kRowCopies = 1;
#endif

// The absolute values of the kp bytes of each of rows row0..row1 (stride ld) after them.
void absolute_values(Row *rows, int64_t ld, int64_t kp, int64_t row0, int64_t row1) {
  for (int64_t i = row0; i < row1; ++i) {
    const Row *v = rows + i * ld;
    Row *out = rows + i * ld + kp;
    int64_t k = 0;
#if defined(__AVX2__)
    for (; k + 32 <= kp; k += 32)
      _mm256_storeu_si256((__m256i *)(out + k), _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(v + k))));
#endif
    for (; k < kp; ++k) out[k] = static_cast<Row>(std::abs(static_cast<int>(static_cast<int8_t>(v[k]))));
  }
}

// A dequant scale as the device uses it: only the top 19 bits of the float32 survive.
inline float truncated(uint32_t bits) {
  bits &= 0xFFFFE000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// deq_scale [E, N] (uint64 whose low 32 bits are a float32 pattern, or float32) -> float32.
std::vector<float> deq_scales(const Arg &d) {
  std::vector<float> out(d.numel());
  for (int64_t i = 0; i < d.numel(); ++i) {
    uint32_t bits;
    if (d.dtype == DType::kU64) {
      bits = static_cast<uint32_t>(d.as<uint64_t>()[i]);
    } else {
      std::memcpy(&bits, d.as<float>() + i, 4);
    }
    out[i] = truncated(bits);
  }
  return out;
}

// One panel of the right-hand int8 matrix B [K, N] (row-major) for the register tile: columns
// c0..c0+kNR as [K/4][kNR][4], K and N zero-padded. Also writes the panel's columns of
// bias - 128 * colsum(B) (the correction for feeding x + 128), bias may be null. Returns whether
// the panel holds -128 (the one weight the avx2 path's fast product cannot take).
bool pack_panel(const int8_t *b, int64_t k, int64_t n, int64_t c0, const int32_t *bias,
                Panel *dst, int32_t *bias_out) {
  alignas(64) int32_t sum[kNR] = {};
  bool holds_min = false;
  int64_t q = 0;
  if (c0 + kNR <= n) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    // interior: a 4 x 64 byte transpose per step; column sums by vpdpbusd with ones
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    __mmask64 mins = 0;
    for (; q * 4 + 4 <= k; ++q, dst += kNR * 4) {
      const int8_t *r = b + q * 4 * n + c0;
      const __m512i r0 = _mm512_loadu_si512(r), r1 = _mm512_loadu_si512(r + n);
      const __m512i r2 = _mm512_loadu_si512(r + 2 * n), r3 = _mm512_loadu_si512(r + 3 * n);
      const __m512i t0 = _mm512_unpacklo_epi8(r0, r1), t1 = _mm512_unpackhi_epi8(r0, r1);
      const __m512i t2 = _mm512_unpacklo_epi8(r2, r3), t3 = _mm512_unpackhi_epi8(r2, r3);
      // u_j, 128-bit lane l: columns 16 l + 4 j .. + 3, each as 4 consecutive k
      const __m512i u0 = _mm512_unpacklo_epi16(t0, t2), u1 = _mm512_unpackhi_epi16(t0, t2);
      const __m512i u2 = _mm512_unpacklo_epi16(t1, t3), u3 = _mm512_unpackhi_epi16(t1, t3);
      const __m512i v0 = _mm512_shuffle_i32x4(u0, u1, 0x44), v1 = _mm512_shuffle_i32x4(u0, u1, 0xEE);
      const __m512i v2 = _mm512_shuffle_i32x4(u2, u3, 0x44), v3 = _mm512_shuffle_i32x4(u2, u3, 0xEE);
      const __m512i o0 = _mm512_shuffle_i32x4(v0, v2, 0x88), o1 = _mm512_shuffle_i32x4(v0, v2, 0xDD);
      const __m512i o2 = _mm512_shuffle_i32x4(v1, v3, 0x88), o3 = _mm512_shuffle_i32x4(v1, v3, 0xDD);
      _mm512_storeu_si512(dst, o0);
      _mm512_storeu_si512(dst + 64, o1);
      _mm512_storeu_si512(dst + 128, o2);
      _mm512_storeu_si512(dst + 192, o3);
      s0 = _mm512_dpbusd_epi32(s0, ones, o0);
      s1 = _mm512_dpbusd_epi32(s1, ones, o1);
      s2 = _mm512_dpbusd_epi32(s2, ones, o2);
      s3 = _mm512_dpbusd_epi32(s3, ones, o3);
      mins |= _mm512_cmpeq_epi8_mask(_mm512_or_si512(_mm512_min_epi8(r0, r1), _mm512_min_epi8(r2, r3)),
                                     _mm512_set1_epi8(-128));
    }
    holds_min = mins != 0;
    _mm512_store_si512(sum, s0);
    _mm512_store_si512(sum + 16, s1);
    _mm512_store_si512(sum + 32, s2);
    _mm512_store_si512(sum + 48, s3);
#elif defined(__AVX2__)
    // interior: two 4 x 32 byte transposes per step; column sums of 4 bytes per 32-bit lane
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    const __m256i min8 = _mm256_set1_epi8(-128);
    __m256i s8[8], mins = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) s8[i] = _mm256_setzero_si256();
    for (; q * 4 + 4 <= k; ++q, dst += kNR * 4)
      for (int half = 0; half < 2; ++half) {
        const int8_t *r = b + q * 4 * n + c0 + half * 32;
        const __m256i r0 = _mm256_loadu_si256((const __m256i *)r);
        const __m256i r1 = _mm256_loadu_si256((const __m256i *)(r + n));
        const __m256i r2 = _mm256_loadu_si256((const __m256i *)(r + 2 * n));
        const __m256i r3 = _mm256_loadu_si256((const __m256i *)(r + 3 * n));
        const __m256i t0 = _mm256_unpacklo_epi8(r0, r1), t1 = _mm256_unpackhi_epi8(r0, r1);
        const __m256i t2 = _mm256_unpacklo_epi8(r2, r3), t3 = _mm256_unpackhi_epi8(r2, r3);
        // u_j, 128-bit lane l: columns 16 l + 4 j .. + 3, each as 4 consecutive k
        const __m256i u0 = _mm256_unpacklo_epi16(t0, t2), u1 = _mm256_unpackhi_epi16(t0, t2);
        const __m256i u2 = _mm256_unpacklo_epi16(t1, t3), u3 = _mm256_unpackhi_epi16(t1, t3);
        const __m256i o[4] = {_mm256_permute2x128_si256(u0, u1, 0x20),
                              _mm256_permute2x128_si256(u2, u3, 0x20),
                              _mm256_permute2x128_si256(u0, u1, 0x31),
                              _mm256_permute2x128_si256(u2, u3, 0x31)};
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_si256((__m256i *)(dst + half * 128 + i * 32), o[i]);
          mins = _mm256_or_si256(mins, _mm256_cmpeq_epi8(o[i], min8));
          // (1 x |byte| pairs never saturate 16 bits; the sums serve only the x + 128 paths)
          if (kFlip)
            s8[half * 4 + i] = _mm256_add_epi32(
                s8[half * 4 + i], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, o[i]), ones16));
        }
      }
    for (int i = 0; i < 8; ++i) _mm256_store_si256((__m256i *)(sum + i * 8), s8[i]);
    holds_min = !_mm256_testz_si256(mins, mins);
#else
    for (; q * 4 + 4 <= k; ++q, dst += kNR * 4) {
      const int8_t *r0 = b + q * 4 * n + c0, *r1 = r0 + n, *r2 = r1 + n, *r3 = r2 + n;
      for (int j = 0; j < kNR; ++j) {
        dst[j * 4] = r0[j];
        dst[j * 4 + 1] = r1[j];
        dst[j * 4 + 2] = r2[j];
        dst[j * 4 + 3] = r3[j];
        sum[j] += r0[j] + r1[j] + r2[j] + r3[j];
        holds_min |= std::min({r0[j], r1[j], r2[j], r3[j]}) == -128;
      }
    }
#endif
  }
  // the last columns or rows, zero-padded
  for (; q < (k + 3) / 4; ++q, dst += kNR * 4)
    for (int64_t j = 0; j < kNR; ++j)
      for (int64_t t = 0; t < 4; ++t) {
        const int64_t row = q * 4 + t, col = c0 + j;
        const int8_t v = (row < k && col < n) ? b[row * n + col] : 0;
        dst[j * 4 + t] = v;
        sum[j] += v;
        holds_min |= v == -128;
      }
  const uint32_t correction = kFlip ? 128u : 0u;
  for (int64_t j = 0; j < kNR && c0 + j < n; ++j)
    bias_out[j] = static_cast<int32_t>((bias ? static_cast<uint32_t>(bias[c0 + j]) : 0u) -
                                       correction * static_cast<uint32_t>(sum[j]));
  return holds_min;
}

// Scratch memory kept between calls, one set per calling thread: fresh buffers the size of the
// weights would page-fault on every call, which costs more than packing them.
enum Slot { kXSlot, kQSlot, kW1Slot, kW2Slot, kSlots };

template <typename T>
T *scratch(Slot slot, int64_t n) {
  thread_local std::vector<uint8_t> buffers[kSlots];
  std::vector<uint8_t> &b = buffers[slot];
  if (b.size() < static_cast<size_t>(n) * sizeof(T)) {
    b = std::vector<uint8_t>();
    b.resize(static_cast<size_t>(n) * sizeof(T));
  }
  return reinterpret_cast<T *>(b.data());
}

// B [E, K, N] of every expert packed by pack_panel: expert e's panel p at panel(e, p); bias[e]
// (N entries) holds the corrected bias. Per panel e * panels + p, on the avx2 path: holds_min,
// whether it holds -128 (and takes tile_wide), or the places of its -128 weights that
// spare_minimums replaced.
struct PackedWeights {
  int64_t k, n, k4, panels;
  Panel *data;  // written only for the experts that have rows
  std::vector<int32_t> bias;
  std::vector<uint8_t> holds_min;
  std::vector<std::vector<uint32_t>> places;

  PackedWeights(Slot slot, int64_t e, int64_t k_, int64_t n_)
      : k(k_), n(n_), k4((k_ + 3) / 4), panels((n_ + kNR - 1) / kNR),
        data(scratch<Panel>(slot, e * panels * k4 * kNR * 4)), bias(e * n_),
        holds_min(e * panels), places(e * panels) {}
  const Panel *panel(int64_t e, int64_t p) const { return data + (e * panels + p) * k4 * kNR * 4; }
  Panel *panel(int64_t e, int64_t p) { return data + (e * panels + p) * k4 * kNR * 4; }
};

#if defined(MOE_INT8_SIGN)
// tile for a panel that holds -128: both operands widened to 16 bits on the fly, vpmaddwd sums
// their products in pairs into 32 bits (exact for every byte); a vector holds 4 columns x 2
// partial sums, added at the end. Slower than tile; the package's own quantisation never gives
// a weight -128.
void tile_wide(const Row *const *a, const Panel *b, int64_t k4, int32_t (*acc)[kNR]) {
  for (int r = 0; r < kMR; ++r)
    for (int half = 0; half < 2; ++half) {
      __m256i c[8];
      for (__m256i &v : c) v = _mm256_setzero_si256();
      for (int64_t q = 0; q < k4; ++q) {
        int32_t four;
        std::memcpy(&four, a[r] + q * 4, 4);
        const __m256i av = _mm256_broadcastq_epi64(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(four)));
        const Panel *bq = b + q * kNR * 4 + half * 128;
        for (int j = 0; j < 8; ++j)
          c[j] = _mm256_add_epi32(c[j], _mm256_madd_epi16(av, _mm256_cvtepi8_epi16(
                                                              _mm_loadu_si128((const __m128i *)(bq + j * 16)))));
      }
      // pair sums -> columns in order: hadd gives c0 c1 c4 c5 | c2 c3 c6 c7 of two vectors
      for (int v = 0; v < 8; v += 2)
        _mm256_storeu_si256((__m256i *)(acc[r] + half * 32 + v * 4),
                            _mm256_permute4x64_epi64(_mm256_hadd_epi32(c[v], c[v + 1]), 0xD8));
    }
}

// A packed panel's -128 weights, when there are at most k4 of them (one per 4 rows of K: a
// few per column, as quantisers over all of int8 make them): each becomes -127 and its place is
// recorded, and gemm subtracts a[k] for each from tile's sums (a * -128 = a * -127 - a), which
// keeps the panel on the fast product. Returns false, the panel unchanged, when there are more.
bool spare_minimums(Panel *panel, int64_t k4, std::vector<uint32_t> &places) {
  const int64_t bytes = k4 * kNR * 4;  // (a multiple of 256)
  const __m256i min8 = _mm256_set1_epi8(-128);
  auto minimums = [&](int64_t i) {
    return static_cast<uint32_t>(_mm256_movemask_epi8(
        _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(panel + i)), min8)));
  };
  int64_t count = 0;
  for (int64_t i = 0; i < bytes; i += 32) count += __builtin_popcount(minimums(i));
  if (count > k4) return false;
  for (int64_t i = 0; i < bytes; i += 32)
    for (uint32_t mask = minimums(i); mask; mask &= mask - 1) {
      const int64_t place = i + __builtin_ctz(mask);
      panel[place] = -127;
      places.push_back(static_cast<uint32_t>(place));
    }
  return true;
}
#endif

// acc[r][j] = sum_k a_r[k] * B[k, panel column j] for kMR rows (a as fed: q ^ kFlip; K padded
// to 4).
void tile(const Row *const *a, const Panel *b, int64_t k4, int32_t (*acc)[kNR]) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  // Named accumulators: GCC spills an array of vectors to the stack on every step.
  static_assert(kMR == 6 && kNR == 64, "the register tile below is 6 x 64");
#define MOE_ROW(r) __m512i c##r##0 = _mm512_setzero_si512(), c##r##1 = c##r##0, c##r##2 = c##r##0, \
                           c##r##3 = c##r##0;
  MOE_ROW(0) MOE_ROW(1) MOE_ROW(2) MOE_ROW(3) MOE_ROW(4) MOE_ROW(5)
#undef MOE_ROW
  for (int64_t q = 0; q < k4; ++q) {
    const int8_t *bq = b + q * kNR * 4;
    const __m512i b0 = _mm512_loadu_si512(bq), b1 = _mm512_loadu_si512(bq + 64);
    const __m512i b2 = _mm512_loadu_si512(bq + 128), b3 = _mm512_loadu_si512(bq + 192);
#define MOE_ROW(r)                                           \
  {                                                          \
    int32_t four;                                            \
    std::memcpy(&four, a[r] + q * 4, 4);                     \
    const __m512i av = _mm512_set1_epi32(four);              \
    c##r##0 = _mm512_dpbusd_epi32(c##r##0, av, b0);          \
    c##r##1 = _mm512_dpbusd_epi32(c##r##1, av, b1);          \
    c##r##2 = _mm512_dpbusd_epi32(c##r##2, av, b2);          \
    c##r##3 = _mm512_dpbusd_epi32(c##r##3, av, b3);          \
  }
    MOE_ROW(0) MOE_ROW(1) MOE_ROW(2) MOE_ROW(3) MOE_ROW(4) MOE_ROW(5)
#undef MOE_ROW
  }
#define MOE_ROW(r)                                  \
  _mm512_storeu_si512(acc[r], c##r##0);             \
  _mm512_storeu_si512(acc[r] + 16, c##r##1);        \
  _mm512_storeu_si512(acc[r] + 32, c##r##2);        \
  _mm512_storeu_si512(acc[r] + 48, c##r##3);
  MOE_ROW(0) MOE_ROW(1) MOE_ROW(2) MOE_ROW(3) MOE_ROW(4) MOE_ROW(5)
#undef MOE_ROW
#elif defined(__AVXVNNI__)
  // vpdpbusd on 8 columns x 4 k per vector: 3 rows x 32 columns at a time (12 accumulators;
  // the panel is read from memory by the instruction itself)
  for (int half = 0; half < 2; ++half)
    for (int r0 = 0; r0 < kMR; r0 += 3) {
      __m256i c[3][4];
      for (int r = 0; r < 3; ++r)
        for (int j = 0; j < 4; ++j) c[r][j] = _mm256_setzero_si256();
      for (int64_t q = 0; q < k4; ++q) {
        const int8_t *bq = b + q * kNR * 4 + half * 128;
        for (int r = 0; r < 3; ++r) {
          int32_t four;
          std::memcpy(&four, a[r0 + r] + q * 4, 4);
          const __m256i av = _mm256_set1_epi32(four);
          for (int j = 0; j < 4; ++j)
            c[r][j] = _mm256_dpbusd_avx_epi32(c[r][j], av,
                                              _mm256_loadu_si256((const __m256i *)(bq + j * 32)));
        }
      }
      for (int r = 0; r < 3; ++r)
        for (int j = 0; j < 4; ++j)
          _mm256_storeu_si256((__m256i *)(acc[r0 + r] + half * 32 + j * 8), c[r][j]);
    }
#elif defined(MOE_INT8_SIGN)
  // vpmaddubsw multiplies unsigned by signed bytes into 16-bit pair sums that saturate; fed
  // |a| (unsigned, at most 128, stored after the row) and sign(a) * b (vpsignb), a pair sum is
  // at most 2 * 128 * 127 = 32512 in magnitude, exact, as long as b is never -128, whose negation
  // does not fit a byte (a panel's few -128 are replaced by spare_minimums, a panel with more
  // goes to tile_wide). vpmaddwd with ones then
  // sums pairs into 32 bits. A vector holds 8 columns x 4 k; 3 rows x 16 columns at a time, two
  // k-quads per step. K is walked in blocks of kBlock k-quads, whose 16-column strips (8 KiB)
  // stay in L1 while both row triples use them; the sums wait in acc between blocks.
  constexpr int64_t kBlock = 128;  // (even: the k-quads pair up within a block)
  if (k4 == 0) std::memset(acc, 0, sizeof(int32_t) * kMR * kNR);  // (K = 0: no block runs)
  const __m256i ones = _mm256_set1_epi16(1);
  // 16-bit pair sums of the 8 columns at bk with the 4 bytes of a row at ak
  auto pairs = [k4](const Row *ak, const Panel *bk) {
    int32_t four, magnitudes;
    std::memcpy(&four, ak, 4);
    std::memcpy(&magnitudes, ak + k4 * 4, 4);
    return _mm256_maddubs_epi16(_mm256_set1_epi32(magnitudes),
                                _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)bk),
                                                 _mm256_set1_epi32(four)));
  };
  for (int64_t q0 = 0; q0 < k4; q0 += kBlock) {
    const int64_t q1 = std::min(k4, q0 + kBlock);
    for (int c0 = 0; c0 < kNR; c0 += 16)
      for (int r0 = 0; r0 < kMR; r0 += 3) {
        __m256i c[3][2];
        for (int r = 0; r < 3; ++r)
          for (int j = 0; j < 2; ++j)
            c[r][j] = q0 == 0 ? _mm256_setzero_si256()
                              : _mm256_loadu_si256((const __m256i *)(acc[r0 + r] + c0 + j * 8));
        const Panel *bq = b + q0 * kNR * 4 + c0 * 4;
        int64_t q = q0;
        for (; q + 2 <= q1; q += 2, bq += 2 * kNR * 4)
          for (int r = 0; r < 3; ++r)
            for (int j = 0; j < 2; ++j) {
              const Row *ak = a[r0 + r] + q * 4;
              const __m256i p = pairs(ak, bq + j * 32), t = pairs(ak + 4, bq + kNR * 4 + j * 32);
              c[r][j] = _mm256_add_epi32(c[r][j], _mm256_add_epi32(_mm256_madd_epi16(p, ones),
                                                                   _mm256_madd_epi16(t, ones)));
            }
        if (q < q1)
          for (int r = 0; r < 3; ++r)
            for (int j = 0; j < 2; ++j)
              c[r][j] = _mm256_add_epi32(
                  c[r][j], _mm256_madd_epi16(pairs(a[r0 + r] + q * 4, bq + j * 32), ones));
        for (int r = 0; r < 3; ++r)
          for (int j = 0; j < 2; ++j)
            _mm256_storeu_si256((__m256i *)(acc[r0 + r] + c0 + j * 8), c[r][j]);
      }
  }
#elif defined(__ARM_FEATURE_DOTPROD)
  // SDOT on 4 columns x 4 k per vector (signed bytes): 3 rows x 16 columns at a time
  for (int quarter = 0; quarter < 4; ++quarter)
    for (int r0 = 0; r0 < kMR; r0 += 3) {
      int32x4_t c[3][4];
      for (int r = 0; r < 3; ++r)
        for (int j = 0; j < 4; ++j) c[r][j] = vdupq_n_s32(0);
      for (int64_t q = 0; q < k4; ++q) {
        const int8_t *bq = b + q * kNR * 4 + quarter * 64;
        const int8x16_t bv[4] = {vld1q_s8(bq), vld1q_s8(bq + 16), vld1q_s8(bq + 32), vld1q_s8(bq + 48)};
        for (int r = 0; r < 3; ++r) {
          int32_t four;
          std::memcpy(&four, a[r0 + r] + q * 4, 4);
          const int8x16_t av = vreinterpretq_s8_s32(vdupq_n_s32(four));
          for (int j = 0; j < 4; ++j) c[r][j] = vdotq_s32(c[r][j], bv[j], av);
        }
      }
      for (int r = 0; r < 3; ++r)
        for (int j = 0; j < 4; ++j) vst1q_s32(acc[r0 + r] + quarter * 16 + j * 4, c[r][j]);
    }
#elif defined(__aarch64__)
  // NEON without the dot product: 8 x 8 -> 16-bit products (exact), pairwise added into 32 bits
  for (int r = 0; r < kMR; ++r)
    for (int quarter = 0; quarter < 4; ++quarter) {
      int32x4_t lo[4], hi[4];
      for (int j = 0; j < 4; ++j) lo[j] = hi[j] = vdupq_n_s32(0);
      for (int64_t q = 0; q < k4; ++q) {
        const int8_t *bq = b + q * kNR * 4 + quarter * 64;
        int32_t four;
        std::memcpy(&four, a[r] + q * 4, 4);
        const int8x16_t av = vreinterpretq_s8_s32(vdupq_n_s32(four));
        for (int j = 0; j < 4; ++j) {
          const int8x16_t bv = vld1q_s8(bq + j * 16);
          lo[j] = vpadalq_s16(lo[j], vmull_s8(vget_low_s8(av), vget_low_s8(bv)));
          hi[j] = vpadalq_s16(hi[j], vmull_high_s8(av, bv));
        }
      }
      for (int j = 0; j < 4; ++j) vst1q_s32(acc[r] + quarter * 16 + j * 4, vpaddq_s32(lo[j], hi[j]));
    }
#else
  // Portable version of the same arithmetic (uint32 sums wrap like the instruction's).
  for (int r = 0; r < kMR; ++r) {
    uint32_t c[kNR] = {};
    for (int64_t q = 0; q < k4; ++q)
      for (int j = 0; j < kNR; ++j)
        for (int t = 0; t < 4; ++t)
          c[j] += static_cast<uint32_t>(a[r][q * 4 + t] * b[(q * kNR + j) * 4 + t]);
    for (int j = 0; j < kNR; ++j) acc[r][j] = static_cast<int32_t>(c[j]);
  }
#endif
}

// Work below this many multiply-adds (about 0.2 ms on one core) runs on one thread: a parallel
// region costs more, and much more when the cores are shared with other processes.
constexpr int64_t kParallelWork = int64_t(1) << 26;

// A unit of a product: rows r0..r1 (one expert's, at most kRowChunk) times one panel.
struct Task {
  int64_t e, p, r0, r1;
};

std::vector<Task> tasks(const std::vector<int64_t> &offsets, int64_t panels) {
  std::vector<Task> out;
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t r = offsets[e]; r < offsets[e + 1]; r += kRowChunk)
        out.push_back({static_cast<int64_t>(e), p, r, std::min(offsets[e + 1], r + kRowChunk)});
  return out;
}

// Every expert's C = A [its rows of a, row stride lda, unsigned] x B[e], handing every
// kMR x kNR tile of int32 sums to store(expert, row, first column, rows, columns, acc). Every
// output element is computed by one task in a fixed order, so the result does not depend on
// which thread runs which task: the dynamic schedule keeps the cores busy when they are shared.
template <typename Store>
void gemm(const Row *a, int64_t lda, const std::vector<int64_t> &offsets,
          const PackedWeights &b, Store &&store) {
  const std::vector<Task> work = tasks(offsets, b.panels);
  const int64_t n = static_cast<int64_t>(work.size());
  const bool parallel = offsets.back() * b.k * b.n >= kParallelWork;
#pragma omp parallel for schedule(dynamic) if (parallel)
  for (int64_t t = 0; t < n; ++t) {
    const Task &w = work[t];
    alignas(64) int32_t acc[kMR][kNR];
    const int64_t c0 = w.p * kNR;
    const int cols = static_cast<int>(std::min<int64_t>(kNR, b.n - c0));
    for (int64_t i = w.r0; i < w.r1; i += kMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kMR, w.r1 - i));
      const Row *rp[kMR];
      for (int r = 0; r < kMR; ++r) rp[r] = a + (i + std::min(r, rows - 1)) * lda;
#if defined(MOE_INT8_SIGN)
      if (b.holds_min[w.e * b.panels + w.p]) {
        tile_wide(rp, b.panel(w.e, w.p), b.k4, acc);
      } else {
        tile(rp, b.panel(w.e, w.p), b.k4, acc);
        for (const uint32_t place : b.places[w.e * b.panels + w.p]) {  // (see spare_minimums)
          const int64_t k = place / (kNR * 4) * 4 + place % 4;
          const int j = static_cast<int>(place / 4 % kNR);
          for (int r = 0; r < kMR; ++r)
            acc[r][j] = static_cast<int32_t>(static_cast<uint32_t>(acc[r][j]) -
                                             static_cast<uint32_t>(static_cast<int8_t>(rp[r][k])));
        }
      }
#else
      tile(rp, b.panel(w.e, w.p), b.k4, acc);
#endif
      store(w.e, i, c0, rows, cols, acc);
    }
  }
}

// round half to even, then saturate to int8; NaN becomes 0.
inline int8_t saturate_int8(float v) {
  const float r = std::nearbyint(v);
  if (!(r == r)) return 0;
  return static_cast<int8_t>(std::min(127.f, std::max(-128.f, r)));
}

#if defined(__AVX512F__) || defined(__AVX2__)
// Vector versions of `activate` for the requantising store (the scalar calls to expf would cost
// more than the matrix product), written once over the path's float vector (vf: 16 lanes of
// AVX-512 or 8 of AVX2). exp: Cephes' polynomial, within 2 ulp of expf.
#if defined(__AVX512F__)
using vf = __m512;
inline vf set1(float v) { return _mm512_set1_ps(v); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf rint(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf times_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
#else
using vf = __m256;
inline vf set1(float v) { return _mm256_set1_ps(v); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf rint(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n, n integral in [-126, 127] (after exp_ps's clamp): 2^n built in the exponent bits
inline vf times_pow2(vf p, vf n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

inline vf exp_ps(vf x) {
  x = min(max(x, set1(-87.f)), set1(88.f));
  const vf n = rint(mul(x, set1(1.44269504f)));
  vf r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vf p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.f)));
  return times_pow2(p, n);
}

inline vf sigmoid_ps(vf z) {
  const vf one = set1(1.f);
  return div(one, add(one, exp_ps(mul(set1(-1.f), z))));
}

inline vf activate_ps(Activation act, vf x) {
  switch (act) {
    case Activation::kFastGelu: return mul(x, sigmoid_ps(mul(set1(1.702f), x)));
    case Activation::kGelu: {
      const vf in = fmadd(set1(0.044715f), mul(mul(x, x), x), x);
      return mul(x, sigmoid_ps(mul(set1(1.59576912f), in)));
    }
    case Activation::kRelu: return max(x, set1(0.f));
    case Activation::kSilu: return mul(x, sigmoid_ps(x));
    default: return x;
  }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 values of the requantising store (see requantise); returns q ^ kFlip as 8 bytes.
inline __m128i requantise8(__m256i sum, __m256 deq, Activation act, float s, float o) {
  __m256 v = _mm256_fmadd_ps(activate_ps(act, _mm256_mul_ps(_mm256_cvtepi32_ps(sum), deq)),
                             _mm256_set1_ps(s), _mm256_set1_ps(o));
  v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));  // NaN -> 0
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-128.f)), _mm256_set1_ps(127.f));
  const __m256i q = _mm256_cvtps_epi32(v);  // (round half to even: the default rounding mode)
  const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  return _mm_xor_si128(_mm_packs_epi16(q16, q16), _mm_set1_epi8(static_cast<char>(kFlip)));
}

// 8 such bytes stored as Rows.
inline void store8(Row *dst, __m128i bytes) { _mm_storel_epi64((__m128i *)dst, bytes); }
#endif

// One row of the first product's store: dst[j] = q ^ kFlip with
// q = int8(rint(act(float(acc[j] + bias[j]) * deq[j]) * s + o)).
inline void requantise(const int32_t *acc, const int32_t *bias, const float *deq, int cols,
                       Activation act, float s, float o, Row *dst) {
  int j = 0;
#if defined(__AVX512F__)
  for (; j < cols; j += 16) {
    const __mmask16 m = cols - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - j)) - 1);
    const __m512i sum = _mm512_add_epi32(_mm512_loadu_si512(acc + j),
                                         _mm512_maskz_loadu_epi32(m, bias + j));
    const __m512 hv = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_maskz_loadu_ps(m, deq + j));
    __m512 v = _mm512_fmadd_ps(activate_ps(act, hv), _mm512_set1_ps(s), _mm512_set1_ps(o));
    v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);  // NaN -> 0
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-128.f)), _mm512_set1_ps(127.f));
    const __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_mask_cvtepi32_storeu_epi8(dst + j, m, _mm512_xor_si512(q, _mm512_set1_epi32(kFlip)));
  }
#elif defined(__AVX2__)
  for (; j + 8 <= cols; j += 8) {
    const __m256i sum = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(acc + j)),
                                         _mm256_loadu_si256((const __m256i *)(bias + j)));
    store8(dst + j, requantise8(sum, _mm256_loadu_ps(deq + j), act, s, o));
  }
  if (j < cols) {  // the last columns through the same vector code (every value alike)
    alignas(32) int32_t sums[8] = {};
    alignas(32) float d[8] = {};
    alignas(32) Row out[16];
    for (int t = 0; j + t < cols; ++t) {
      sums[t] = static_cast<int32_t>(static_cast<uint32_t>(acc[j + t]) + static_cast<uint32_t>(bias[j + t]));
      d[t] = deq[j + t];
    }
    store8(out, requantise8(_mm256_load_si256((const __m256i *)sums), _mm256_load_ps(d), act, s, o));
    std::memcpy(dst + j, out, (cols - j) * sizeof(Row));
    j = cols;
  }
#endif
  for (; j < cols; ++j) {
    const int32_t sum = static_cast<int32_t>(static_cast<uint32_t>(acc[j]) +
                                             static_cast<uint32_t>(bias[j]));
    const float hv = static_cast<float>(sum) * deq[j];
    dst[j] = static_cast<uint8_t>(saturate_int8(std::fma(activate(act, hv), s, o)) ^ kFlip);
  }
}

struct Int8Args {
  Arg x, tokens, w1, b1, w2, b2, scale, offset, dq1, dq2, y;
};

int check(const Int8Args &a) {
  auto is_int = [](const Arg &t, DType d) { return given(t) && t.dtype == d; };
  auto is_deq = [](const Arg &t) {
    return given(t) && (t.dtype == DType::kU64 || t.dtype == DType::kF32);
  };
  if (!is_int(a.x, DType::kI8) || !is_int(a.w1, DType::kI8) || !is_int(a.w2, DType::kI8) ||
      !is_int(a.tokens, DType::kI64) || !is_int(a.scale, DType::kF32) || !is_deq(a.dq1) ||
      !is_deq(a.dq2) || (given(a.b1) && a.b1.dtype != DType::kI32) ||
      (given(a.b2) && a.b2.dtype != DType::kI32) ||
      (given(a.offset) && a.offset.dtype != DType::kF32) || !is_float(a.y.dtype))
    return fail(kOp, "int8 path: x, weight1, weight2 int8, bias1/bias2 int32, expert_tokens "
                     "int64, scale/offset float32, deq_scale1/2 uint64 or float32 and a float y "
                     "are required");
  const Arg all[] = {a.x, a.tokens, a.w1, a.b1, a.w2, a.b2, a.scale, a.offset, a.dq1, a.dq2, a.y};
  for (const Arg &t : all)
    if (given(t))
      if (int rc = check_sound(kOp, "an argument", t)) return rc;
  if (a.x.ndim != 2 || a.w1.ndim != 3 || a.w2.ndim != 3 || a.y.ndim != 2 || a.tokens.ndim != 1)
    return fail(kOp, "int8 path: x [M, H], weight1 [E, H, F], weight2 [E, F, H], y [M, H] expected");
  const int64_t m = a.x.dim(0), h = a.x.dim(1), e = a.tokens.dim(0), f = a.w1.dim(2);
  if (e < 1 || e > kMaxFfnExperts)
    return fail(kOp, "the expert count E (expert_tokens.shape[0]) must be in [1, %lld], got %lld",
                (long long)kMaxFfnExperts, (long long)e);
  auto is = [](const Arg &t, std::initializer_list<int64_t> s) {
    if (t.ndim != static_cast<int>(s.size())) return false;
    int i = 0;
    for (int64_t v : s)
      if (t.dim(i++) != v) return false;
    return true;
  };
  if (!is(a.w1, {e, h, f}) || !is(a.w2, {e, f, h}) || !is(a.y, {m, h}) ||
      (a.b1.present() && !is(a.b1, {e, f})) || (a.b2.present() && !is(a.b2, {e, h})) ||
      !is(a.scale, {e}) || (a.offset.present() && !is(a.offset, {e})) || !is(a.dq1, {e, f}) ||
      !is(a.dq2, {e, h}))
    return fail(kOp, "int8 path: argument shapes do not match x [%lld, %lld], E = %lld, F = %lld",
                (long long)m, (long long)h, (long long)e, (long long)f);
  return 0;
}

template <typename T>
int run(const Int8Args &a, Activation act, const std::vector<int64_t> &offsets) {
  const int64_t m = a.x.dim(0), h = a.x.dim(1), e = a.tokens.dim(0), f = a.w1.dim(2);
  const int64_t hp = round_up(h, 4), fp = round_up(f, 4);
  const std::vector<float> dq1 = deq_scales(a.dq1), dq2 = deq_scales(a.dq2);
  const bool parallel = m * h * f >= kParallelWork;

  // x ^ kFlip (x + 128 as unsigned bytes on the VNNI paths); the rows of x and of q are padded to a
  // multiple of 4 with zeros (they meet the zero padding of the packed weights), row strides
  // xld and qld (room for the absolute values on the avx2 path).
  const int64_t xld = hp * kRowCopies, qld = fp * kRowCopies;
  Row *xu = scratch<Row>(kXSlot, m * xld), *qu = scratch<Row>(kQSlot, m * qld);
  const int8_t *x = a.x.as<int8_t>();
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t k = 0; k < h; ++k) xu[i * xld + k] = static_cast<uint8_t>(x[i * h + k] ^ kFlip);
    std::fill(xu + i * xld + h, xu + i * xld + hp, 0);
    std::fill(qu + i * qld + f, qu + i * qld + fp, 0);
    if (kRowCopies == 2) absolute_values(xu, xld, hp, i, i + 1);
  }

  // both weights of every expert that has rows
  PackedWeights w1(kW1Slot, e, h, f), w2(kW2Slot, e, f, h);
  struct PackTask {
    int64_t e, p;
    bool second;
  };
  std::vector<PackTask> packs;
  for (int64_t ex = 0; ex < e; ++ex) {
    if (offsets[ex] == offsets[ex + 1]) continue;
    for (int64_t p = 0; p < w1.panels; ++p) packs.push_back({ex, p, false});
    for (int64_t p = 0; p < w2.panels; ++p) packs.push_back({ex, p, true});
  }
  const int32_t *b1 = a.b1.present() ? a.b1.as<int32_t>() : nullptr;
  const int32_t *b2 = a.b2.present() ? a.b2.as<int32_t>() : nullptr;
#pragma omp parallel for schedule(dynamic) if (parallel)
  for (int64_t t = 0; t < static_cast<int64_t>(packs.size()); ++t) {
    const PackTask &pk = packs[t];
    PackedWeights &w = pk.second ? w2 : w1;
    const int64_t k = pk.second ? f : h, n = pk.second ? h : f;
    const int8_t *src = (pk.second ? a.w2.as<int8_t>() : a.w1.as<int8_t>()) + pk.e * k * n;
    const int32_t *bias = pk.second ? b2 : b1;
    const int64_t i = pk.e * w.panels + pk.p;
    w.holds_min[i] = pack_panel(src, k, n, pk.p * kNR, bias ? bias + pk.e * n : nullptr,
                                w.panel(pk.e, pk.p), w.bias.data() + pk.e * n + pk.p * kNR);
#if defined(MOE_INT8_SIGN)
    if (w.holds_min[i]) w.holds_min[i] = !spare_minimums(w.panel(pk.e, pk.p), w.k4, w.places[i]);
#endif
  }

  // h = (x @ w1 + b1) * dq1; q = int8(rint(act(h) * scale + offset)), stored as q + 128
  const float *scale = a.scale.as<float>();
  const float *offset = a.offset.present() ? a.offset.as<float>() : nullptr;
  gemm(xu, xld, offsets, w1, [&](int64_t ex, int64_t i, int64_t c0, int rows, int cols,
                                const int32_t (*acc)[kNR]) {
    const float s = scale[ex], o = offset ? offset[ex] : 0.f;
    for (int r = 0; r < rows; ++r)
      requantise(acc[r], w1.bias.data() + ex * f + c0, dq1.data() + ex * f + c0, cols, act, s, o,
                 qu + (i + r) * qld + c0);
  });
  if (kRowCopies == 2) {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < m; i += 64) absolute_values(qu, qld, fp, i, std::min(m, i + 64));
  }

  // y = (q @ w2 + b2) * dq2
  T *y = a.y.as<T>();
  gemm(qu, qld, offsets, w2, [&](int64_t ex, int64_t i, int64_t c0, int rows, int cols,
                                const int32_t (*acc)[kNR]) {
    const int32_t *bias = w2.bias.data() + ex * h + c0;
    const float *d2 = dq2.data() + ex * h + c0;
    for (int r = 0; r < rows; ++r) {
      T *dst = y + (i + r) * h + c0;
      for (int j = 0; j < cols; ++j) {
        const int32_t sum = static_cast<int32_t>(static_cast<uint32_t>(acc[r][j]) +
                                                 static_cast<uint32_t>(bias[j]));
        dst[j] = from_f32<T>(static_cast<float>(sum) * d2[j]);
      }
    }
  });
  zero_tail_rows(y, offsets[e], m, h);
  return 0;
}

}  // namespace

// params: x, expert_tokens, weight1, bias1, weight2, bias2, scale, offset, deq_scale1,
// deq_scale2, then y.
int moe_ffn_int8(const Args &args, Extra *extra) {
  if (int rc = check_count(kOp, args, 11)) return rc;
  const Int8Args a{args[0], args[1], args[2], args[3], args[4], args[5],
                   args[6], args[7], args[8], args[9], args[10]};
  if (int rc = check(a)) return rc;
  Activation act;
  if (int rc = check_activation(kOp, extra, &act)) return rc;
  std::vector<int64_t> offsets;
  if (int rc = expert_offsets(kOp, a.tokens, extra, a.x.dim(0), offsets)) return rc;
  return dispatch_float(kOp, a.y.dtype, [&](auto t) { return run<decltype(t)>(a, act, offsets); });
}

}  // namespace MOE_ISA_NS
}  // namespace moe
