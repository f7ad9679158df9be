// Matrix products for the grouped kernels (grouped_matmul, MoeFFN): one thread pool for the whole
// kernel, float32 views of float16/bfloat16 blocks, and the limits of the BLAS's 32-bit sizes.
//
// Products: the BLAS (scipy-openblas32), or on the avx512 path oneDNN's where the process has it
// (onednn.h): its AVX-512 sgemm, and for bfloat16 operands its bfloat16 dot-product GEMM, which
// takes them as they are (no float32 copy) and multiplies them exactly into float32 sums at twice
// the float32 FMA rate (vdpbf16ps, AMX). Lower paths keep the BLAS, as a CPU of their kind does.
//
// Threads: a grouped product is cut into tiles (a block of one group's rows, or of its output
// columns) whose bounds depend on the shapes only; the kernel's OpenMP threads take the tiles
// and each calls the BLAS single-threaded. One pool of threads then does all the work (the BLAS's
// own threads never compete with OpenMP's), and every output element is computed by the same
// call whatever the thread count: results are bit-identical from 1 to N threads.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "onednn.h"

namespace moe {
inline namespace MOE_ISA_NS {

// Rows of a float16/bfloat16 operand converted per block; bounds the float32 workspace.
constexpr int64_t kRowBlock = 512;

// oneDNN's products on this path (null: the BLAS and float32 conversions).
#if defined(__AVX512F__) && defined(__x86_64__)
inline onednn::Sgemm *onednn_sgemm() { return onednn::sgemm(); }
inline onednn::GemmBf16 *bf16_dot() { return onednn::gemm_bf16(); }
#else
inline onednn::Sgemm *onednn_sgemm() { return nullptr; }
inline onednn::GemmBf16 *bf16_dot() { return nullptr; }
#endif

// -- few rows: one pass over b ---------------------------------------------------------------------

// Rows of a up to which a product is a few matrix-vector products (decoding's shapes): b streams
// through once at memory speed, where a GEMM would pack it first (oneDNN's sgemm runs at a third
// of the memory bandwidth on one row). Every c element is one fixed-order sum over k.
constexpr int64_t kSkinnyRows = 16;

inline float skinny_out(float sum, float beta, const float *c) {
  return beta == 0.f ? sum : sum + beta * *c;
}

#if defined(__AVX512F__)
// AVX-512: blocks of I rows of a by J rows of b (trans_b) or by up to 1024 columns of b, I * J
// accumulators in registers, so each load of a or b feeds several FMAs.
template <int I, int J>
inline void skinny_dots(int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb,
                        float beta, float *c, int64_t ldc) {
  __m512 acc[I][J];
  for (int i = 0; i < I; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; p += 16) {
    const __mmask16 keep = k - p >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - p)) - 1);
    __m512 bj[J];
    for (int j = 0; j < J; ++j) bj[j] = _mm512_maskz_loadu_ps(keep, b + j * ldb + p);
    for (int i = 0; i < I; ++i) {
      const __m512 ai = _mm512_maskz_loadu_ps(keep, a + i * lda + p);
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_fmadd_ps(ai, bj[j], acc[i][j]);
    }
  }
  for (int i = 0; i < I; ++i)
    for (int j = 0; j < J; ++j)
      c[i * ldc + j] = skinny_out(_mm512_reduce_add_ps(acc[i][j]), beta, c + i * ldc + j);
}

