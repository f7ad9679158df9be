// Token permutation kernels for the MoE layer (SPEC §5): moe_token_permute (stable counting sort
// of the (token, slot) pairs by expert), moe_token_unpermute (weighted gather back per token) and
// the unpermute backward.
//
// sorted_index[t * K + k] is the row of the permuted tensor that holds slot k of token t (the
// destination map, as on Ascend). Every kernel is then parallel over tokens with disjoint writes:
//   permute:    permuted[sorted_index[t*K+k]] = x[t]
//   unpermute:  out[t] = sum_k probs[t,k] * permuted[sorted_index[t*K+k]]
//   backward:   d_permuted[sorted_index[t*K+k]] = probs[t,k] * dout[t],
//               d_probs[t,k] = <permuted[sorted_index[t*K+k]], dout[t]>
#include <vector>

#include "checks.h"
#include "common.h"

namespace moe {
inline namespace MOE_ISA_NS {
namespace {

inline size_t element_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
    default: return 0;
  }
}

// sorted_index must be a permutation of [0, n): the unpermute reads and, above all, the backward's
// scatter must neither leave the tensor nor race on a repeated row. Checked before any write.
int check_permutation(const char *op, const int32_t *index, int64_t n) {
  std::vector<uint8_t> seen(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t p = index[i];
    if (p < 0 || p >= n)
      return fail(op, "sorted_index[%lld] = %d is outside [0, %lld)", (long long)i, p, (long long)n);
    if (seen[p])
      return fail(op, "sorted_index[%lld] = %d repeats a row (sorted_index must be a permutation "
                  "of [0, %lld))", (long long)i, p, (long long)n);
    seen[p] = 1;
  }
  return 0;
}

// out[t] = sum_k probs[t,k] * permuted[index[t*K+k]] (probs == nullptr: weights 1), float32 sums.
template <typename T, typename P>
void unpermute(const T *permuted, const int32_t *index, const P *probs, int64_t tokens, int64_t k,
               int64_t h, T *out) {
#pragma omp parallel if (worth_threads(tokens * k * h * (int64_t)sizeof(T)))
  {
    std::vector<float> acc(h);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < k; ++s) {
        const float w = probs ? to_f32(probs[t * k + s]) : 1.f;
        const T *row = permuted + index[t * k + s] * h;
        for (int64_t j = 0; j < h; ++j) acc[j] += w * to_f32(row[j]);
      }
      T *o = out + t * h;
      for (int64_t j = 0; j < h; ++j) o[j] = from_f32<T>(acc[j]);
    }
  }
}

// d_permuted[index[t*K+k]] = probs[t,k] * dout[t]; d_probs[t,k] = <permuted[index[t*K+k]], dout[t]>
// (without probs: weights 1 and d_probs = 0).
template <typename T, typename P>
void unpermute_backward(const T *permuted, const int32_t *index, const P *probs, const T *dout,
                        int64_t tokens, int64_t k, int64_t h, T *d_permuted, P *d_probs) {
#pragma omp parallel for schedule(static) if (worth_threads(2 * tokens * k * h * (int64_t)sizeof(T)))
  for (int64_t t = 0; t < tokens; ++t) {
    const T *g = dout + t * h;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t row = index[t * k + s];
      T *d = d_permuted + row * h;
      if (!probs) {
        if (h > 0) std::memcpy(d, g, h * sizeof(T));  // (no rows of data: no pointers either)
        d_probs[t * k + s] = from_f32<P>(0.f);
        continue;
      }
      const float w = to_f32(probs[t * k + s]);
      const T *p = permuted + row * h;
      float dot = 0.f;
      for (int64_t j = 0; j < h; ++j) {
        const float gj = to_f32(g[j]);
        d[j] = from_f32<T>(w * gj);
        dot += to_f32(p[j]) * gj;
      }
      d_probs[t * k + s] = from_f32<P>(dot);
    }
  }
}

// Calls f(T{}, P{}) for the dtypes of the rows and of the weights (float32 or the rows' dtype).
template <typename F>
int dispatch_rows_probs(const char *op, DType rows, DType probs, F &&f) {
  return dispatch_float(op, rows, [&](auto tag) {
    using T = decltype(tag);
    if (probs == DType::kF32) return f(T{}, float{});
    return f(T{}, T{});
  });
}

// K from the top_k attribute (0: from probs, or 1 without probs).
int64_t slots_per_token(Extra *extra, const Arg &probs) {
  if (given(probs)) return probs.dim(1);
  const int64_t k = extra->GetAttrInt("top_k");
  return k > 0 ? k : 1;
}

constexpr int64_t kMaxRows = INT32_MAX;  // sorted_index holds row numbers as int32

// -- entry-point checks (SPEC §5): everything the kernels rely on, before any read or write ------

