// Fuzzes every kernel of the library through MindSpore's AOT ABI (aot_call.h), for a build with
// -fsanitize=address,undefined (tools/fuzz_kernels.py builds and runs it).
//
//   fuzz_kernels LIBRARY [--seconds S | --cases N] [--seed N] [--kernel NAME] [--dump FILE]
//                        [--replay CASE]
//
// Each case draws a kernel, random shapes (0-sized dimensions, one row, K == N, E == 1, E == 256,
// every attribute at its edges), random values (NaN, +-inf, denormals, huge values; indices and
// counts out of range, negative, at the int64 extremes) and decides whether to break one thing
// the kernel must refuse (a shape relation, a dtype, a rank, an attribute, the argument count,
// the data). It then checks:
//   - the verdict: a valid case is accepted, a broken one rejected (with a message);
//   - a rejected call writes nothing: every output byte keeps its canary;
//   - inputs are never modified;
//   - an accepted call, repeated with other canaries and another OpenMP thread count, gives the
//     same bytes: every output byte is written, and the result is deterministic;
//   - accepted results match the golden model: written to FILE (--dump) for the numpy model
//     ms_moe_ops/reference.py, which tools/fuzz_kernels.py compares.
// Prints one line per kernel (cases, accepted, rejected) and one line per failed invariant; exit
// status 1 when an invariant failed. A case is reproducible from its number: --replay CASE.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "aot_call.h"

namespace {

using harness::Attrs;
using harness::Rng;
using harness::Tensor;

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
const char *const kFloats[] = {"float32", "float16", "bfloat16"};
const char *const kActivations[] = {"fastgelu", "gelu", "relu", "silu"};

struct Case {
  std::string kernel;
  std::vector<std::pair<std::string, Tensor>> inputs, outputs;
  Attrs attrs;
  std::vector<std::string> attr_lines;  // "name type value" for the dump
  bool broken = false;                   // the kernel must refuse it
  std::string what;                      // what was broken

  Tensor &in(const std::string &name) { return find(inputs, name); }
  Tensor &out(const std::string &name) { return find(outputs, name); }
  void set_int(const std::string &n, int64_t v) { attrs.set_int(n, v); note(n, "i", std::to_string(v)); }
  void set_bool(const std::string &n, bool v) { attrs.set_bool(n, v); note(n, "b", v ? "1" : "0"); }
  void set_float(const std::string &n, float v) {
    attrs.set_float(n, v);
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.9g", v);
    note(n, "f", buf);
  }
  void set_str(const std::string &n, const std::string &v) { attrs.set_str(n, v); note(n, "s", v); }

 private:
  static Tensor &find(std::vector<std::pair<std::string, Tensor>> &list, const std::string &name) {
    for (auto &p : list)
      if (p.first == name) return p.second;
    std::fprintf(stderr, "fuzz_kernels: no argument '%s'\n", name.c_str());
    std::abort();
  }
  void note(const std::string &n, const char *type, const std::string &v) {
    for (auto &line : attr_lines)
      if (line.rfind(n + " ", 0) == 0) line = n + " " + type + " " + v;
    for (auto &line : attr_lines)
      if (line.rfind(n + " ", 0) == 0) return;
    attr_lines.push_back(n + " " + type + " " + v);
  }
};

// -- random shapes and values -------------------------------------------------------------------

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed), hostile_(rng_.integer(0, 3) == 0) {}
  Rng &rng() { return rng_; }
  bool chance(int percent) { return rng_.integer(0, 99) < percent; }
  int64_t pick(std::initializer_list<int64_t> v) { return *(v.begin() + rng_.integer(0, v.size() - 1)); }
  const char *pick(const char *const *v, int n) { return v[rng_.integer(0, n - 1)]; }
  // a size in [lo, hi], its edges often
  int64_t size(int64_t lo, int64_t hi) {
    switch (rng_.integer(0, 5)) {
      case 0: return lo;
      case 1: return std::min(hi, lo + 1);
      case 2: return hi;
      default: return rng_.integer(lo, hi);
    }
  }
  // a float value: mostly moderate, in hostile cases also NaN, +-inf, denormals, huge
  double value(double scale = 2.0) {
    if (hostile_ && chance(15)) {
      static const double special[] = {NAN, -NAN, INFINITY, -INFINITY, 1e-40, -1e-42, 3e38,
                                       -3e38, 65504.0, 1e5, 0.0, -0.0};
      return special[rng_.integer(0, 11)];
    }
    return static_cast<double>(rng_.integer(-1024, 1024)) * (scale / 1024.0);
  }
  Tensor floats(const std::string &dtype, std::vector<int64_t> shape, double scale = 2.0) {
    Tensor t = harness::zeros(dtype, std::move(shape));
    std::vector<double> v(t.numel());
    for (double &x : v) x = value(scale);
    return harness::from_values(dtype, t.shape, v);
  }
  Tensor ints(const std::string &dtype, std::vector<int64_t> shape, int64_t lo, int64_t hi) {
    Tensor t = harness::zeros(dtype, std::move(shape));
    for (int64_t i = 0; i < t.numel(); ++i) put_int(t, i, rng_.integer(lo, hi));
    return t;
  }
  // int8 operands of the quant path: uniform, or one of the byte patterns that the avx2 path's
  // products must get exactly right (-128 everywhere, the largest |x| * |w| pairs, weights in
  // [-127, 127] as the package quantises them, with a rare -128)
  Tensor bytes(std::vector<int64_t> shape) {
    Tensor t = harness::zeros("int8", std::move(shape));
    const int64_t mode = rng_.integer(0, 4);
    static const int8_t extremes[] = {-128, -128, -127, 127};
    for (int64_t i = 0; i < t.numel(); ++i) {
      int64_t v = rng_.integer(-128, 127);
      if (mode == 1) v = -128;
      else if (mode == 2) v = extremes[rng_.integer(0, 3)];
      else if (mode == 3) v = rng_.integer(0, 999) == 0 ? -128 : rng_.integer(-127, 127);
      put_int(t, i, v);
    }
    return t;
  }
  static void put_int(Tensor &t, int64_t i, int64_t v) {
    if (t.dtype == "int64") t.as<int64_t>()[i] = v;
    else if (t.dtype == "int32") t.as<int32_t>()[i] = static_cast<int32_t>(v);
    else if (t.dtype == "int8") t.as<int8_t>()[i] = static_cast<int8_t>(v);
    else if (t.dtype == "uint64") t.as<uint64_t>()[i] = static_cast<uint64_t>(v);
  }
  // counts of g groups over m rows (sum m, or less when padded), some empty
  std::vector<int64_t> split(int64_t g, int64_t m, bool padded) {
    int64_t rows = padded && m > 0 ? rng_.integer(0, m) : m;
    std::vector<int64_t> c(g, 0);
    for (int64_t r = 0; r < rows; ++r) ++c[rng_.integer(0, g - 1)];
    return c;
  }
  bool hostile() const { return hostile_; }

 private:
  Rng rng_;
  bool hostile_;
};

