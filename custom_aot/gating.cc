// Router kernels: moe_gating_top_k (sigmoid/softmax scores, grouped top-k selection) and its
// backwards (sigmoid: the seed's MoeGatingTopKBackward; softmax: this package's own).
#include <algorithm>

#include "checks.h"
#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

constexpr int64_t kMaxExperts = 2048;
// a score's activation and selection take about as long as streaming 32 bytes (worth_threads)
constexpr int64_t kScoreBytes = 32;

// Total order on float32 that sorts like the numbers (with -0 == +0) and puts every NaN, whatever
// its sign and payload, above +inf (as torch.topk does), so selection stays well defined (and in
// bounds) whatever the data. All NaNs share one key: among them the lower index wins.
constexpr int32_t kNanKey = INT32_MAX;

inline int32_t order_key(float v) {
  v += 0.0f;  // -0 -> +0
  int32_t b;
  std::memcpy(&b, &v, 4);
  return v != v ? kNanKey : b ^ ((b >> 31) & 0x7fffffff);
}

// The float an order key encodes (inverse of order_key).
inline float key_value(int32_t k) {
  const int32_t b = k ^ ((k >> 31) & 0x7fffffff);
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// Writes the indices of the k best candidates (descending key, ties: lower index) to out.
// cand lists candidate indices in increasing order (nullptr: 0..n-1); scratch holds n ints.
// Small k keeps a sorted run in registers-friendly arrays; large k uses a partial sort.
void top_k(const int32_t *keys, const int32_t *cand, int n, int k, int32_t *out, int32_t *scratch) {
  if (k <= 32) {
    int32_t best[32];
    int len = 0;
    for (int c = 0; c < n; ++c) {
      const int32_t i = cand ? cand[c] : c;
      const int32_t key = keys[i];
      // candidates come in increasing index order, so a tie never displaces an earlier one
      if (len == k && key <= best[k - 1]) continue;
      int pos = len < k ? len++ : k - 1;
      for (; pos > 0 && key > best[pos - 1]; --pos) {
        best[pos] = best[pos - 1];
        out[pos] = out[pos - 1];
      }
      best[pos] = key;
      out[pos] = i;
    }
    return;
  }
  for (int c = 0; c < n; ++c) scratch[c] = cand ? cand[c] : c;
  std::partial_sort(scratch, scratch + k, scratch + n, [keys](int32_t a, int32_t b) {
    return keys[a] > keys[b] || (keys[a] == keys[b] && a < b);
  });
  std::copy(scratch, scratch + k, out);
}

struct RouterAttrs {
  int k, k_group, group_count, group_select_mode, renorm, norm_type;
  float scale, eps;
};

template <typename T>
void route_row(const T *x, const T *bias, const RouterAttrs &a, int n, T *y, int32_t *idx,
               float *xn) {
  int32_t keys[kMaxExperts], scratch[2 * kMaxExperts];
  // 1. scores
  if (a.norm_type == 1) {
    for (int j = 0; j < n; ++j) xn[j] = sigmoid(to_f32(x[j]));
  } else {
    float mx = -INFINITY;
    for (int j = 0; j < n; ++j) mx = std::max(mx, to_f32(x[j]));
    float sum = 0.f;
    for (int j = 0; j < n; ++j) sum += (xn[j] = exp_approx(to_f32(x[j]) - mx));
    const float inv = 1.f / sum;
    for (int j = 0; j < n; ++j) xn[j] *= inv;
  }
  // 2. selection scores (bias only chooses)
  for (int j = 0; j < n; ++j) keys[j] = order_key(bias ? xn[j] + to_f32(bias[j]) : xn[j]);
  // 3. group-limited routing: only experts of the k_group best groups are candidates (the
  //    others count as -inf: they can never win, whatever the sign of the biased scores)
  int ncand = n;
  const int32_t *cand = nullptr;
  if (a.group_count > 1) {
    const int per = n / a.group_count;
    int32_t gkeys[kMaxExperts], gbest[kMaxExperts], kept[kMaxExperts];
    for (int g = 0; g < a.group_count; ++g) {
      const int32_t *kg = keys + g * per;
      // order keys compare like the floats they encode, so the group score is computed on keys
      int32_t m1 = INT32_MIN, m2 = INT32_MIN;
      for (int j = 0; j < per; ++j) {
        const int32_t v = kg[j];
        m2 = std::max(m2, std::min(m1, v));
        m1 = std::max(m1, v);
      }
      gkeys[g] = a.group_select_mode == 0 ? m1 : order_key(key_value(m1) + key_value(m2));
    }
    top_k(gkeys, nullptr, a.group_count, a.k_group, gbest, scratch);
    std::sort(gbest, gbest + a.k_group);
    ncand = 0;
    for (int i = 0; i < a.k_group; ++i)
      for (int j = gbest[i] * per; j < (gbest[i] + 1) * per; ++j) kept[ncand++] = j;
    std::copy(kept, kept + ncand, scratch + n);  // scratch is 2n long
    cand = scratch + n;
  }
  // 4. top-k experts
  top_k(keys, cand, ncand, a.k, idx, scratch);
  // 5-7. weights from the un-biased scores, renormalised, scaled
  float w[kMaxExperts], sum = 0.f;
  for (int p = 0; p < a.k; ++p) sum += (w[p] = xn[idx[p]]);
  const bool renorm = a.norm_type == 1 || a.renorm == 1;
  const float mul = renorm ? a.scale / (sum + a.eps) : a.scale;
  for (int p = 0; p < a.k; ++p) y[p] = from_f32<T>(w[p] * mul);
}

// -- entry-point checks (SPEC §1-2): everything the kernels rely on, before any read or write ---

// Attributes and arguments of MoeGatingTopK: x [M, N] (1 <= N <= kMaxExperts), bias [N] or none,
// y [M, k] and x's dtype, expert_idx [M, k] int32, x_norm [M, N] float32, and the attribute rules.
int check_router(const Args &args, Extra *extra, RouterAttrs *a) {
  const char *op = "moe_gating_top_k";
  if (int rc = check_count(op, args, 5)) return rc;
  const Arg x = args[0], bias = args[1], y = args[2], idx = args[3], xn = args[4];
  if (int rc = check_arg(op, "x", x, 2, {DType::kF32, DType::kF16, DType::kBF16})) return rc;
  const int64_t m = x.dim(0), n = x.dim(1);
  if (n < 1 || n > kMaxExperts)
    return fail(op, "the expert count N (x.shape[1]) must be in [1, %lld], got %lld",
                (long long)kMaxExperts, (long long)n);
  const int64_t k = extra->GetAttrInt("k"), k_group = extra->GetAttrInt("k_group");
  const int64_t groups = extra->GetAttrInt("group_count"), mode = extra->GetAttrInt("group_select_mode");
  const int64_t renorm = extra->GetAttrInt("renorm"), norm_type = extra->GetAttrInt("norm_type");
  if ((mode != 0 && mode != 1) || (renorm != 0 && renorm != 1) || (norm_type != 0 && norm_type != 1))
    return fail(op, "attributes group_select_mode, renorm and norm_type must be 0 or 1, got %lld, "
                "%lld and %lld", (long long)mode, (long long)renorm, (long long)norm_type);
  if (groups < 1 || n % groups != 0)
    return fail(op, "attribute 'group_count' must be >= 1 and divide N=%lld, got %lld",
                (long long)n, (long long)groups);
  const int64_t per = n / groups;
  if (k_group < 1 || k_group > groups)
    return fail(op, "attribute 'k_group' must be in [1, group_count=%lld], got %lld",
                (long long)groups, (long long)k_group);
  if (groups > 1 && mode == 1 && per < 2)
    return fail(op, "group_select_mode=1 needs at least 2 experts per group, got %lld",
                (long long)per);
  if (k < 1 || k > k_group * per)
    return fail(op, "attribute 'k' must be in [1, k_group * N / group_count = %lld], got %lld",
                (long long)(k_group * per), (long long)k);
  if (int rc = check_optional(op, "bias", bias, x.dtype, {n})) return rc;
  if (int rc = check_exact(op, "y", y, x.dtype, {m, k})) return rc;
  if (int rc = check_exact(op, "expert_idx", idx, DType::kI32, {m, k})) return rc;
  if (int rc = check_exact(op, "x_norm", xn, DType::kF32, {m, n})) return rc;
  *a = RouterAttrs{(int)k, (int)k_group, (int)groups, (int)mode, (int)renorm, (int)norm_type,
                   extra->GetAttrFloat("routed_scaling_factor"), extra->GetAttrFloat("eps")};
  return 0;
}

// The backwards: x_norm [M, N] float32 (1 <= N <= kMaxExperts), grad_y [M, K] (1 <= K <= N),
// expert_idx [M, K] int32, for the whole backward grad_x_norm [M, N] float32 or none, then
// grad_x [M, N] of grad_y's dtype.
int check_router_backward(const char *op, const Args &args, bool with_grad_x_norm = false) {
  if (int rc = check_count(op, args, with_grad_x_norm ? 5 : 4)) return rc;
  const Arg xn = args[0], gy = args[1], ei = args[2], gx = args[with_grad_x_norm ? 4 : 3];
  if (int rc = check_arg(op, "x_norm", xn, 2, {DType::kF32})) return rc;
  if (int rc = check_arg(op, "grad_y", gy, 2, {DType::kF32, DType::kF16, DType::kBF16})) return rc;
  const int64_t m = xn.dim(0), n = xn.dim(1), k = gy.dim(1);
  if (n < 1 || n > kMaxExperts)
    return fail(op, "the expert count N (x_norm.shape[1]) must be in [1, %lld], got %lld",
                (long long)kMaxExperts, (long long)n);
  if (gy.dim(0) != m || k < 1 || k > n)
    return fail(op, "'grad_y' must be [M=%lld, K] with 1 <= K <= N=%lld, got %s", (long long)m,
                (long long)n, shape_label(gy).c_str());
  if (int rc = check_exact(op, "expert_idx", ei, DType::kI32, {m, k})) return rc;
  if (with_grad_x_norm)
    if (int rc = check_optional(op, "grad_x_norm", args[3], DType::kF32, {m, n})) return rc;
  return check_exact(op, "grad_x", gx, gy.dtype, {m, n});
}

// Checks every index before anything is written (SPEC error rules).
int check_index_rows(const char *op, const int32_t *idx, int64_t m, int64_t k, int64_t n) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p) {
      const int32_t j = idx[i * k + p];
      if (j < 0 || j >= n)
        return fail(op, "expert_idx[%lld][%lld] = %d is outside [0, %lld)", (long long)i,
                    (long long)p, j, (long long)n);
    }
  return 0;
}

