// grouped_matmul (SPEC §5): one matrix product per group of rows, groups given by an int64
// counts (or cumulative ends) tensor. Two forms cover a grouped layer and its backward:
//   rows form:       out[rows g] = x[rows g] @ op(weight[g]) (+ bias[g])   x [M,K] -> [M,N]
//                    (a 2-D weight is every group's: a dense layer's product, read in place)
//   transposed-x:    out[g]      = x[rows g]^T @ b[rows g]                 x [M,K], b [M,N] -> [G,K,N]
// Every product goes through the BLAS (gemm.h); float16 blocks are converted to float32 first,
// bfloat16 operands go as they are to a bfloat16 dot-product GEMM where the path has one (else
// converted too). Either way each product is exact and summed in float32, rounded once at the end.
#include <algorithm>

#include "ffn.h"
#include "gemm.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

constexpr const char *kOp = "grouped_matmul";

// Weight rows per chunk when a few float32 rows of one group are cut along K (see
// one_group_cut_along_k; every other case takes row_tiles' tiles).
constexpr int64_t kCutRows = 256;

// The group that has rows when only one has, at most kSkinnyRows of them, for a weight of 2
// chunks of K or more and more than 128 columns; else -1 (the caller asks only for a float32
// [K, N] weight). Its threads then read whole rows of the weight, a range of K each (one
// sequential stream), where column slices would read part of every row. (So a row's bits depend
// on whether another group has rows too, as they depend on the 16 rows past which the BLAS
// takes over.)
int64_t one_group_cut_along_k(const std::vector<int64_t> &off, int64_t k, int64_t n) {
  const int64_t groups = (int64_t)off.size() - 1;
  if (off[groups] - off[0] > kSkinnyRows || n <= 128 || k < 2 * kCutRows) return -1;
  int64_t found = -1;
  for (int64_t g = 0; g < groups; ++g) {
    if (off[g + 1] == off[g]) continue;
    if (found >= 0) return -1;
    found = g;
  }
  return found;
}

// out[rows g] = x[rows g] @ wg (+ bias[g]) in chunks of kCutRows rows of wg [k, n]: each chunk's
// partial sums (each in k order), then added in chunk order. The chunks depend on k alone, so the
// results are the same for any thread count.
void cut_along_k(const float *x, const float *wg, const float *bias, int64_t r, int64_t k,
                 int64_t n, float *y) {
  const int64_t chunks = (k + kCutRows - 1) / kCutRows;
  std::vector<float> sums(chunks * r * n);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = c * kCutRows;
    skinny_gemm(false, r, n, std::min(kCutRows, k - k0), x + k0, k, wg + k0 * n, n, 0.f,
                sums.data() + c * r * n, n);
  }
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float total = sums[i * n + j];
      for (int64_t c = 1; c < chunks; ++c) total += sums[(c * r + i) * n + j];
      y[i * n + j] = bias ? total + bias[j] : total;
    }
}