Tensor counts_tensor(const std::vector<int64_t> &counts, bool cumulative) {
  Tensor t = harness::zeros("int64", {static_cast<int64_t>(counts.size())});
  int64_t sum = 0;
  for (size_t i = 0; i < counts.size(); ++i) t.as<int64_t>()[i] = cumulative ? (sum += counts[i]) : counts[i];
  return t;
}

// -- what breaking a case can do ----------------------------------------------------------------

// The same tensor with another shape (one dimension moved by +-1, or another rank) and fresh
// contents: a broken shape relation.
Tensor reshaped(Gen &g, const Tensor &t, bool rank) {
  std::vector<int64_t> shape = t.shape;
  if (rank || shape.empty()) {
    if (!shape.empty() && g.chance(50)) shape.pop_back();
    else shape.push_back(1);
  } else {
    int64_t &d = shape[g.rng().integer(0, shape.size() - 1)];
    d = d == 0 || g.chance(50) ? d + 1 : d - 1;
  }
  if (t.dtype == "int32" || t.dtype == "int64" || t.dtype == "int8" || t.dtype == "uint64")
    return g.ints(t.dtype, shape, 0, 0);
  return g.floats(t.dtype, shape);
}

// The same shape in another dtype.
Tensor retyped(Gen &g, const Tensor &t) {
  static const char *const others[] = {"float32", "float16", "bfloat16", "int32", "int64", "float64"};
  std::string d = t.dtype;
  while (d == t.dtype) d = others[g.rng().integer(0, 5)];
  return d.rfind("int", 0) == 0 ? g.ints(d, t.shape, 0, 0) : g.floats(d, t.shape);
}

// Breaks one shape, dtype or rank of an argument the kernel requires (inputs or outputs).
void break_argument(Gen &g, Case &c, std::vector<std::string> names) {
  names.erase(std::remove_if(names.begin(), names.end(), [&](const std::string &n) {
                for (auto *list : {&c.inputs, &c.outputs})
                  for (auto &p : *list)
                    if (p.first == n) return p.second.dtype == "none";
                return true;
              }),
              names.end());
  if (names.empty()) return;
  const std::string name = names[g.rng().integer(0, names.size() - 1)];
  auto *list = &c.inputs;
  for (auto &p : c.outputs)
    if (p.first == name) list = &c.outputs;
  for (auto &p : *list) {
    if (p.first != name) continue;
    const int how = static_cast<int>(g.rng().integer(0, 2));
    p.second = how == 0 ? reshaped(g, p.second, false) : how == 1 ? reshaped(g, p.second, true)
                                                                  : retyped(g, p.second);
    c.broken = true;
    c.what = std::string(how == 0 ? "shape of " : how == 1 ? "rank of " : "dtype of ") + name;
    return;
  }
}

// -- the kernels' cases ---------------------------------------------------------------------------

Case gating(Gen &g) {
  Case c;
  c.kernel = "MoeGatingTopK";
  const int64_t n = g.chance(10) ? g.pick({2048, 1024, 257}) : g.pick({1, 2, 3, 4, 8, 16, 32, 64, 256, 96});
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d <= n; ++d)
    if (n % d == 0) divisors.push_back(d);
  const int64_t groups = g.chance(40) ? 1 : divisors[g.rng().integer(0, divisors.size() - 1)];
  const int64_t per = n / groups;
  const int64_t mode = groups > 1 && per < 2 ? 0 : g.rng().integer(0, 1);
  const int64_t k_group = g.size(1, groups);
  const int64_t k = g.chance(20) ? std::min<int64_t>(k_group * per, g.pick({32, 33})) : g.size(1, k_group * per);
  const int64_t m = n >= 1024 ? g.size(0, 3) : g.size(0, 40);
  const char *dt = g.pick(kFloats, 3);
  c.inputs = {{"x", g.floats(dt, {m, n}, 6.0)}, {"bias", g.chance(50) ? g.floats(dt, {n}, 0.5) : Tensor()}};
  c.outputs = {{"y", harness::zeros(dt, {m, k})}, {"expert_idx", harness::zeros("int32", {m, k})},
               {"x_norm", harness::zeros("float32", {m, n})}};
  if (g.chance(15)) std::fill_n(c.in("x").bytes.begin(), c.in("x").bytes.size(), 0);  // all ties
  c.set_int("k", k);
  c.set_int("k_group", k_group);
  c.set_int("group_count", groups);
  c.set_int("group_select_mode", mode);
  c.set_int("renorm", g.rng().integer(0, 1));
  c.set_int("norm_type", g.rng().integer(0, 1));
  c.set_bool("out_flag", true);
  c.set_float("routed_scaling_factor", static_cast<float>(g.pick({1, 2, 0})) * 1.25f);
  c.set_float("eps", 1e-20f);
  if (!g.chance(35)) return c;
  c.broken = true;
  switch (g.rng().integer(0, 9)) {
    case 0: c.set_int("k", k_group * per + g.rng().integer(1, 40)); c.what = "k above the kept experts"; break;
    case 1: c.set_int("k", g.pick({0, -1})); c.what = "k < 1"; break;
    case 2: c.set_int("k_group", g.pick({0, groups + 1})); c.what = "k_group"; break;
    case 3: c.set_int("group_count", g.pick({0, -2, n + 1})); c.what = "group_count"; break;
    case 4:
      c.set_int(g.pick(std::vector<const char *>{"group_select_mode", "renorm", "norm_type"}.data(), 3),
                g.pick({2, -1}));
      c.what = "a 0/1 attribute";
      break;
    case 5:
      if (n < 2) { c.broken = false; break; }
      c.set_int("group_count", n);
      c.set_int("group_select_mode", 1);
      c.set_int("k_group", 1);
      c.set_int("k", 1);
      c.what = "group_select_mode=1 with one expert per group";
      break;
    case 6: {  // N out of [1, 2048]
      const int64_t bad = g.pick({0, 2049});
      c.inputs[0].second = g.floats(dt, {m, bad});
      c.inputs[1].second = Tensor();
      c.out("x_norm") = harness::zeros("float32", {m, bad});
      c.what = "N out of range";
      break;
    }
    case 7: c.inputs.pop_back(); c.outputs.pop_back(); c.what = "argument count"; break;
    default: break_argument(g, c, {"x", "y", "expert_idx", "x_norm", "bias"}); break;
  }
  if (c.what.empty()) c.broken = false;
  if (c.broken && c.what == "shape of bias" && c.in("bias").dtype == "none") c.broken = false;
  return c;
}

