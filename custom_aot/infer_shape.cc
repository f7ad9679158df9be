// Output shapes of every kernel for MindSpore's own shape inference: <Kernel>InferShape. MindSpore
// calls them while it builds a graph and, when a dimension is unknown until run time (GRAPH mode
// with `set_inputs(Tensor(shape=[None, ...]))`), again before every launch, where the Python infer
// functions cannot run. They only compute shapes and propagate unknowns (-1: a dimension, [-2]:
// the rank); they never reject anything: at graph build the Python infer functions validate right
// after them (TypeError/ValueError with their messages), and at run time the kernels check the
// sizes they rely on before touching memory.
//
// MindSpore passes the shapes of the tensor inputs that are present, in order: an absent optional
// input is skipped, so every shape used here is of a required input or located with an attribute.
#include <vector>

#include "common.h"

// MindSpore's C++ infer-shape interface returns std::vector from extern "C" functions.
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wreturn-type-c-linkage"
#endif

namespace moe {
namespace {

using Shape = std::vector<int64_t>;
using Shapes = std::vector<Shape>;

constexpr int64_t kAny = -1;       // unknown dimension
constexpr int64_t kAnyRank = -2;   // unknown rank: the shape is [-2]

Shape shape_of(int *ndims, int64_t **shapes, int i) {
  return Shape(shapes[i], shapes[i] + ndims[i]);
}

bool any_rank(const Shape &s) { return s.size() == 1 && s[0] == kAnyRank; }

// Dimension i of a shape expected to have `rank` dimensions (kAny when unknown).
int64_t dim(const Shape &s, int i, size_t rank) {
  if (any_rank(s) || s.size() != rank) return kAny;
  return s[i < 0 ? s.size() + i : i];
}

int64_t product(int64_t a, int64_t b) { return a < 0 || b < 0 ? kAny : a * b; }

Extra *attrs(void *extra) { return static_cast<Extra *>(extra); }

// x [M, N] (bias [N] second when given); y, expert_idx [M, k], x_norm [M, N].
Shapes gating(int *ndims, int64_t **shapes, Extra *extra) {
  const Shape x = shape_of(ndims, shapes, 0);
  const int64_t m = dim(x, 0, 2), n = dim(x, 1, 2), k = extra->GetAttrInt("k");
  return {{m, k}, {m, k}, {m, n}};
}

// x_norm [M, N], grad_y [M, K], expert_idx [M, K] -> grad_x [M, N].
Shape gating_backward(int *ndims, int64_t **shapes) {
  const Shape x_norm = shape_of(ndims, shapes, 0);
  return {dim(x_norm, 0, 2), dim(x_norm, 1, 2)};
}

// x [.., 2H] -> [.., H]; unknown rank stays unknown.
Shape halved(const Shape &x) {
  if (any_rank(x)) return {kAnyRank};
  Shape y = x;
  if (!y.empty() && y.back() >= 0) y.back() /= 2;
  return y;
}

// x [.., 2H] -> [.., 1]
Shape per_row(const Shape &x) {
  if (any_rank(x)) return {kAnyRank};
  Shape y = x;
  if (!y.empty()) y.back() = 1;
  return y;
}

// x [M, H] (or [M, K] with weight [G, K, N] / [G, N, K] / [M, N]) -> the grouped product.
Shape grouped_matmul(int *ndims, int64_t **shapes, Extra *extra) {
  const Shape x = shape_of(ndims, shapes, 0), w = shape_of(ndims, shapes, 1);
  const Shape groups = shape_of(ndims, shapes, 2);
  if (extra->GetAttrBool("transpose_x")) return {dim(groups, 0, 1), dim(x, 1, 2), dim(w, 1, 2)};
  // weight [G, K, N] or one for every group, [K, N] (transpose_weight: [G, N, K] or [N, K])
  const size_t rank = w.size() == 2 ? 2 : 3;
  return {dim(x, 0, 2), dim(w, extra->GetAttrBool("transpose_weight") ? -2 : -1, rank)};
}

// K, the slots per token: probs.shape[1] with probs (the third input), else the attribute top_k.
int64_t slots(int *ndims, int64_t **shapes, Extra *extra) {
  if (extra->GetAttrBool("with_probs")) return dim(shape_of(ndims, shapes, 2), 1, 2);
  const int64_t k = extra->GetAttrInt("top_k");
  return k > 0 ? k : 1;
}

// T: `known` (a dimension that is T) when known, else from the T*K permuted rows (the kernels
// reject rows that are no multiple of K).
int64_t tokens(int64_t known, int64_t rows, int64_t k) {
  if (known >= 0) return known;
  return rows < 0 || k <= 0 ? kAny : rows / k;
}

}  // namespace
}  // namespace moe

using namespace moe;

MOE_EXPORT Shapes MoeGatingTopKInferShape(int *ndims, int64_t **shapes, void *extra) {
  return gating(ndims, shapes, attrs(extra));
}

MOE_EXPORT Shape MoeGatingTopKBackwardInferShape(int *ndims, int64_t **shapes, void *) {
  return gating_backward(ndims, shapes);
}

MOE_EXPORT Shape MoeGatingTopKSoftmaxBackwardInferShape(int *ndims, int64_t **shapes, void *) {
  return gating_backward(ndims, shapes);
}

// moe_gating_top_k_grad: the same, grad_x_norm [M, N] (when given) fourth
MOE_EXPORT Shape MoeGatingTopKGradInferShape(int *ndims, int64_t **shapes, void *) {
  return gating_backward(ndims, shapes);
}