// Tiles of rows (and, for few rows, of columns): out[tile] = x[tile rows] @ op(weight[g])[:, tile
// columns] (+ bias); a few float32 rows of one group against a [K, N] weight: cut along K.
template <typename T>
void rows_form(const Arg &x, const Arg &w, const Arg &bias, const std::vector<int64_t> &off,
               bool trans_w, const Arg &out) {
  const int64_t k = x.dim(1), n = out.dim(1), groups = (int64_t)off.size() - 1;
  if constexpr (std::is_same_v<T, float>) {
    const int64_t g = trans_w ? -1 : one_group_cut_along_k(off, k, n);
    if (g >= 0) {
      const float *wg = w.as<float>() + (w.ndim == 2 ? 0 : g * k * n);
      cut_along_k(x.as<float>() + off[g] * k, wg, bias.present() ? bias.as<float>() + g * n : nullptr,
                  off[g + 1] - off[g], k, n, out.as<float>() + off[g] * n);
      zero_tail_rows(out.as<float>(), off[groups], x.dim(0), n);
      return;
    }
  }
  const T *xs = x.as<T>(), *ws = w.as<T>(), *bs = bias.present() ? bias.as<T>() : nullptr;
  T *ys = out.as<T>();
  onednn::GemmBf16 *const dot = std::is_same_v<T, bf16> ? bf16_dot() : nullptr;
  for_each_tile(row_tiles(off, n), [&](const Tile &t) {
    thread_local std::vector<float> wbuf, xbuf, ybuf;
    // the tile's columns of op(weight[g]): [k, c] of [k, n], or [c, k] rows of [n, k]
    const T *wg = w.ndim == 2 ? ws : ws + t.g * k * n;
    if constexpr (std::is_same_v<T, bf16>) {
      if (dot) {
        ybuf.resize(t.r * t.c);
        gemm_bf16(dot, false, trans_w, t.r, t.c, k, xs + t.r0 * k, k,
                  wg + (trans_w ? t.c0 * k : t.c0), trans_w ? k : n, 0.f, ybuf.data(), t.c);
        store_rows(ybuf.data(), t.r, t.c, bs ? bs + t.g * n + t.c0 : nullptr, ys + t.r0 * n + t.c0, n);
        return;
      }
    }
    const float *wf;
    int64_t ldw = trans_w ? k : n;
    if constexpr (std::is_same_v<T, float>) {
      wf = wg + (trans_w ? t.c0 * k : t.c0);
    } else {
      wf = trans_w ? as_f32(wg + t.c0 * k, t.c, k, k, wbuf) : as_f32(wg + t.c0, k, t.c, n, wbuf);
      ldw = trans_w ? k : t.c;
    }
    const float *xf = as_f32(xs + t.r0 * k, t.r, k, k, xbuf);
    const T *bg = bs ? bs + t.g * n + t.c0 : nullptr;
    T *yt = ys + t.r0 * n + t.c0;
    if constexpr (std::is_same_v<T, float>) {
      if (bg) fill_rows(yt, t.r, t.c, bg, n);  // bias first, the BLAS adds the product
      sgemm(false, trans_w, t.r, t.c, k, xf, k, wf, ldw, bg ? 1.f : 0.f, yt, n);
    } else {
      ybuf.resize(t.r * t.c);
      sgemm(false, trans_w, t.r, t.c, k, xf, k, wf, ldw, 0.f, ybuf.data(), t.c);
      store_rows(ybuf.data(), t.r, t.c, bg, yt, n);
    }
  });
  zero_tail_rows(ys, off[groups], x.dim(0), n);
}

// out[g] = x[rows g]^T @ b[rows g], tiled over out[g]'s rows (x's columns): each tile sums all of
// its group's rows itself, in a fixed order.
template <typename T>
void transposed_x_form(const Arg &x, const Arg &b, const std::vector<int64_t> &off,
                       const Arg &out) {
  const int64_t k = x.dim(1), n = b.dim(1), groups = (int64_t)off.size() - 1;
  const T *xs = x.as<T>(), *bs = b.as<T>();
  T *os = out.as<T>();
  const int64_t kc = k >= 256 ? 128 : k;
  std::vector<Tile> tiles;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t k0 = 0; k0 < k; k0 += kc) tiles.push_back({g, k0, std::min(kc, k - k0), 0, n});
  onednn::GemmBf16 *const dot = std::is_same_v<T, bf16> ? bf16_dot() : nullptr;
  for_each_tile(tiles, [&](const Tile &t) {
    const int64_t rows = off[t.g + 1] - off[t.g];
    T *ot = os + t.g * k * n + t.r0 * n;
    if constexpr (std::is_same_v<T, bf16>) {
      if (dot) {  // one product over all the group's rows (none: zeros)
        thread_local std::vector<float> acc;
        acc.resize(t.r * n);
        gemm_bf16(dot, true, false, t.r, n, rows, xs + off[t.g] * k + t.r0, k, bs + off[t.g] * n, n,
                  0.f, acc.data(), n);
        store_rows(acc.data(), t.r, n, static_cast<const T *>(nullptr), ot, n);
        return;
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      // rows == 0: the empty sum, zeros (sgemm with k = 0 and beta 0)
      sgemm(true, false, t.r, n, rows, xs + off[t.g] * k + t.r0, k, bs + off[t.g] * n, n, 0.f,
            ot, n);
    } else {
      thread_local std::vector<float> xbuf, bbuf, acc;
      acc.assign(t.r * n, 0.f);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const int64_t r = std::min(kRowBlock, rows - r0), row = off[t.g] + r0;
        const float *xf = as_f32(xs + row * k + t.r0, r, t.r, k, xbuf);
        const float *bf = as_f32(bs + row * n, r, n, n, bbuf);
        sgemm(true, false, t.r, n, r, xf, t.r, bf, n, 1.f, acc.data(), n);
      }
      store_rows(acc.data(), t.r, n, static_cast<const T *>(nullptr), ot, n);
    }
  });
}