// Gradient of w = xn[idx] (optionally renormalised) and y = w * scale with respect to xn,
// summed per expert: gn[j] = sum over p with idx[p] == j of gw'[p]. Returns gw' in gw.
template <typename T>
void renorm_grad(const float *xn, const T *gy, const int32_t *idx, int k, bool renorm, float scale,
                 float eps, float *gw) {
  if (!renorm) {
    for (int p = 0; p < k; ++p) gw[p] = scale * to_f32(gy[p]);
    return;
  }
  float d = eps;
  for (int p = 0; p < k; ++p) d += xn[idx[p]];
  float beta = 0.f;
  for (int p = 0; p < k; ++p) beta += xn[idx[p]] / d * (scale * to_f32(gy[p]));
  for (int p = 0; p < k; ++p) gw[p] = (scale * to_f32(gy[p]) - beta) / d;
}

// The router's backward: the gradient through y (grad_y) and, when grad_x_norm is present, the
// one through the x_norm output too (score' applied to the sum of both), in one pass. The entry
// points have checked the arguments (check_router_backward).
template <typename T>
int gating_backward(const char *op, const Arg &xn, const Arg &gy, const Arg &ei, const Arg &gxn,
                     const Arg &gx, bool softmax, bool renorm, float scale, float eps) {
  const int64_t m = xn.dim(0), n = xn.dim(1), k = gy.dim(1);
  if (int rc = check_index_rows(op, ei.as<int32_t>(), m, k, n)) return rc;
#pragma omp parallel for schedule(static) if (worth_threads(kScoreBytes * m * n))
  for (int64_t i = 0; i < m; ++i) {
    const float *xr = xn.as<float>() + i * n;
    const float *dr = gxn.present() ? gxn.as<float>() + i * n : nullptr;
    const T *gr = gy.as<T>() + i * k;
    const int32_t *ir = ei.as<int32_t>() + i * k;
    T *out = gx.as<T>() + i * n;
    float gw[kMaxExperts], gn[kMaxExperts], row[kMaxExperts];
    renorm_grad(xr, gr, ir, (int)k, renorm, scale, eps, gw);
    // gn: the gradient of each chosen expert's score (only those entries are read, except by the
    // sigmoid with grad_x_norm, which reads them all)
    if (dr && !softmax) {
      for (int64_t j = 0; j < n; ++j) gn[j] = 0.f;
    } else {
      for (int p = 0; p < k; ++p) gn[ir[p]] = 0.f;
    }
    for (int p = 0; p < k; ++p) gn[ir[p]] += gw[p];
    if (!softmax) {
      // sigmoid' = xn (1 - xn); without grad_x_norm, experts not selected get exactly zero
      if (dr) {
        for (int64_t j = 0; j < n; ++j) {
          const float d = xr[j] * (1.f - xr[j]);
          row[j] = d * gn[j] + d * dr[j];
        }
        store_f32(row, out, n);
      } else {
        std::fill(out, out + n, from_f32<T>(0.f));
        for (int p = 0; p < k; ++p) {
          const int j = ir[p];
          out[j] = from_f32<T>(xr[j] * (1.f - xr[j]) * gn[j]);
        }
      }
    } else {
      // softmax': xn_j (gn_j - sum_l xn_l gn_l), and the same of grad_x_norm
      float dot = 0.f;
      for (int p = 0; p < k; ++p) dot += xr[ir[p]] * gw[p];
      for (int64_t j = 0; j < n; ++j) row[j] = -xr[j] * dot;
      for (int p = 0; p < k; ++p) row[ir[p]] = xr[ir[p]] * (gn[ir[p]] - dot);
      if (dr) {
        float dot_d = 0.f;
        for (int64_t j = 0; j < n; ++j) dot_d += xr[j] * dr[j];
        for (int64_t j = 0; j < n; ++j) row[j] += xr[j] * (dr[j] - dot_d);
      }
      store_f32(row, out, n);
    }
  }
  return 0;
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs: x [M, N], bias [N] or None; outputs: y [M, k], expert_idx [M, k] int32, x_norm [M, N] f32
MOE_KERNEL(MoeGatingTopK)(int nparam, void **params, int *ndims, int64_t **shapes,
                             const char **dtypes, void *stream, void *extra_ptr) {
  const Args args{nparam, params, ndims, shapes, dtypes};
  RouterAttrs a;
  if (int rc = moe::check_router(args, static_cast<moe::Extra *>(extra_ptr), &a)) return rc;
  const Arg x = args[0], bias = args[1], y = args[2], idx = args[3], xn = args[4];
  const int64_t m = x.dim(0), n = x.dim(1);
  return dispatch_float("moe_gating_top_k", x.dtype, [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static) if (worth_threads(kScoreBytes * m * n))
    for (int64_t i = 0; i < m; ++i)
      route_row<T>(x.as<T>() + i * n, bias.present() ? bias.as<T>() : nullptr, a, (int)n,
                   y.as<T>() + i * a.k, idx.as<int32_t>() + i * a.k, xn.as<float>() + i * n);
    return 0;
  });
}