// MoeTokenPermute: x [T, H] (H may be 0), expert_idx [T, K] int32 with T*K <= INT32_MAX,
// num_experts >= 1; permuted [T*K, H] of x's dtype, sorted_index [T*K] int32, counts [E] int64.
int check_permute(const Args &args, int64_t experts) {
  const char *op = "moe_token_permute";
  if (int rc = check_count(op, args, 5)) return rc;
  const Arg x = args[0], ei = args[1];
  if (int rc = check_arg(op, "x", x, 2, {DType::kF32, DType::kF16, DType::kBF16})) return rc;
  if (int rc = check_arg(op, "expert_idx", ei, 2, {DType::kI32})) return rc;
  const int64_t t = x.dim(0), h = x.dim(1), k = ei.dim(1);
  if (ei.dim(0) != t)
    return fail(op, "'expert_idx' must have T=%lld rows like 'x', got %s", (long long)t,
                shape_label(ei).c_str());
  if (k > 0 && t > kMaxRows / k)
    return fail(op, "T*K must fit in int32 (sorted_index), got T=%lld, K=%lld", (long long)t,
                (long long)k);
  if (experts < 1) return fail(op, "attribute 'num_experts' must be >= 1, got %lld", (long long)experts);
  if (int rc = check_exact(op, "permuted", args[2], x.dtype, {t * k, h})) return rc;
  if (int rc = check_exact(op, "sorted_index", args[3], DType::kI32, {t * k})) return rc;
  return check_exact(op, "counts", args[4], DType::kI64, {experts});
}

// The unpermute's inputs: permuted [N, H] with N <= INT32_MAX, sorted_index [N] int32, probs
// [T, K] (float32 or permuted's dtype, T*K = N) or none (then K = top_k or 1, N % K == 0);
// sets T and K.
int check_unpermute_inputs(const char *op, const Args &args, Extra *extra, int64_t *t, int64_t *k) {
  const Arg permuted = args[0], sorted = args[1], probs = args[2];
  if (int rc = check_arg(op, "permuted", permuted, 2, {DType::kF32, DType::kF16, DType::kBF16}))
    return rc;
  const int64_t n = permuted.dim(0);
  if (n > kMaxRows)
    return fail(op, "'permuted' has %lld rows, more than int32 sorted_index can address", (long long)n);
  if (int rc = check_exact(op, "sorted_index", sorted, DType::kI32, {n})) return rc;
  if (given(probs)) {
    if (int rc = check_arg(op, "probs", probs, 2, {DType::kF32, permuted.dtype})) return rc;
    if (probs.dim(0) * probs.dim(1) != n)
      return fail(op, "'probs' [T, K] must have T*K = %lld (the permuted rows), got %s",
                  (long long)n, shape_label(probs).c_str());
  } else if (extra->GetAttrInt("top_k") < 0) {
    return fail(op, "attribute 'top_k' must be >= 0, got %lld", (long long)extra->GetAttrInt("top_k"));
  }
  *k = slots_per_token(extra, probs);
  if (*k == 0 ? n != 0 : n % *k != 0)
    return fail(op, "the permuted rows (%lld) must be a multiple of K=%lld", (long long)n, (long long)*k);
  *t = *k ? n / *k : probs.dim(0);
  return 0;
}

// MoeTokenUnpermute: those inputs; out [T, H] of permuted's dtype.
int check_unpermute(const Args &args, Extra *extra, int64_t *t, int64_t *k) {
  const char *op = "moe_token_unpermute";
  if (int rc = check_count(op, args, 4)) return rc;
  if (int rc = check_unpermute_inputs(op, args, extra, t, k)) return rc;
  return check_exact(op, "out", args[3], args[0].dtype, {*t, args[0].dim(1)});
}

// MoeTokenUnpermuteBackward: those inputs and grad_out [T, H]; grad_permuted like permuted,
// grad_probs [T, K] of probs' dtype (float32 without probs).
int check_unpermute_backward(const Args &args, Extra *extra, int64_t *t, int64_t *k) {
  const char *op = "moe_token_unpermute_backward";
  if (int rc = check_count(op, args, 6)) return rc;
  if (int rc = check_unpermute_inputs(op, args, extra, t, k)) return rc;
  const Arg permuted = args[0], probs = args[2];
  if (int rc = check_exact(op, "grad_out", args[3], permuted.dtype, {*t, permuted.dim(1)})) return rc;
  if (int rc = check_like(op, "grad_permuted", args[4], permuted)) return rc;
  return check_exact(op, "grad_probs", args[5], given(probs) ? probs.dtype : DType::kF32, {*t, *k});
}

}  // namespace
}  // namespace MOE_ISA_NS
}  // namespace moe

