// grouped_matmul (SPEC §5): one matrix product per group of rows, groups given by an int64
// counts (or cumulative ends) tensor. Two forms cover a grouped layer and its backward:
//   rows form:       out[rows g] = x[rows g] @ op(weight[g]) (+ bias[g])   x [M,K] -> [M,N]
//   transposed-x:    out[g]      = x[rows g]^T @ b[rows g]                 x [M,K], b [M,N] -> [G,K,N]
// Every product goes through the BLAS; float16/bfloat16 blocks are converted to float32 first.
#include <algorithm>

#include "ffn.h"
#include "gemm.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

constexpr const char *kOp = "grouped_matmul";

template <typename T>
void rows_form(const Arg &x, const Arg &w, const Arg &bias, const std::vector<int64_t> &off,
               bool trans_w, const Arg &out) {
  const int64_t k = x.dim(1), n = out.dim(1), groups = (int64_t)off.size() - 1;
  const T *xs = x.as<T>(), *ws = w.as<T>(), *bs = bias.present() ? bias.as<T>() : nullptr;
  T *ys = out.as<T>();
  std::vector<float> wbuf, xbuf, ybuf;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = off[g + 1] - off[g];
    if (rows == 0) continue;  // an empty group touches nothing (not even its weight)
    const float *wf = as_f32(ws + g * k * n, k * n, wbuf);
    const T *bg = bs ? bs + g * n : nullptr;
    const int64_t block = std::is_same_v<T, float> ? rows : kRowBlock;
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
      const int64_t r = std::min(block, rows - r0), row = off[g] + r0;
      const float *xf = as_f32(xs + row * k, r * k, xbuf);
      if constexpr (std::is_same_v<T, float>) {
        if (bg) fill_rows(ys + row * n, r, n, bg);  // bias first, the BLAS adds the product
        sgemm(false, trans_w, r, n, k, xf, k, wf, trans_w ? k : n, bg ? 1.f : 0.f, ys + row * n, n);
      } else {
        ybuf.resize(r * n);
        sgemm(false, trans_w, r, n, k, xf, k, wf, trans_w ? k : n, 0.f, ybuf.data(), n);
        store_rows(ybuf.data(), r, n, bg, ys + row * n);
      }
    }
  }
  zero_tail_rows(ys, off[groups], x.dim(0), n);
}

template <typename T>
void transposed_x_form(const Arg &x, const Arg &b, const std::vector<int64_t> &off,
                       const Arg &out) {
  const int64_t k = x.dim(1), n = b.dim(1), groups = (int64_t)off.size() - 1;
  const T *xs = x.as<T>(), *bs = b.as<T>();
  T *os = out.as<T>();
  std::vector<float> xbuf, bbuf, acc;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = off[g + 1] - off[g];
    T *og = os + g * k * n;
    if constexpr (std::is_same_v<T, float>) {
      // rows == 0: the empty sum, zeros (sgemm with k = 0 and beta 0)
      sgemm(true, false, k, n, rows, xs + off[g] * k, k, bs + off[g] * n, n, 0.f, og, n);
    } else {
      acc.assign(k * n, 0.f);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const int64_t r = std::min(kRowBlock, rows - r0), row = off[g] + r0;
        const float *xf = as_f32(xs + row * k, r * k, xbuf);
        const float *bf = as_f32(bs + row * n, r * n, bbuf);
        sgemm(true, false, k, n, r, xf, k, bf, n, 1.f, acc.data(), n);
      }
      store_rows(acc.data(), k, n, static_cast<const T *>(nullptr), og);
    }
  }
}

// The arguments (SPEC §5): x [M, K] float; group_list int64 [G], G >= 1; rows form: weight
// [G, K, N] ([G, N, K] with transpose_weight), bias [G, N] or none, out [M, N]; transpose_x:
// weight [M, N], no bias, out [G, K, N]; every tensor of x's dtype, every size within the BLAS's
// int. Both transposes at once are not a form.
int check_grouped_matmul(const Args &args, bool trans_x, bool trans_w) {
  if (int rc = check_count(kOp, args, 5)) return rc;
  const Arg x = args[0], w = args[1], groups = args[2], bias = args[3], out = args[4];
  if (int rc = check_arg(kOp, "x", x, 2, {DType::kF32, DType::kF16, DType::kBF16})) return rc;
  if (int rc = check_arg(kOp, "group_list", groups, 1, {DType::kI64})) return rc;
  const int64_t m = x.dim(0), k = x.dim(1), g = groups.dim(0);
  if (g < 1) return fail(kOp, "'group_list' must hold at least one group, got %s", shape_label(groups).c_str());
  if (trans_x && trans_w)
    return fail(kOp, "attributes 'transpose_x' and 'transpose_weight' cannot both be true");
  if (int rc = check_arg(kOp, "weight", w, trans_x ? 2 : 3, {x.dtype})) return rc;
  const int64_t n = trans_x ? w.dim(1) : trans_w ? w.dim(1) : w.dim(2);
  if (trans_x) {
    if (int rc = check_exact(kOp, "weight", w, x.dtype, {m, n})) return rc;
    if (int rc = check_absent(kOp, "bias", bias, "no bias with transpose_x")) return rc;
    if (int rc = check_exact(kOp, "out", out, x.dtype, {g, k, n})) return rc;
  } else {
    if (trans_w) {
      if (int rc = check_exact(kOp, "weight", w, x.dtype, {g, n, k})) return rc;
    } else if (int rc = check_exact(kOp, "weight", w, x.dtype, {g, k, n})) {
      return rc;
    }
    if (int rc = check_optional(kOp, "bias", bias, x.dtype, {g, n})) return rc;
    if (int rc = check_exact(kOp, "out", out, x.dtype, {m, n})) return rc;
  }
  if (!blas_sizes_ok({m, k, n})) return fail(kOp, "a dimension exceeds the BLAS limit of %d", INT_MAX);
  return 0;
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs: x [M, K], weight ([G, K, N], [G, N, K] transposed, or [M, N] with transpose_x),
// group_list int64 [G], bias [G, N] or None; output [M, N] (or [G, K, N] with transpose_x).
// attrs transpose_x, transpose_weight, cumulative, padded (rows past the last group allowed;
// true when absent).
MOE_KERNEL(GroupedMatmul)(int nparam, void **params, int *ndims, int64_t **shapes,
                             const char **dtypes, void *stream, void *extra_ptr) {
  const Args args{nparam, params, ndims, shapes, dtypes};
  auto *extra = static_cast<Extra *>(extra_ptr);
  const bool trans_x = extra->GetAttrBool("transpose_x");
  const bool trans_w = extra->GetAttrBool("transpose_weight");
  const bool cumulative = extra->GetAttrBool("cumulative");
  if (int rc = check_grouped_matmul(args, trans_x, trans_w)) return rc;
  const Arg x = args[0], w = args[1], groups = args[2], bias = args[3], out = args[4];
  std::vector<int64_t> offsets;
  if (int rc = group_offsets(kOp, "group_list", groups, cumulative, padded_attr(extra, true),
                             x.dim(0), offsets))
    return rc;
  return dispatch_float(kOp, x.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (trans_x)
      transposed_x_form<T>(x, w, offsets, out);
    else
      rows_form<T>(x, w, bias, offsets, trans_w, out);
    return 0;
  });
}