// MoeGatingTopKBackward, MoeGatingTopKSoftmaxBackward, or the whole backward MoeGatingTopKGrad
// (grad_x_norm given or not, sigmoid or softmax).
Case gating_backward(Gen &g) {
  Case c;
  const int64_t which = g.rng().integer(0, 2);
  const bool whole = which == 2;
  c.kernel = which == 0 ? "MoeGatingTopKBackward" : which == 1 ? "MoeGatingTopKSoftmaxBackward"
                                                               : "MoeGatingTopKGrad";
  const int64_t n = g.chance(10) ? g.pick({2048, 1500}) : g.size(1, 64);
  const int64_t k = g.chance(25) ? n : g.size(1, std::min<int64_t>(n, 12));
  const int64_t m = n > 512 ? g.size(0, 3) : g.size(0, 30);
  const char *dt = g.pick(kFloats, 3);
  Tensor xn = g.floats("float32", {m, n}, 0.5);
  for (int64_t i = 0; i < xn.numel(); ++i)  // scores in [0, 1] mostly
    if (std::isfinite(xn.as<float>()[i])) xn.as<float>()[i] = std::fabs(xn.as<float>()[i]);
  c.inputs = {{"x_norm", xn}, {"grad_y", g.floats(dt, {m, k})}, {"expert_idx", g.ints("int32", {m, k}, 0, n - 1)}};
  if (whole) c.inputs.push_back({"grad_x_norm", g.chance(70) ? g.floats("float32", {m, n}) : Tensor()});
  c.outputs = {{"grad_x", harness::zeros(dt, {m, n})}};
  c.set_int("renorm", g.rng().integer(0, 1));
  c.set_int("norm_type", whole ? g.rng().integer(0, 1) : 1);
  c.set_float("routed_scaling_factor", 2.5f);
  c.set_float("eps", 1e-20f);
  if (!g.chance(35)) return c;
  c.broken = true;
  switch (g.rng().integer(0, whole ? 5 : 4)) {
    case 0:
    case 1:
      if (m * k == 0) { c.broken = false; break; }
      Gen::put_int(c.in("expert_idx"), g.rng().integer(0, m * k - 1),
                   g.pick({-1, n, INT32_MIN, INT32_MAX}));
      c.what = "expert index out of range";
      break;
    case 2: {  // K > N, or N > 2048
      const bool wide = g.chance(50);
      const int64_t nn = wide ? 2049 : n, kk = wide ? k : n + 1;
      c.inputs[0].second = g.floats("float32", {m, nn}, 0.5);
      c.inputs[1].second = g.floats(dt, {m, kk});
      c.inputs[2].second = g.ints("int32", {m, kk}, 0, 0);
      if (whole && c.in("grad_x_norm").dtype != "none") c.in("grad_x_norm") = g.floats("float32", {m, nn});
      c.outputs[0].second = harness::zeros(dt, {m, nn});
      c.what = wide ? "N above 2048" : "K above N";
      break;
    }
    case 3: c.outputs.clear(); c.what = "argument count"; break;
    case 5:  // the whole backward's 0/1 attributes
      c.set_int(g.chance(50) ? "norm_type" : "renorm", g.pick({2, -1}));
      c.what = "a 0/1 attribute";
      break;
    default:
      break_argument(g, c, {"x_norm", "grad_y", "expert_idx", "grad_x_norm", "grad_x"});
      break;
  }
  return c;
}

// x [T, 2H] or [B, S, 2H]: the leading shape, H and the row count
std::vector<int64_t> swiglu_rows(Gen &g, int64_t *h, int64_t *rows) {
  *h = g.chance(10) ? g.pick({512, 513, 1040}) : g.size(0, 12);
  std::vector<int64_t> lead;
  if (g.chance(30))
    lead = {g.size(0, 3), g.size(0, 4)};
  else
    lead = {*h > 500 ? g.size(0, 3) : g.size(0, 20)};
  *rows = 1;
  for (int64_t d : lead) *rows *= d;
  return lead;
}

std::vector<int64_t> with_last(std::vector<int64_t> lead, int64_t last) {
  lead.push_back(last);
  return lead;
}

Tensor group_counts(Gen &g, int64_t rows) {
  const int64_t groups = g.size(0, 5);
  Tensor t = harness::zeros("int64", {groups});
  for (int64_t i = 0; i < groups; ++i)
    t.as<int64_t>()[i] = g.chance(15) ? g.pick({kI64Max, kI64Max - 1, int64_t(1) << 62}) : g.size(0, rows + 2);
  return t;
}

void swiglu_break_counts(Gen &g, Case &c) {
  Tensor &gi = c.in("group_index");
  if (gi.dtype == "none" || gi.numel() == 0) return;
  gi.as<int64_t>()[g.rng().integer(0, gi.numel() - 1)] = g.pick({-1, kI64Min, -(int64_t(1) << 40)});
  c.broken = true;
  c.what = "negative group count";
}

