// Matrix products for the grouped kernels (grouped_matmul, MoeFFN): the BLAS for every product,
// float32 views of float16/bfloat16 blocks, and the limits of the BLAS's 32-bit sizes.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <type_traits>
#include <vector>

#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {

// Rows of a float16/bfloat16 operand converted per block; bounds the float32 workspace.
constexpr int64_t kRowBlock = 512;

// c[m, n] = op(a) @ op(b) + beta * c, row-major float32 (lda/ldb/ldc: row strides).
// OpenBLAS splits the output between its threads, never the k sum: results are deterministic.
inline void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float *a,
                  int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // empty sum: the BLAS would leave c untouched with beta = 1
    if (beta == 0.f)
      for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, sizeof(float) * n);
    return;
  }
  scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                    trans_b ? CblasTrans : CblasNoTrans, (blasint)m, (blasint)n, (blasint)k, 1.f,
                    a, (blasint)lda, b, (blasint)ldb, beta, c, (blasint)ldc);
}

// True when every size fits the BLAS's int (scipy-openblas32).
inline bool blas_sizes_ok(std::initializer_list<int64_t> sizes) {
  for (int64_t s : sizes)
    if (s < 0 || s > INT_MAX) return false;
  return true;
}

// A float32 view of `count` contiguous elements: the data itself for float32, otherwise a
// converted copy in buf (row-parallel, static schedule).
template <typename T>
const float *as_f32(const T *src, int64_t count, std::vector<float> &buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    if ((int64_t)buf.size() < count) buf.resize(count);
    float *dst = buf.data();
    constexpr int64_t kChunk = 4096;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i += kChunk) load_f32(src + i, dst + i, std::min(kChunk, count - i));
    return dst;
  }
}

// dst[r, n] = src[r, n] (+ bias[n]) rounded to T; rows in parallel.
template <typename T, typename B>
void store_rows(const float *src, int64_t rows, int64_t n, const B *bias, T *dst) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const float *s = src + i * n;
    T *d = dst + i * n;
    if (bias)
      for (int64_t j = 0; j < n; ++j) d[j] = from_f32<T>(s[j] + to_f32(bias[j]));
    else
      for (int64_t j = 0; j < n; ++j) d[j] = from_f32<T>(s[j]);
  }
}

// dst[r, n] = bias[n] (or 0): float32 rows prefilled so that the BLAS adds the product (beta 1).
template <typename B>
void fill_rows(float *dst, int64_t rows, int64_t n, const B *bias) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    float *d = dst + i * n;
    if (bias)
      for (int64_t j = 0; j < n; ++j) d[j] = to_f32(bias[j]);
    else
      if (n > 0) std::memset(d, 0, sizeof(float) * n);
  }
}

}  // namespace MOE_ISA_NS
}  // namespace moe