// b [k, n] row by row: each row's block of up to kAxpyCols columns is one contiguous run, and a
// whole row makes b one sequential stream (a narrower block reads a few cache lines per row at
// the stride of a row, which the prefetchers do not follow across pages: half the bandwidth);
// the I x w sums stay in L1.
template <int I>
inline void skinny_axpys(int64_t k, int64_t w, const float *a, int64_t lda, const float *b,
                         int64_t ldb, float beta, float *c, int64_t ldc) {
  constexpr int V = 64;  // 1024 columns (I x 4 KB of sums)
  const int vs = (int)((w + 15) / 16);
  __m512 acc[I][V];
  __mmask16 keep[V];
  for (int v = 0; v < vs; ++v) {
    const int64_t left = std::min<int64_t>(16, w - 16 * v);
    keep[v] = (__mmask16)((1u << left) - 1);
    for (int i = 0; i < I; ++i) acc[i][v] = _mm512_setzero_ps();
  }
  int64_t p = 0;
  for (; p + 4 <= k; p += 4) {  // four rows of b per pass over the sums (the same order of FMAs)
    const float *bp = b + p * ldb;
    __m512 x[I][4];
    for (int i = 0; i < I; ++i)
      for (int q = 0; q < 4; ++q) x[i][q] = _mm512_set1_ps(a[i * lda + p + q]);
    for (int v = 0; v < vs; ++v) {
      __m512 bv[4];
      for (int q = 0; q < 4; ++q) bv[q] = _mm512_maskz_loadu_ps(keep[v], bp + q * ldb + 16 * v);
      for (int i = 0; i < I; ++i) {
        __m512 sum = acc[i][v];
        for (int q = 0; q < 4; ++q) sum = _mm512_fmadd_ps(x[i][q], bv[q], sum);
        acc[i][v] = sum;
      }
    }
  }
  for (; p < k; ++p) {
    const float *bp = b + p * ldb;
    __m512 x[I];
    for (int i = 0; i < I; ++i) x[i] = _mm512_set1_ps(a[i * lda + p]);
    for (int v = 0; v < vs; ++v) {
      const __m512 bv = _mm512_maskz_loadu_ps(keep[v], bp + 16 * v);
      for (int i = 0; i < I; ++i) acc[i][v] = _mm512_fmadd_ps(x[i], bv, acc[i][v]);
    }
  }
  for (int i = 0; i < I; ++i)
    for (int v = 0; v < vs; ++v) {
      float *ci = c + i * ldc + 16 * v;
      __m512 out = acc[i][v];
      if (beta != 0.f)
        out = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(keep[v], ci), out);
      _mm512_mask_storeu_ps(ci, keep[v], out);
    }
}
constexpr int64_t kAxpyCols = 1024;
#else
// Elsewhere: the same blocks in plain loops (vectorised by the compiler), one row of a at a time.
template <int I, int J>
inline void skinny_dots(int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb,
                        float beta, float *c, int64_t ldc) {
  const int64_t body = k / 16 * 16;
  for (int i = 0; i < I; ++i) {
    const float *ai = a + i * lda;
    float acc[J][16] = {};
    for (int64_t p = 0; p < body; p += 16)
      for (int j = 0; j < J; ++j)
        for (int l = 0; l < 16; ++l) acc[j][l] += ai[p + l] * b[j * ldb + p + l];
    for (int j = 0; j < J; ++j) {
      for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) acc[j][l] += acc[j][l + w];
      float sum = acc[j][0];
      for (int64_t p = body; p < k; ++p) sum += ai[p] * b[j * ldb + p];
      c[i * ldc + j] = skinny_out(sum, beta, c + i * ldc + j);
    }
  }
}

// As on AVX-512: up to kAxpyCols columns of b per pass (a whole row when n <= 1024: one
// sequential stream) and four rows of b per pass over the sums (a quarter of the sums' loads
// and stores); each sum in k order. (acc's 1024 is kAxpyCols, declared below as on AVX-512.)
template <int I>
inline void skinny_axpys(int64_t k, int64_t w, const float *a, int64_t lda, const float *b,
                         int64_t ldb, float beta, float *c, int64_t ldc) {
  float acc[I][1024] = {};
  int64_t p = 0;
  for (; p + 4 <= k; p += 4) {
    const float *b0 = b + p * ldb, *b1 = b0 + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb;
    for (int i = 0; i < I; ++i) {
      const float *ai = a + i * lda + p;
      const float x0 = ai[0], x1 = ai[1], x2 = ai[2], x3 = ai[3];
      float *acci = acc[i];
      for (int64_t j = 0; j < w; ++j) {
        float sum = acci[j];
        sum += x0 * b0[j];
        sum += x1 * b1[j];
        sum += x2 * b2[j];
        sum += x3 * b3[j];
        acci[j] = sum;
      }
    }
  }
  for (; p < k; ++p) {
    const float *bp = b + p * ldb;
    for (int i = 0; i < I; ++i) {
      const float x = a[i * lda + p];
      for (int64_t j = 0; j < w; ++j) acc[i][j] += x * bp[j];
    }
  }
  for (int i = 0; i < I; ++i)
    for (int64_t j = 0; j < w; ++j) c[i * ldc + j] = skinny_out(acc[i][j], beta, c + i * ldc + j);
}
constexpr int64_t kAxpyCols = 1024;
#endif

// c[i, j] = a[i, :] . b[j, :] + beta * c[i, j] over all m rows of a, in blocks of 8 and 4 rows,
// for J rows of b [n, k].
template <int J>
inline void skinny_dot_rows(int64_t m, int64_t k, const float *a, int64_t lda, const float *b,
                            int64_t ldb, float beta, float *c, int64_t ldc) {
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) skinny_dots<8, J>(k, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc);
  for (; i + 4 <= m; i += 4) skinny_dots<4, J>(k, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc);
  const float *ai = a + i * lda;
  float *ci = c + i * ldc;
  switch (m - i) {
    case 3: skinny_dots<3, J>(k, ai, lda, b, ldb, beta, ci, ldc); break;
    case 2: skinny_dots<2, J>(k, ai, lda, b, ldb, beta, ci, ldc); break;
    case 1: skinny_dots<1, J>(k, ai, lda, b, ldb, beta, ci, ldc); break;
    default: break;
  }
}