Case swiglu(Gen &g) {
  Case c;
  c.kernel = "SwigluGroup";
  int64_t h, rows;
  const std::vector<int64_t> lead = swiglu_rows(g, &h, &rows);
  const char *dt = g.pick(kFloats, 3);
  c.inputs = {{"x", g.floats(dt, with_last(lead, 2 * h), 6.0)},
              {"weight", g.chance(50) ? g.floats("float32", with_last(lead, 1)) : Tensor()},
              {"group_index", g.chance(50) ? group_counts(g, rows) : Tensor()}};
  c.outputs = {{"y", harness::zeros(dt, with_last(lead, h))}, {"y_origin", harness::zeros(dt, with_last(lead, h))}};
  c.set_float("clamp_limit", static_cast<float>(g.chance(50) ? 0.0 : g.pick({1, -1, 7}) * 0.75));
  if (!g.chance(35)) return c;
  switch (g.rng().integer(0, 3)) {
    case 0: swiglu_break_counts(g, c); break;
    case 1:
      c.inputs[0].second = g.floats(dt, with_last(lead, 2 * h + 1));
      c.broken = true;
      c.what = "odd last dimension";
      break;
    default: break_argument(g, c, {"x", "y", "y_origin"}); break;
  }
  return c;
}

Case swiglu_backward(Gen &g) {
  Case c;
  c.kernel = "SwigluGroupQuantGrad";
  int64_t h, rows;
  const std::vector<int64_t> lead = swiglu_rows(g, &h, &rows);
  const char *dt = g.pick(kFloats, 3);
  const bool weighted = g.chance(50);
  c.inputs = {{"grad_y", g.floats(dt, with_last(lead, h))},
              {"x", g.floats(dt, with_last(lead, 2 * h), 6.0)},
              {"weight", weighted ? g.floats("float32", with_last(lead, 1)) : Tensor()},
              {"y_origin", weighted || g.chance(50) ? g.floats(dt, with_last(lead, h)) : Tensor()},
              {"group_index", g.chance(50) ? group_counts(g, rows) : Tensor()}};
  c.outputs = {{"grad_x", harness::zeros(dt, with_last(lead, 2 * h))},
               {"grad_weight", harness::zeros("float32", with_last(lead, 1))}};
  c.set_float("clamp_limit", static_cast<float>(g.chance(50) ? 0.0 : g.pick({1, -1, 7}) * 0.75));
  if (!g.chance(35)) return c;
  switch (g.rng().integer(0, 3)) {
    case 0: swiglu_break_counts(g, c); break;
    case 1:
      if (!weighted) break;
      c.in("y_origin") = Tensor();
      c.broken = true;
      c.what = "weight without y_origin";
      break;
    default: break_argument(g, c, {"grad_y", "x", "grad_x", "grad_weight"}); break;
  }
  return c;
}

// counts (or cumulative ends) that do not fit: the kernels must refuse them
void break_counts(Gen &g, Case &c, const std::string &name, int64_t m, bool cumulative, bool padded) {
  Tensor &t = c.in(name);
  const int64_t n = t.numel();
  c.broken = true;
  switch (g.rng().integer(0, 3)) {
    case 0: t.as<int64_t>()[g.rng().integer(0, n - 1)] = g.pick({-1, kI64Min}); c.what = "negative count"; break;
    case 1: t.as<int64_t>()[n - 1] = cumulative ? m + 1 : t.as<int64_t>()[n - 1] + m + 1; c.what = "counts beyond M"; break;
    case 2: t.as<int64_t>()[g.rng().integer(0, n - 1)] = kI64Max; c.what = "count INT64_MAX"; break;
    default:
      if (padded || m == 0) { c.broken = false; break; }
      if (cumulative) {
        t.as<int64_t>()[n - 1] = m - 1;
        if (n > 1 && t.as<int64_t>()[n - 2] > m - 1) t.as<int64_t>()[n - 2] = m - 1;
      } else {
        int64_t i = n - 1;
        while (t.as<int64_t>()[i] == 0) --i;
        --t.as<int64_t>()[i];
      }
      c.what = "counts short of M without padded";
  }
}

Case grouped_matmul(Gen &g) {
  Case c;
  c.kernel = "GroupedMatmul";
  // plain, transpose_weight, transpose_x; either rows form may have one 2-D weight for every group
  const int form = static_cast<int>(g.rng().integer(0, 2));
  const bool shared = form != 2 && g.chance(25);
  const int64_t groups = g.chance(5) ? 256 : g.size(1, 6);
  const int64_t tiny = groups > 8;
  const int64_t m = g.size(0, tiny ? 8 : 40), k = g.size(0, tiny ? 3 : 24), n = g.chance(15) ? k : g.size(0, tiny ? 3 : 24);
  const bool cumulative = g.chance(40), padded = g.chance(50);
  const char *dt = g.pick(kFloats, 3);
  std::vector<int64_t> w_shape = form == 2 ? std::vector<int64_t>{m, n}
                                 : form == 1 ? std::vector<int64_t>{groups, n, k} : std::vector<int64_t>{groups, k, n};
  if (shared) w_shape.erase(w_shape.begin());
  c.inputs = {{"x", g.floats(dt, {m, k})}, {"weight", g.floats(dt, w_shape)},
              {"group_list", counts_tensor(g.split(groups, m, padded), cumulative)},
              {"bias", form != 2 && g.chance(50) ? g.floats(dt, {groups, n}) : Tensor()}};
  c.outputs = {{"out", harness::zeros(dt, form == 2 ? std::vector<int64_t>{groups, k, n} : std::vector<int64_t>{m, n})}};
  c.set_bool("transpose_x", form == 2);
  c.set_bool("transpose_weight", form == 1);
  c.set_bool("cumulative", cumulative);
  c.set_bool("padded", padded);
  if (!g.chance(35)) return c;
  switch (g.rng().integer(0, 3)) {
    case 0: break_counts(g, c, "group_list", m, cumulative, padded); break;
    case 1:
      c.set_bool(form == 2 ? "transpose_weight" : "transpose_x", true);
      c.set_bool(form == 2 ? "transpose_x" : "transpose_weight", true);
      c.broken = true;
      c.what = "both transposes";
      break;
    default: {
      // (with one weight for every group, the group count is free: group_list's shape stays)
      if (shared)
        break_argument(g, c, {"x", "weight", "out"});
      else
        break_argument(g, c, {"x", "weight", "group_list", "out"});
      // a weight of another rank can be valid by chance: [G, K, N] without its last dimension
      // as one 2-D weight, or one 2-D weight with a dimension of 1 added as [G, K, N]
      std::vector<int64_t> one = form == 1 ? std::vector<int64_t>{n, k} : std::vector<int64_t>{k, n};
      std::vector<int64_t> each = one;
      each.insert(each.begin(), groups);
      const auto &now = c.inputs[1].second.shape;
      if (c.what == "rank of weight" && form != 2 && (now == one || now == each)) {
        c.broken = false;
        c.what.clear();
      }
      break;
    }
  }
  return c;
}