// The arguments (SPEC §5): x [M, K] float; group_list int64 [G], G >= 1; rows form: weight
// [G, K, N] ([G, N, K] with transpose_weight) or one for every group, [K, N] ([N, K]), bias
// [G, N] or none, out [M, N]; transpose_x:
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
  const bool shared = !trans_x && w.ndim == 2;  // one weight for every group
  if (int rc = check_arg(kOp, "weight", w, trans_x || shared ? 2 : 3, {x.dtype})) return rc;
  const int64_t n = trans_x ? w.dim(1) : w.dim(w.ndim - (trans_w ? 2 : 1));
  if (trans_x) {
    if (int rc = check_exact(kOp, "weight", w, x.dtype, {m, n})) return rc;
    if (int rc = check_absent(kOp, "bias", bias, "no bias with transpose_x")) return rc;
    if (int rc = check_exact(kOp, "out", out, x.dtype, {g, k, n})) return rc;
  } else {
    if (shared) {
      if (int rc = check_exact(kOp, "weight", w, x.dtype, {trans_w ? n : k, trans_w ? k : n})) return rc;
    } else if (trans_w) {
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

// inputs: x [M, K], weight ([G, K, N], [G, N, K] transposed, one for every group: [K, N] or
// [N, K] transposed, or [M, N] with transpose_x),
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

namespace moe {
inline namespace MOE_ISA_NS {
// What the matrix products of each dtype run on this path (`python -m ms_moe_ops.info`).
const char *products() {
  thread_local std::string line;
  line = std::string("float32: ") + (onednn_sgemm() ? "oneDNN sgemm" : "OpenBLAS sgemm") +
         "; bfloat16: " +
         (bf16_dot() ? "oneDNN bfloat16 dot-product GEMM (exact products, float32 sums)"
                     : "converted to float32 blocks, then float32 products") +
         "; float16: converted to float32 blocks, then float32 products (" + onednn::about() + ")";
  return line.c_str();
}
}  // namespace MOE_ISA_NS
}  // namespace moe

#if defined(MOE_ENTRY_POINTS)
#define MOE_PRODUCTS_DECLARE(path, _) \
  MOE_CAT(MOE_INLINE_, path) namespace isa_##path { const char *products(); }
namespace moe { MOE_PATH_LIST(MOE_PRODUCTS_DECLARE, _) }

// The products of the path a kernel call takes now, per dtype, and the oneDNN found.
MOE_EXPORT const char *MsMoeOpsProducts() {
  using Fn = const char *();
  static Fn *const paths[] = {MOE_PATH_LIST(MOE_PATH_ENTRY, products)};
  const int p = moe::dispatch::path();
  return p < 0 ? "none: MS_MOE_OPS_ISA names no path this CPU runs" : paths[p]();
}
#endif