// c[:, :w] = a @ b[:, :w] + beta * c over all m rows of a, in blocks of up to 4 rows.
inline void skinny_axpy_rows(int64_t m, int64_t k, int64_t w, const float *a, int64_t lda,
                             const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) skinny_axpys<4>(k, w, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc);
  const float *ai = a + i * lda;
  float *ci = c + i * ldc;
  switch (m - i) {
    case 3: skinny_axpys<3>(k, w, ai, lda, b, ldb, beta, ci, ldc); break;
    case 2: skinny_axpys<2>(k, w, ai, lda, b, ldb, beta, ci, ldc); break;
    case 1: skinny_axpys<1>(k, w, ai, lda, b, ldb, beta, ci, ldc); break;
    default: break;
  }
}

// c[m, n] = a[m, k] @ op(b) + beta * c for m <= kSkinnyRows.
inline void skinny_gemm(bool trans_b, int64_t m, int64_t n, int64_t k, const float *a,
                        int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                        int64_t ldc) {
  if (trans_b) {  // b [n, k]: dot products, four rows of b at a time (three against blocks of
    int64_t j = 0;  // eight rows of a: 24 sums in registers; 10% faster at 8 rows on AVX-512)
    if (m >= 8)
      for (; j + 3 <= n; j += 3) skinny_dot_rows<3>(m, k, a, lda, b + j * ldb, ldb, beta, c + j, ldc);
    for (; j + 4 <= n; j += 4) skinny_dot_rows<4>(m, k, a, lda, b + j * ldb, ldb, beta, c + j, ldc);
    for (; j < n; ++j) skinny_dot_rows<1>(m, k, a, lda, b + j * ldb, ldb, beta, c + j, ldc);
    return;
  }
  // b [k, n]: each c row accumulates a[i, p] * b[p, :] over p, a block of columns at a time
  for (int64_t j = 0; j < n; j += kAxpyCols)
    skinny_axpy_rows(m, k, std::min(kAxpyCols, n - j), a, lda, b + j, ldb, beta, c + j, ldc);
}

// c[m, n] = op(a) @ op(b) + beta * c, row-major float32 (lda/ldb/ldc: row strides), in the
// calling thread.
inline void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float *a,
                  int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // empty sum: the BLAS would leave c untouched with beta = 1
    if (beta == 0.f)
      for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, sizeof(float) * n);
    return;
  }
  if (!trans_a && m <= kSkinnyRows) return skinny_gemm(trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
  if (onednn::Sgemm *f = onednn_sgemm())
    if (f(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, 1.f, a, lda, b, ldb, beta, c, ldc) == 0)
      return;
  scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                    trans_b ? CblasTrans : CblasNoTrans, (blasint)m, (blasint)n, (blasint)k, 1.f,
                    a, (blasint)lda, b, (blasint)ldb, beta, c, (blasint)ldc);
}

// The same for bfloat16 a and b through `dot` (bf16_dot()): every product of two bfloat16 values
// is exact in float32 and the sums are float32 (vdpbf16ps flushes float32 subnormals to zero).
inline void gemm_bf16(onednn::GemmBf16 *dot, bool trans_a, bool trans_b, int64_t m, int64_t n,
                      int64_t k, const bf16 *a, int64_t lda, const bf16 *b, int64_t ldb,
                      float beta, float *c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.f)
      for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, sizeof(float) * n);
    return;
  }
  if (dot(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, 1.f, &a->bits, lda, &b->bits, ldb,
          beta, c, ldc) == 0)
    return;
  // (oneDNN refused: the operands in float32, through sgemm)
  thread_local std::vector<float> af, bf;
  const int64_t ar = trans_a ? k : m, ac = trans_a ? m : k, br = trans_b ? n : k, bc = trans_b ? k : n;
  af.resize(ar * ac);
  bf.resize(br * bc);
  for (int64_t i = 0; i < ar; ++i) load_f32(a + i * lda, af.data() + i * ac, ac);
  for (int64_t i = 0; i < br; ++i) load_f32(b + i * ldb, bf.data() + i * bc, bc);
  sgemm(trans_a, trans_b, m, n, k, af.data(), ac, bf.data(), bc, beta, c, ldc);
}

// True when every size fits the BLAS's int (scipy-openblas32).
inline bool blas_sizes_ok(std::initializer_list<int64_t> sizes) {
  for (int64_t s : sizes)
    if (s < 0 || s > INT_MAX) return false;
  return true;
}

// -- tiles ----------------------------------------------------------------------------------------

// One unit of work: rows [r0, r0 + r) and columns [c0, c0 + c) of group g's product (rows are
// absolute row numbers; a transposed-x product cuts its output rows the same way).
struct Tile {
  int64_t g, r0, r, c0, c;
};