Case moe_ffn(Gen &g) {
  Case c;
  c.kernel = "MoeFFN";
  const bool int8 = g.chance(35);
  const int64_t e = g.chance(10) ? 256 : g.chance(20) ? 1 : g.size(1, 6);
  const bool tiny = e > 8;
  const int64_t m = g.size(0, tiny ? 12 : 40), h = g.size(0, tiny ? 4 : 20), f = g.size(0, tiny ? 4 : 70);
  const bool cumulative = g.chance(40), padded = g.chance(40);
  const Tensor tokens = counts_tensor(g.split(e, m, padded), cumulative);
  if (int8) {
    const char *out = g.pick(kFloats, 3);
    const char *deq = g.chance(50) ? "uint64" : "float32";
    auto deq_scales = [&](std::vector<int64_t> shape) {
      Tensor t = harness::zeros(deq, std::move(shape));
      for (int64_t i = 0; i < t.numel(); ++i) {
        float v = static_cast<float>(g.rng().integer(512, 1536)) / (1024.0f * 4096.0f);
        if (g.hostile() && g.chance(5)) v = g.chance(50) ? NAN : INFINITY;
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        if (t.dtype == "uint64") t.as<uint64_t>()[i] = bits;
        else t.as<float>()[i] = v;
      }
      return t;
    };
    c.inputs = {{"x", g.bytes({m, h})}, {"expert_tokens", tokens},
                {"weight1", g.bytes({e, h, f})},
                {"bias1", g.chance(60) ? g.ints("int32", {e, f}, -3000, 3000) : Tensor()},
                {"weight2", g.bytes({e, f, h})},
                {"bias2", g.chance(60) ? g.ints("int32", {e, h}, -3000, 3000) : Tensor()},
                {"scale", g.floats("float32", {e}, 1.0)},
                {"offset", g.chance(60) ? g.floats("float32", {e}, 4.0) : Tensor()},
                {"deq_scale1", deq_scales({e, f})}, {"deq_scale2", deq_scales({e, h})}};
    c.outputs = {{"y", harness::zeros(out, {m, h})}};
  } else {
    const char *dt = g.pick(kFloats, 3);
    c.inputs = {{"x", g.floats(dt, {m, h})}, {"expert_tokens", tokens},
                {"weight1", g.floats(dt, {e, h, f}, 0.5)},
                {"bias1", g.chance(50) ? g.floats(dt, {e, f}) : Tensor()},
                {"weight2", g.floats(dt, {e, f, h}, 0.5)},
                {"bias2", g.chance(50) ? g.floats(dt, {e, h}) : Tensor()},
                {"scale", Tensor()}, {"offset", Tensor()}, {"deq_scale1", Tensor()}, {"deq_scale2", Tensor()}};
    c.outputs = {{"y", harness::zeros(dt, {m, h})}};
  }
  c.set_str("activation", g.pick(kActivations, 4));
  c.set_bool("tokens_index_flag", cumulative);
  c.set_str("output_dtype", "");
  c.set_bool("padded", padded);
  if (!g.chance(35)) return c;
  switch (g.rng().integer(0, 5)) {
    case 0:
    case 1: break_counts(g, c, "expert_tokens", m, cumulative, padded); break;
    case 2: c.set_str("activation", g.chance(50) ? "swish" : ""); c.broken = true; c.what = "activation"; break;
    case 3:
      if (int8) {
        c.in("scale") = Tensor();
        c.what = "int8 without scale";
      } else {
        c.in("scale") = g.floats("float32", {e});
        c.what = "a quantisation argument on the float path";
      }
      c.broken = true;
      break;
    default:  // (an int8 call may write any float dtype)
      break_argument(g, c, int8 ? std::vector<std::string>{"x", "expert_tokens", "weight1", "weight2"}
                                : std::vector<std::string>{"x", "expert_tokens", "weight1", "weight2", "y"});
      break;
  }
  return c;
}

Case activation_grad(Gen &g) {
  Case c;
  c.kernel = "MoeFFNActivationGrad";
  const char *dt = g.pick(kFloats, 3);
  std::vector<int64_t> shape = {g.size(0, 30), g.size(0, 40)};
  if (g.chance(20)) shape.pop_back();
  c.inputs = {{"h", g.floats(dt, shape, 8.0)}, {"grad_a", g.floats(dt, shape)}};
  c.outputs = {{"grad_h", harness::zeros(dt, shape)}, {"a", harness::zeros(dt, shape)}};
  c.set_str("activation", g.pick(kActivations, 4));
  if (!g.chance(35)) return c;
  if (g.chance(25)) {
    c.set_str("activation", "tanh");
    c.broken = true;
    c.what = "activation";
  } else {
    break_argument(g, c, {"h", "grad_a", "grad_h", "a"});
  }
  return c;
}

Case cast(Gen &g) {
  Case c;
  c.kernel = "Cast";
  const char *from = g.pick(kFloats, 3), *to = g.pick(kFloats, 3);
  std::vector<int64_t> shape = {g.size(0, 30), g.size(0, 40)};
  if (g.chance(20)) shape.pop_back();
  if (g.chance(10)) shape = {g.size(16 * 4096, 17 * 4096 + 5)};  // past the threads' blocks
  c.inputs = {{"x", g.floats(from, shape, 1e5)}};
  c.outputs = {{"y", harness::zeros(to, shape)}};
  c.set_str("dtype", to);
  if (!g.chance(35)) return c;
  auto &y = c.outputs[0].second;
  if (g.chance(30)) {  // not a float dtype: refused
    y = g.ints(g.chance(50) ? "int32" : "int64", y.shape, 0, 0);
    c.what = "dtype of y";
  } else {  // (another float dtype is a valid cast: only shapes and ranks break it)
    const bool rank = g.chance(50);
    y = reshaped(g, y, rank);
    c.what = rank ? "rank of y" : "shape of y";
  }
  c.broken = true;
  return c;
}