// inputs: x_norm [M, N] f32, grad_y [M, K], expert_idx [M, K] int32; output: grad_x [M, N]
MOE_KERNEL(MoeGatingTopKBackward)(int nparam, void **params, int *ndims, int64_t **shapes,
                                     const char **dtypes, void *stream, void *extra_ptr) {
  const Args args{nparam, params, ndims, shapes, dtypes};
  const char *op = "moe_gating_top_k_backward";
  if (int rc = check_router_backward(op, args)) return rc;
  auto *extra = static_cast<Extra *>(extra_ptr);
  const float scale = extra->GetAttrFloat("routed_scaling_factor"), eps = extra->GetAttrFloat("eps");
  return dispatch_float(op, args[1].dtype, [&](auto tag) {
    return gating_backward<decltype(tag)>(op, args[0], args[1], args[2], Arg{}, args[3], false,
                                          true, scale, eps);
  });
}

MOE_KERNEL(MoeGatingTopKSoftmaxBackward)(int nparam, void **params, int *ndims, int64_t **shapes,
                                            const char **dtypes, void *stream, void *extra_ptr) {
  const Args args{nparam, params, ndims, shapes, dtypes};
  const char *op = "moe_gating_top_k_softmax_backward";
  if (int rc = check_router_backward(op, args)) return rc;
  auto *extra = static_cast<Extra *>(extra_ptr);
  const float scale = extra->GetAttrFloat("routed_scaling_factor"), eps = extra->GetAttrFloat("eps");
  const bool renorm = extra->GetAttrInt("renorm") == 1;
  return dispatch_float(op, args[1].dtype, [&](auto tag) {
    return gating_backward<decltype(tag)>(op, args[0], args[1], args[2], Arg{}, args[3], true,
                                          renorm, scale, eps);
  });
}