// Rows per tile for `total` rows: large enough that the BLAS's packing of the other operand is
// paid back (it is packed once per tile), small enough for 16 or more tiles to share out.
inline int64_t tile_rows(int64_t total) {
  const int64_t r = (total / 16 + 15) / 16 * 16;
  return std::min<int64_t>(512, std::max<int64_t>(64, r));
}

// Columns per tile: every column, unless there are too few rows to share out.
inline int64_t tile_cols(int64_t total_rows, int64_t n, int64_t groups_with_rows) {
  if (total_rows >= 256 || n <= 128) return n;
  // a few rows (decoding): whole rows of b (one sequential stream) once 2 groups have rows for
  // the threads to share (part of each row at the stride of a row reads at about 60% of the
  // bandwidth: 11 against 19 GB/s for half rows of 4 KB on 2 cores of an AVX2 EPYC), else 4
  // tiles at least 256 columns wide (grouped_matmul cuts one group's float32 [K, N] weight of
  // 2 chunks of K or more along K instead)
  if (total_rows <= kSkinnyRows) {
    const int64_t slices = groups_with_rows >= 2 ? 1 : 4;
    return std::max<int64_t>(256, ((n + slices - 1) / slices + 15) / 16 * 16);
  }
  return std::max<int64_t>(64, (n / 4 + 15) / 16 * 16);
}

// Tiles covering rows [off[g], off[g + 1]) x [0, n) of every group g (empty groups: none).
inline std::vector<Tile> row_tiles(const std::vector<int64_t> &off, int64_t n) {
  const int64_t groups = (int64_t)off.size() - 1, total = off[groups] - off[0];
  int64_t with_rows = 0;
  for (int64_t g = 0; g < groups; ++g) with_rows += off[g + 1] > off[g];
  const int64_t rows = tile_rows(total), cols = tile_cols(total, n, with_rows);
  std::vector<Tile> tiles;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r0 = off[g]; r0 < off[g + 1]; r0 += rows)
      for (int64_t c0 = 0; c0 < n; c0 += cols)
        tiles.push_back({g, r0, std::min(rows, off[g + 1] - r0), c0, std::min(cols, n - c0)});
  return tiles;
}

// The BLAS must not start threads of its own inside the kernel's OpenMP threads (its pthreads
// build would compete with them, or warn and hang); it is set once to one thread. The library
// owns this BLAS (scipy-openblas32 is loaded for it alone), so no other caller is affected.
inline void blas_single_threaded() {
  if (scipy_openblas_get_num_threads() != 1) scipy_openblas_set_num_threads(1);
}

// fn(tile) for every tile, shared out between the kernel's threads.
template <typename Fn>
void for_each_tile(const std::vector<Tile> &tiles, Fn &&fn) {
  blas_single_threaded();
  const int64_t count = (int64_t)tiles.size();
#pragma omp parallel for schedule(dynamic, 1) if (count > 1)
  for (int64_t i = 0; i < count; ++i) fn(tiles[i]);
}

// -- float32 views ------------------------------------------------------------------------------

// rows x cols of a row-major operand (row stride ld) as contiguous float32: the data itself when
// it is float32 and contiguous, otherwise a converted copy in buf (a per-thread workspace).
template <typename T>
const float *as_f32(const T *src, int64_t rows, int64_t cols, int64_t ld, std::vector<float> &buf) {
  if constexpr (std::is_same_v<T, float>) {
    if (cols == ld) return src;
  }
  if ((int64_t)buf.size() < rows * cols) buf.resize(rows * cols);
  for (int64_t i = 0; i < rows; ++i) load_f32(src + i * ld, buf.data() + i * cols, cols);
  return buf.data();
}

// dst[i, :n] (row stride ld) = src[i, :n] (+ bias[:n]) rounded to T.
template <typename T, typename B>
void store_rows(const float *src, int64_t rows, int64_t n, const B *bias, T *dst, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) {
    const float *s = src + i * n;
    T *d = dst + i * ld;
    if (bias)
      for (int64_t j = 0; j < n; ++j) d[j] = from_f32<T>(s[j] + to_f32(bias[j]));
    else
      store_f32(s, d, n);
  }
}

// dst[i, :n] (row stride ld) = bias[:n] (or 0): rows prefilled so that the BLAS adds the product.
template <typename B>
void fill_rows(float *dst, int64_t rows, int64_t n, const B *bias, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) {
    float *d = dst + i * ld;
    if (bias)
      for (int64_t j = 0; j < n; ++j) d[j] = to_f32(bias[j]);
    else
      if (n > 0) std::memset(d, 0, sizeof(float) * n);
  }
}

}  // namespace MOE_ISA_NS
}  // namespace moe