Case permute(Gen &g) {
  Case c;
  c.kernel = "MoeTokenPermute";
  const int64_t t = g.size(0, 30), k = g.size(0, 6), h = g.chance(15) ? 0 : g.size(0, 24);
  const int64_t e = g.chance(15) ? 256 : g.chance(15) ? 1 : g.size(1, 12);
  const char *dt = g.pick(kFloats, 3);
  c.inputs = {{"x", g.floats(dt, {t, h})}, {"expert_idx", g.ints("int32", {t, k}, 0, e - 1)}};
  c.outputs = {{"permuted", harness::zeros(dt, {t * k, h})}, {"sorted_index", harness::zeros("int32", {t * k})},
               {"counts", harness::zeros("int64", {e})}};
  c.set_int("num_experts", e);
  c.set_int("top_k", k);
  if (!g.chance(35)) return c;
  switch (g.rng().integer(0, 3)) {
    case 0:
    case 1:
      if (t * k == 0) break;
      Gen::put_int(c.in("expert_idx"), g.rng().integer(0, t * k - 1), g.pick({-1, e, INT32_MIN, INT32_MAX}));
      c.broken = true;
      c.what = "expert index out of range";
      break;
    case 2: c.set_int("num_experts", g.pick({0, -3})); c.broken = true; c.what = "num_experts"; break;
    default:  // (with no token, K and H are in no relation the kernel could check)
      if (t > 0) break_argument(g, c, {"x", "expert_idx", "permuted", "sorted_index", "counts"});
      break;
  }
  return c;
}

// a random permutation of [0, n) as int32
Tensor permutation(Gen &g, int64_t n) {
  Tensor t = harness::zeros("int32", {n});
  for (int64_t i = 0; i < n; ++i) t.as<int32_t>()[i] = static_cast<int32_t>(i);
  for (int64_t i = n - 1; i > 0; --i) std::swap(t.as<int32_t>()[i], t.as<int32_t>()[g.rng().integer(0, i)]);
  return t;
}

void break_permutation(Gen &g, Case &c, int64_t n) {
  if (n == 0) return;
  Tensor &s = c.in("sorted_index");
  const int64_t i = g.rng().integer(0, n - 1);
  if (n > 1 && g.chance(50)) {
    int64_t j = g.rng().integer(0, n - 1);
    if (j == i) j = (i + 1) % n;
    s.as<int32_t>()[i] = s.as<int32_t>()[j];
    c.what = "a repeated row in sorted_index";
  } else {
    s.as<int32_t>()[i] = static_cast<int32_t>(g.pick({-1, n, INT32_MIN, INT32_MAX}));
    c.what = "sorted_index out of range";
  }
  c.broken = true;
}

Case unpermute(Gen &g, bool backward) {
  Case c;
  c.kernel = backward ? "MoeTokenUnpermuteBackward" : "MoeTokenUnpermute";
  const int64_t t = g.size(0, 30), k = g.size(1, 6), h = g.chance(10) ? 0 : g.size(0, 24), n = t * k;
  const char *dt = g.pick(kFloats, 3);
  const int probs_kind = static_cast<int>(g.rng().integer(0, 2));  // float32, the rows' dtype, none
  const std::string pd = probs_kind == 0 ? "float32" : probs_kind == 1 ? dt : "none";
  c.inputs = {{"permuted", g.floats(dt, {n, h})}, {"sorted_index", permutation(g, n)},
              {"probs", pd == "none" ? Tensor() : g.floats(pd, {t, k})}};
  if (backward) {
    c.inputs.push_back({"grad_out", g.floats(dt, {t, h})});
    c.outputs = {{"grad_permuted", harness::zeros(dt, {n, h})},
                 {"grad_probs", harness::zeros(pd == "none" ? "float32" : pd, {t, k})}};
  } else {
    c.outputs = {{"out", harness::zeros(dt, {t, h})}};
  }
  c.set_int("top_k", pd == "none" ? (k == 1 && g.chance(50) ? 0 : k) : g.pick({0, k}));
  if (!g.chance(35)) return c;
  switch (g.rng().integer(0, 3)) {
    case 0:
    case 1: break_permutation(g, c, n); break;
    case 2:
      if (pd != "none") break;
      c.set_int("top_k", n > 0 && g.chance(50) ? n + 1 : -1);  // K must divide the rows
      c.broken = true;
      c.what = "top_k";
      break;
    default:
      if (t == 0) break;  // (with no token, K is in no relation the kernel could check)
      break_argument(g, c, backward ? std::vector<std::string>{"permuted", "sorted_index", "grad_out", "grad_permuted", "grad_probs"}
                                    : std::vector<std::string>{"permuted", "sorted_index", "out"});
      break;
  }
  return c;
}

Case weight_quant_grouped_matmul(Gen &g) {
  Case c;
  c.kernel = "WeightQuantGroupedMatmul";
  // K past the cut's chunks of 128 weight rows now and then, groups of up to 16 rows (cut) and more
  const int64_t e = g.size(1, 6), m = g.size(0, 40), k = g.chance(20) ? g.size(120, 300) : g.size(0, 24),
                n = g.size(0, 40);
  const bool padded = g.chance(50);
  c.inputs = {{"x", g.floats("float32", {m, k})},
              {"weight", g.ints("int8", {e, k, n}, -128, 127)},
              {"scale", g.floats("float32", {e, n}, 4.0)},
              {"group_list", counts_tensor(g.split(e, m, padded), false)}};
  c.outputs = {{"y", harness::zeros("float32", {m, n})}};
  c.set_bool("padded", padded);
  if (!g.chance(35)) return c;
  if (g.chance(40))
    break_counts(g, c, "group_list", m, false, padded);
  else
    break_argument(g, c, {"x", "weight", "scale", "group_list", "y"});
  if (c.what.empty()) c.broken = false;
  return c;
}