// swiglu_group: x [.., 2H] -> y, y_origin [.., H]
MOE_EXPORT Shapes SwigluGroupInferShape(int *ndims, int64_t **shapes, void *) {
  const Shape y = halved(shape_of(ndims, shapes, 0));
  return {y, y};
}

// swiglu_group_quant_grad: grad_y [.., H], x [.., 2H], ... -> grad_x [.., 2H], grad_weight [.., 1]
MOE_EXPORT Shapes SwigluGroupQuantGradInferShape(int *ndims, int64_t **shapes, void *) {
  const Shape x = shape_of(ndims, shapes, 1);
  return {x, per_row(x)};
}

// moe_ffn: x [M, H], ... -> y [M, H]
MOE_EXPORT Shape MoeFFNInferShape(int *ndims, int64_t **shapes, void *) {
  const Shape x = shape_of(ndims, shapes, 0);
  return {dim(x, 0, 2), dim(x, 1, 2)};
}

// moe_ffn_activation_grad: h, grad_a -> grad_h, act(h), both shaped like h
MOE_EXPORT Shapes MoeFFNActivationGradInferShape(int *ndims, int64_t **shapes, void *) {
  const Shape h = shape_of(ndims, shapes, 0);
  return {h, h};
}

// cast: x -> y of x's shape
MOE_EXPORT Shape CastInferShape(int *ndims, int64_t **shapes, void *) {
  return shape_of(ndims, shapes, 0);
}

// dequantize: weight [E, K, N], scale [E, N], index [G] -> [G, K, N]
MOE_EXPORT Shape DequantizeInferShape(int *ndims, int64_t **shapes, void *) {
  const Shape w = shape_of(ndims, shapes, 0);
  return {dim(shape_of(ndims, shapes, 2), 0, 1), dim(w, 1, 3), dim(w, 2, 3)};
}

// weight_quant_grouped_matmul: x [M, K], weight [E, K, N], scale [E, N], group_list [E] -> [M, N]
MOE_EXPORT Shape WeightQuantGroupedMatmulInferShape(int *ndims, int64_t **shapes, void *) {
  return {dim(shape_of(ndims, shapes, 0), 0, 2), dim(shape_of(ndims, shapes, 1), 2, 3)};
}

// rms_norm: x [..., H], weight [H] -> y of x's shape
MOE_EXPORT Shape RmsNormInferShape(int *ndims, int64_t **shapes, void *) {
  return shape_of(ndims, shapes, 0);
}

// decode_attention: query [B, N, 1, D], ..., key_cache, value_cache [B, Nkv, L, D], ...
//   -> out of query's shape, the two caches' shapes
MOE_EXPORT Shapes DecodeAttentionInferShape(int *ndims, int64_t **shapes, void *) {
  return {shape_of(ndims, shapes, 0), shape_of(ndims, shapes, 5), shape_of(ndims, shapes, 6)};
}

// add_rms_norm: x [..., H], residual, weight [H] -> y and sum of x's shape
MOE_EXPORT Shapes AddRmsNormInferShape(int *ndims, int64_t **shapes, void *) {
  const Shape x = shape_of(ndims, shapes, 0);
  return {x, x};
}

MOE_EXPORT Shape GroupedMatmulInferShape(int *ndims, int64_t **shapes, void *extra) {
  return grouped_matmul(ndims, shapes, attrs(extra));
}

// moe_token_permute: x [T, H], expert_idx [T, K]
//   -> permuted [T*K, H], sorted_index [T*K], counts [E]
MOE_EXPORT Shapes MoeTokenPermuteInferShape(int *ndims, int64_t **shapes, void *extra) {
  const Shape x = shape_of(ndims, shapes, 0), idx = shape_of(ndims, shapes, 1);
  const int64_t t = dim(x, 0, 2);
  const int64_t n = product(t, dim(idx, 1, 2));
  return {{n, dim(x, 1, 2)}, {n}, {attrs(extra)->GetAttrInt("num_experts")}};
}

// moe_token_unpermute: permuted [T*K, H], sorted_index [T*K], probs [T, K] or None -> [T, H]
MOE_EXPORT Shape MoeTokenUnpermuteInferShape(int *ndims, int64_t **shapes, void *extra) {
  const Shape permuted = shape_of(ndims, shapes, 0);
  const bool with_probs = attrs(extra)->GetAttrBool("with_probs");
  const int64_t probs_rows = with_probs ? dim(shape_of(ndims, shapes, 2), 0, 2) : kAny;
  const int64_t t = tokens(probs_rows, dim(permuted, 0, 2), slots(ndims, shapes, attrs(extra)));
  return {t, dim(permuted, 1, 2)};
}

// moe_token_unpermute_backward: permuted, sorted_index, probs or None, grad_out [T, H]
//   -> grad_permuted (shaped like permuted), grad_probs [T, K]
MOE_EXPORT Shapes MoeTokenUnpermuteBackwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  const Shape permuted = shape_of(ndims, shapes, 0);
  const bool with_probs = attrs(extra)->GetAttrBool("with_probs");
  const Shape grad_out = shape_of(ndims, shapes, with_probs ? 3 : 2);
  const int64_t k = slots(ndims, shapes, attrs(extra));
  // T: grad_out's rows, else probs' rows (whichever is known: the Python inference uses both)
  int64_t t = dim(grad_out, 0, 2);
  if (t < 0 && with_probs) t = dim(shape_of(ndims, shapes, 2), 0, 2);
  return {permuted, {tokens(t, dim(permuted, 0, 2), k), k}};
}