// The router's whole backward (moe_gating_top_k_grad). inputs: x_norm [M, N] f32, grad_y [M, K],
// expert_idx [M, K] int32, grad_x_norm [M, N] f32 or None; output: grad_x [M, N] (grad_y's dtype).
// attrs: norm_type (1 sigmoid, 0 softmax), renorm (0 or 1), routed_scaling_factor, eps.
MOE_KERNEL(MoeGatingTopKGrad)(int nparam, void **params, int *ndims, int64_t **shapes,
                                 const char **dtypes, void *stream, void *extra_ptr) {
  const Args args{nparam, params, ndims, shapes, dtypes};
  const char *op = "moe_gating_top_k_grad";
  if (int rc = check_router_backward(op, args, true)) return rc;
  auto *extra = static_cast<Extra *>(extra_ptr);
  const int64_t norm_type = extra->GetAttrInt("norm_type"), renorm_attr = extra->GetAttrInt("renorm");
  if ((norm_type != 0 && norm_type != 1) || (renorm_attr != 0 && renorm_attr != 1))
    return fail(op, "attributes norm_type and renorm must be 0 or 1, got %lld and %lld",
                (long long)norm_type, (long long)renorm_attr);
  const float scale = extra->GetAttrFloat("routed_scaling_factor"), eps = extra->GetAttrFloat("eps");
  const bool softmax = norm_type == 0, renorm = !softmax || renorm_attr == 1;
  return dispatch_float(op, args[1].dtype, [&](auto tag) {
    return gating_backward<decltype(tag)>(op, args[0], args[1], args[2], args[3], args[4], softmax,
                                          renorm, scale, eps);
  });
}