Case dequantize(Gen &g) {
  Case c;
  c.kernel = "Dequantize";
  const int64_t e = g.size(1, 6), k = g.size(0, 40), n = g.size(0, 70), rows = g.size(0, 9);
  c.inputs = {{"weight", g.ints("int8", {e, k, n}, -128, 127)},
              {"scale", g.floats("float32", {e, n}, 4.0)},
              {"index", g.ints("int32", {rows}, 0, e - 1)}};
  c.outputs = {{"y", harness::zeros("float32", {rows, k, n})}};
  if (!g.chance(35)) return c;
  if (rows > 0 && g.chance(30)) {  // an expert number outside [0, E)
    c.in("index").as<int32_t>()[g.size(0, rows - 1)] = static_cast<int32_t>(g.chance(50) ? -1 : e);
    c.broken = true;
    c.what = "index";
  } else {
    break_argument(g, c, {"weight", "scale", "index", "y"});
  }
  return c;
}

// x's shape for the norms: rows of up to 70, one axis, or past the threads' share.
std::vector<int64_t> norm_shape(Gen &g) {
  std::vector<int64_t> shape = {g.size(0, 6), g.size(0, 70)};
  if (g.chance(20)) shape.erase(shape.begin());
  if (g.chance(10)) shape = {g.size(100, 300), g.size(1000, 1100)};
  return shape;
}

Case rms_norm(Gen &g) {
  Case c;
  c.kernel = "RmsNorm";
  const std::vector<int64_t> shape = norm_shape(g);
  c.inputs = {{"x", g.floats("float32", shape, 1e5)},
              {"weight", g.floats("float32", {shape.back()}, 4.0)}};
  c.outputs = {{"y", harness::zeros("float32", shape)}};
  c.set_float("eps", g.chance(20) ? 0.f : 1e-6f);
  if (!g.chance(35)) return c;
  break_argument(g, c, {"x", "weight", "y"});
  return c;
}

Case add_rms_norm(Gen &g) {
  Case c;
  c.kernel = "AddRmsNorm";
  const std::vector<int64_t> shape = norm_shape(g);
  c.inputs = {{"x", g.floats("float32", shape, 1e5)}, {"residual", g.floats("float32", shape, 1e5)},
              {"weight", g.floats("float32", {shape.back()}, 4.0)}};
  c.outputs = {{"y", harness::zeros("float32", shape)}, {"sum", harness::zeros("float32", shape)}};
  c.set_float("eps", g.chance(20) ? 0.f : 1e-6f);
  if (!g.chance(35)) return c;
  break_argument(g, c, {"x", "residual", "weight", "y", "sum"});
  return c;
}

Case decode_attention(Gen &g) {
  Case c;
  c.kernel = "DecodeAttention";
  const int64_t b = g.size(0, 3), kv = g.size(1, 3), heads = kv * g.size(1, 4),
                d = 2 * g.size(0, 20), length = g.chance(10) ? g.size(300, 400) : g.size(1, 12);
  c.inputs = {{"query", g.floats("float32", {b, heads, 1, d})},
              {"key", g.floats("float32", {b, kv, 1, d})},
              {"value", g.floats("float32", {b, kv, 1, d})},
              {"cos", g.floats("float32", {b, 1, 1, d}, 1.0)},
              {"sin", g.floats("float32", {b, 1, 1, d}, 1.0)},
              {"key_cache", g.floats("float32", {b, kv, length, d})},
              {"value_cache", g.floats("float32", {b, kv, length, d})},
              {"mask", g.floats("float32", {b, 1, 1, length}, 4.0)},
              {"slot", g.ints("int32", {}, 0, length - 1)}};
  c.outputs = {{"out", harness::zeros("float32", {b, heads, 1, d})},
               {"key_cache_out", harness::zeros("float32", {b, kv, length, d})},
               {"value_cache_out", harness::zeros("float32", {b, kv, length, d})}};
  c.set_float("scaling", 0.125f);
  if (!g.chance(35)) return c;
  if (b > 0 && g.chance(30)) {  // a slot outside the cache
    c.in("slot").as<int32_t>()[0] = static_cast<int32_t>(g.chance(50) ? -1 : length);
    c.broken = true;
    c.what = "slot";
  } else {
    break_argument(g, c, {"query", "key", "value", "cos", "sin", "key_cache", "value_cache", "mask",
                          "slot", "out", "key_cache_out", "value_cache_out"});
  }
  return c;
}

struct KernelGen {
  const char *name;  // the family's name in the statistics
  std::function<Case(Gen &)> make;
};

const std::vector<KernelGen> &generators() {
  static const std::vector<KernelGen> all = {
      {"MoeGatingTopK", gating},
      {"MoeGatingTopK*Backward", gating_backward},
      {"SwigluGroup", swiglu},
      {"SwigluGroupQuantGrad", swiglu_backward},
      {"GroupedMatmul", grouped_matmul},
      {"MoeFFN", moe_ffn},
      {"MoeFFNActivationGrad", activation_grad},
      {"MoeTokenPermute", permute},
      {"MoeTokenUnpermute", [](Gen &g) { return unpermute(g, false); }},
      {"MoeTokenUnpermuteBackward", [](Gen &g) { return unpermute(g, true); }},
      {"Cast", cast},
      {"Dequantize", dequantize},
      {"WeightQuantGroupedMatmul", weight_quant_grouped_matmul},
      {"RmsNorm", rms_norm},
      {"AddRmsNorm", add_rms_norm},
      {"DecodeAttention", decode_attention},
  };
  return all;
}

// -- running a case -------------------------------------------------------------------------------

using SetThreads = void (*)(int);

struct Outcome {
  bool accepted;
  std::string message;
};

Outcome call(harness::Library &lib, Case &c) {
  std::vector<Tensor *> args;
  for (auto &p : c.inputs) args.push_back(&p.second);
  for (auto &p : c.outputs) args.push_back(&p.second);
  const int rc = lib.call(c.kernel, args, c.attrs);
  return {rc == 0, rc == 0 ? "" : lib.last_error()};
}

void fill(Case &c, uint8_t canary) {
  for (auto &p : c.outputs) std::fill(p.second.bytes.begin(), p.second.bytes.end(), canary);
}

