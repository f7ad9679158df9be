// weight_quant_grouped_matmul: y[rows of e] = (x[rows of e] @ float(weight[e])) * scale[e], the
// products of weight-only int8 experts, reading each int8 weight once per block of up to 4 rows
// (dequantising the weights first writes and reads them again as float32: 9 bytes of memory
// traffic per weight instead of 1, which is what a decoding step's few rows pay for). Made for few
// rows per expert: a block's rows share one pass over their expert's weight rows.
//
// A group of up to kSplitRows rows is cut along K into chunks of kChunk weight rows (so that two
// experts' products at batch 1 still share out over the threads); the chunks' partial sums are
// added in chunk order afterwards. The cut depends on the shapes and counts only, so results are
// the same for any thread count.
#include <algorithm>
#include <vector>

#include "checks.h"
#include "common.h"
#include "ffn.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

constexpr const char *kOp = "weight_quant_grouped_matmul";
constexpr int64_t kBlockRows = 4;   // rows sharing one pass over the weight rows
constexpr int64_t kSplitRows = 16;  // groups of at most this many rows are cut along K
constexpr int64_t kChunk = 128;     // weight rows per chunk of a cut group
constexpr int64_t kUnroll = 8;      // weight rows per pass over the sums

struct Tile {
  int64_t group, row0, rows, k0, k1;
  int64_t at;  // its rows x n partial sums' offset (a cut group), or -1: scaled into y directly
};

// sums[i, :] = x[row0 + i, k0:k1] @ float(w[k0:k1, :]) for i < rows (rows <= kBlockRows), each
// sum in k order. kUnroll weight rows at a time: each pass over a row of sums (a load and a store
// per element) then takes kUnroll weights instead of one.
void block_sums(const float *x, int64_t kx, const int8_t *w, int64_t n, int64_t row0, int64_t rows,
                int64_t k0, int64_t k1, float *sums) {
  std::fill(sums, sums + rows * n, 0.0f);
  int64_t k = k0;
  for (; k + kUnroll <= k1; k += kUnroll) {
    const int8_t *wk = w + k * n;
    for (int64_t i = 0; i < rows; ++i) {
      float a[kUnroll];
      for (int64_t u = 0; u < kUnroll; ++u) a[u] = x[(row0 + i) * kx + k + u];
      float *s = sums + i * n;
      for (int64_t j = 0; j < n; ++j) {
        float acc = s[j];
        for (int64_t u = 0; u < kUnroll; ++u) acc += a[u] * static_cast<float>(wk[u * n + j]);
        s[j] = acc;
      }
    }
  }
  for (; k < k1; ++k) {
    const int8_t *wk = w + k * n;
    for (int64_t i = 0; i < rows; ++i) {
      const float a = x[(row0 + i) * kx + k];
      float *s = sums + i * n;
      for (int64_t j = 0; j < n; ++j) s[j] += a * static_cast<float>(wk[j]);
    }
  }
}

int weight_quant_grouped_matmul(const Args &args, bool padded) {
  if (int rc = check_count(kOp, args, 5)) return rc;
  const Arg x = args[0], w = args[1], scale = args[2], counts = args[3], y = args[4];
  if (int rc = check_arg(kOp, "x", x, 2, {DType::kF32})) return rc;
  if (int rc = check_arg(kOp, "weight", w, 3, {DType::kI8})) return rc;
  const int64_t m = x.dim(0), k = x.dim(1), e = w.dim(0), n = w.dim(2);
  if (e < 1) return fail(kOp, "'weight' must hold at least one expert, got %s", shape_label(w).c_str());
  if (w.dim(1) != k)
    return fail(kOp, "'weight' must be [E, K, N] with K = x.shape[1] = %lld, got %s",
                (long long)k, shape_label(w).c_str());
  if (int rc = check_exact(kOp, "scale", scale, DType::kF32, {e, n})) return rc;
  if (int rc = check_exact(kOp, "group_list", counts, DType::kI64, {e})) return rc;
  if (int rc = check_exact(kOp, "y", y, DType::kF32, {m, n})) return rc;
  std::vector<int64_t> off;
  if (int rc = group_offsets(kOp, "group_list", counts, false, padded, m, off)) return rc;
  float *ys = y.as<float>();
  zero_tail_rows(ys, off[e], m, n);
  if (n == 0) return 0;
  const float *xs = x.as<float>(), *ss = scale.as<float>();
  const int8_t *ws = w.as<int8_t>();

  std::vector<Tile> tiles;
  int64_t partial = 0;  // floats of partial sums
  int64_t streamed = 0;  // bytes of weights the tiles read
  for (int64_t g = 0; g < e; ++g) {
    const int64_t r = off[g + 1] - off[g];
    const bool cut = r <= kSplitRows && k > kChunk;
    const int64_t step = cut ? kChunk : std::max<int64_t>(k, 1);
    for (int64_t i = 0; i < r; i += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, r - i);
      for (int64_t k0 = 0; k0 == 0 || k0 < k; k0 += step) {
        tiles.push_back({g, off[g] + i, rows, k0, std::min(k, k0 + step), cut ? partial : -1});
        if (cut) partial += rows * n;
        streamed += (std::min(k, k0 + step) - k0) * n;
      }
    }
  }
  std::vector<float> sums(partial);
  const int64_t count = static_cast<int64_t>(tiles.size());
#pragma omp parallel if (worth_threads(streamed))
  {
    std::vector<float> block(kBlockRows * n);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < count; ++t) {
      const Tile &tile = tiles[t];
      const int8_t *we = ws + tile.group * k * n;
      float *dst = tile.at >= 0 ? sums.data() + tile.at : block.data();
      block_sums(xs, k, we, n, tile.row0, tile.rows, tile.k0, tile.k1, dst);
      if (tile.at >= 0) continue;
      const float *s = ss + tile.group * n;
      for (int64_t i = 0; i < tile.rows; ++i) {
        float *out = ys + (tile.row0 + i) * n;
        for (int64_t j = 0; j < n; ++j) out[j] = dst[i * n + j] * s[j];
      }
    }
  }
  // the cut groups: their chunks' sums added in chunk order, then scaled
  for (int64_t t = 0; t < count;) {
    const Tile &first = tiles[t];
    if (first.at < 0) {
      ++t;
      continue;
    }
    int64_t end = t;
    while (end < count && tiles[end].group == first.group && tiles[end].row0 == first.row0) ++end;
    const float *s = ss + first.group * n;
    for (int64_t i = 0; i < first.rows; ++i) {
      float *out = ys + (first.row0 + i) * n;
      for (int64_t j = 0; j < n; ++j) {
        float total = 0.0f;
        for (int64_t c = t; c < end; ++c) total += sums[tiles[c].at + i * n + j];
        out[j] = total * s[j];
      }
    }
    t = end;
  }
  return 0;
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs: x float32 [M, K], weight int8 [E, K, N], scale float32 [E, N], group_list int64 [E]
// (rows per expert: adding up to M, or with the padded attribute (default) at most M, the rest
// zero rows); output y float32 [M, N].
MOE_KERNEL(WeightQuantGroupedMatmul)(int nparam, void **params, int *ndims, int64_t **shapes,
                                     const char **dtypes, void *stream, void *extra) {
  return weight_quant_grouped_matmul(Args{nparam, params, ndims, shapes, dtypes},
                                     padded_attr(static_cast<Extra *>(extra), true));
}