// inputs: x [T, H], expert_idx [T, K] int32; outputs: permuted [T*K, H], sorted_index [T*K] int32,
// counts [E] int64. attr num_experts.
MOE_KERNEL(MoeTokenPermute)(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **dtypes, void *stream, void *extra_ptr) {
  const char *op = "moe_token_permute";
  const Args args{nparam, params, ndims, shapes, dtypes};
  auto *extra = static_cast<Extra *>(extra_ptr);
  const Arg x = args[0], ei = args[1], permuted = args[2], sorted = args[3], counts = args[4];
  const int64_t experts = extra->GetAttrInt("num_experts");
  if (int rc = check_permute(args, experts)) return rc;
  const int64_t tokens = x.dim(0), h = x.dim(1), k = ei.dim(1);
  const size_t row_bytes = h * element_size(x.dtype);  // 0 for H = 0: empty rows, nothing to copy
  const int32_t *idx = ei.as<int32_t>();
  const int64_t n = tokens * k;
  for (int64_t i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= experts)
      return fail(op, "expert_idx[%lld][%lld] = %d is outside [0, %lld)", (long long)(i / k),
                  (long long)(i % k), idx[i], (long long)experts);
  // counting sort: histogram, exclusive prefix sums, then slots in flat order (stable)
  int64_t *count = counts.as<int64_t>();
  std::fill(count, count + experts, int64_t{0});
  for (int64_t i = 0; i < n; ++i) ++count[idx[i]];
  std::vector<int64_t> next(experts);
  for (int64_t e = 0, start = 0; e < experts; ++e) {
    next[e] = start;
    start += count[e];
  }
  int32_t *dest = sorted.as<int32_t>();
  for (int64_t i = 0; i < n; ++i) dest[i] = static_cast<int32_t>(next[idx[i]]++);
  // bitwise row copies, whatever the dtype
  const char *src = x.as<char>();
  char *out = permuted.as<char>();
  if (row_bytes == 0) return 0;
#pragma omp parallel for schedule(static) if (worth_threads(n * row_bytes))
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + dest[i] * row_bytes, src + (i / k) * row_bytes, row_bytes);
  return 0;
}

// inputs: permuted [T*K, H], sorted_index [T*K] int32, probs [T, K] or None; output: out [T, H].
// attr top_k (used without probs).
MOE_KERNEL(MoeTokenUnpermute)(int nparam, void **params, int *ndims, int64_t **shapes,
                                 const char **dtypes, void *stream, void *extra_ptr) {
  const char *op = "moe_token_unpermute";
  const Args args{nparam, params, ndims, shapes, dtypes};
  const Arg permuted = args[0], sorted = args[1], probs = args[2], out = args[3];
  int64_t tokens, k;
  if (int rc = check_unpermute(args, static_cast<Extra *>(extra_ptr), &tokens, &k)) return rc;
  const int64_t n = permuted.dim(0), h = permuted.dim(1);
  if (int rc = check_permutation(op, sorted.as<int32_t>(), n)) return rc;
  return dispatch_rows_probs(op, permuted.dtype, probs.dtype, [&](auto tag, auto ptag) {
    using T = decltype(tag);
    using P = decltype(ptag);
    unpermute<T, P>(permuted.as<T>(), sorted.as<int32_t>(), probs.present() ? probs.as<P>() : nullptr,
                    tokens, k, h, out.as<T>());
    return 0;
  });
}

// inputs: permuted [T*K, H], sorted_index [T*K] int32, probs [T, K] or None, grad_out [T, H];
// outputs: grad_permuted [T*K, H], grad_probs [T, K] (dtype of probs, float32 without probs).
MOE_KERNEL(MoeTokenUnpermuteBackward)(int nparam, void **params, int *ndims, int64_t **shapes,
                                         const char **dtypes, void *stream, void *extra_ptr) {
  const char *op = "moe_token_unpermute_backward";
  const Args args{nparam, params, ndims, shapes, dtypes};
  const Arg permuted = args[0], sorted = args[1], probs = args[2], dout = args[3];
  const Arg d_permuted = args[4], d_probs = args[5];
  int64_t tokens, k;
  if (int rc = check_unpermute_backward(args, static_cast<Extra *>(extra_ptr), &tokens, &k)) return rc;
  const int64_t n = permuted.dim(0), h = permuted.dim(1);
  if (int rc = check_permutation(op, sorted.as<int32_t>(), n)) return rc;
  return dispatch_rows_probs(op, permuted.dtype, d_probs.dtype, [&](auto tag, auto ptag) {
    using T = decltype(tag);
    using P = decltype(ptag);
    unpermute_backward<T, P>(permuted.as<T>(), sorted.as<int32_t>(),
                             probs.present() ? probs.as<P>() : nullptr, dout.as<T>(), tokens, k, h,
                             d_permuted.as<T>(), d_probs.as<P>());
    return 0;
  });
}