void dump(FILE *f, uint64_t id, Case &c) {
  std::fprintf(f, "case %llu %s %zu %zu %zu\n", (unsigned long long)id, c.kernel.c_str(),
               c.attr_lines.size(), c.inputs.size(), c.outputs.size());
  for (const auto &line : c.attr_lines) std::fprintf(f, "attr %s\n", line.c_str());
  for (auto *list : {&c.inputs, &c.outputs})
    for (auto &p : *list) {
      std::string dims;
      for (size_t i = 0; i < p.second.shape.size(); ++i) dims += (i ? "," : "") + std::to_string(p.second.shape[i]);
      const size_t nbytes = p.second.dtype == "none" ? 0 : p.second.bytes.size();
      std::fprintf(f, "tensor %s %s %s %zu\n", p.first.c_str(), p.second.dtype.c_str(),
                   dims.empty() ? "-" : dims.c_str(), nbytes);
      if (nbytes) std::fwrite(p.second.bytes.data(), 1, nbytes, f);
    }
}

struct Stats {
  int64_t cases = 0, accepted = 0, rejected = 0;
};

// Runs case `id`; returns the failed invariants ("" when none).
std::string run_case(harness::Library &lib, uint64_t seed, uint64_t id, SetThreads threads,
                     FILE *dump_file, Stats *stats, bool verbose) {
  Gen g(seed * 0x9e3779b97f4a7c15ull + id);
  const auto &gens = generators();
  const KernelGen &kg = gens[id % gens.size()];
  Case c = kg.make(g);
  if (verbose)
    std::printf("case %llu: %s%s%s\n", (unsigned long long)id, c.kernel.c_str(),
                c.broken ? ", broken: " : ", valid", c.what.c_str());
  std::vector<std::vector<uint8_t>> before;
  for (auto &p : c.inputs) before.push_back(p.second.bytes);
  std::string bad;
  auto inputs_kept = [&]() {
    for (size_t i = 0; i < c.inputs.size(); ++i)
      if (c.inputs[i].second.bytes != before[i]) bad += " input '" + c.inputs[i].first + "' modified;";
  };
  fill(c, 0xA5);
  if (threads) threads(3);
  const Outcome first = call(lib, c);
  inputs_kept();
  ++stats->cases;
  (first.accepted ? stats->accepted : stats->rejected)++;
  if (verbose) std::printf("  %s %s\n", first.accepted ? "accepted" : "rejected:", first.message.c_str());
  if (first.accepted == c.broken)
    bad += first.accepted ? " accepted although broken (" + c.what + ");"
                          : " rejected a valid case: " + first.message + ";";
  if (!first.accepted) {
    if (first.message.rfind("ms_moe_ops", 0) != 0) bad += " rejection without an ms_moe_ops message;";
    for (auto &p : c.outputs)
      for (uint8_t b : p.second.bytes)
        if (b != 0xA5) {
          bad += " rejected call wrote '" + p.first + "';";
          break;
        }
  } else {
    std::vector<std::vector<uint8_t>> result;
    for (auto &p : c.outputs) result.push_back(p.second.bytes);
    fill(c, 0x5A);
    if (threads) threads(1);
    const Outcome second = call(lib, c);
    inputs_kept();
    if (!second.accepted) bad += " second run rejected: " + second.message + ";";
    for (size_t i = 0; i < c.outputs.size(); ++i)
      if (c.outputs[i].second.bytes != result[i])
        bad += " '" + c.outputs[i].first + "' differs between runs (an unwritten byte or nondeterminism);";
    if (dump_file && bad.empty()) dump(dump_file, id, c);
  }
  if (!bad.empty())
    bad = "FAIL case " + std::to_string(id) + " (" + c.kernel + (c.broken ? ", broken: " + c.what : "") +
          "):" + bad;
  return bad;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s LIBRARY [--seconds S | --cases N] [--seed N] [--kernel NAME] "
                         "[--dump FILE] [--replay CASE]\n", argv[0]);
    return 2;
  }
  double seconds = 10;
  int64_t max_cases = -1, replay = -1;
  uint64_t seed = 1;
  std::string only, dump_path;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string opt = argv[i], val = argv[i + 1];
    if (opt == "--seconds") seconds = std::stod(val);
    else if (opt == "--cases") max_cases = std::stoll(val);
    else if (opt == "--seed") seed = std::stoull(val);
    else if (opt == "--kernel") only = val;
    else if (opt == "--dump") dump_path = val;
    else if (opt == "--replay") replay = std::stoll(val);
    else { std::fprintf(stderr, "fuzz_kernels: unknown option %s\n", opt.c_str()); return 2; }
  }
  harness::Library lib(argv[1]);
  auto threads = reinterpret_cast<SetThreads>(lib.symbol("omp_set_num_threads"));
  auto paths = reinterpret_cast<const char *(*)()>(lib.symbol("MsMoeOpsIsaPaths"));
  const char *isa = std::getenv("MS_MOE_OPS_ISA");
  std::printf("paths: %s; running: %s; seed %llu\n", paths ? paths() : "?", isa && *isa ? isa : "best",
              (unsigned long long)seed);
  const auto &gens = generators();
  std::vector<Stats> stats(gens.size());
  if (replay >= 0) {
    const std::string bad = run_case(lib, seed, replay, threads, nullptr, &stats[replay % gens.size()], true);
    std::printf("%s\n", bad.empty() ? "ok" : bad.c_str());
    return bad.empty() ? 0 : 1;
  }
  FILE *dump_file = dump_path.empty() ? nullptr : std::fopen(dump_path.c_str(), "wb");
  if (!dump_path.empty() && !dump_file) { std::perror(dump_path.c_str()); return 2; }
  const auto start = std::chrono::steady_clock::now();
  int failures = 0;
  for (uint64_t id = 0;; ++id) {
    if (max_cases >= 0 ? static_cast<int64_t>(id) >= max_cases
                       : std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= seconds)
      break;
    const size_t kind = id % gens.size();
    if (!only.empty() && only != gens[kind].name) continue;
    const std::string bad = run_case(lib, seed, id, threads, dump_file, &stats[kind], false);
    if (!bad.empty()) {
      ++failures;
      if (failures <= 50) std::printf("%s\n", bad.c_str());
    }
  }
  if (dump_file) std::fclose(dump_file);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%-28s %8s %9s %9s\n", "kernel", "cases", "accepted", "rejected");
  for (size_t i = 0; i < gens.size(); ++i)
    if (stats[i].cases)
      std::printf("%-28s %8lld %9lld %9lld\n", gens[i].name, (long long)stats[i].cases,
                  (long long)stats[i].accepted, (long long)stats[i].rejected);
  std::printf("%d failed case(s) in %.1f s\n", failures, took);
  return failures ? 1 : 0;
}
