// Calls every kernel of the library through MindSpore's AOT ABI on fixed, seeded inputs and
// writes every output to one file, so that two builds (two architectures or systems, two
// instruction-set paths) can be compared output by output (tools/check_hosts.py does).
//
//   kernel_cases LIBRARY OUTPUT      (MS_MOE_OPS_ISA picks the path, as in any process)
//
// Prints "paths: <the instruction-set paths the library offers on this CPU>" first.
// OUTPUT holds one record per output tensor: a line "<case>/<output> <dtype> <d0,d1,...>
// <nbytes>" followed by the raw bytes. Exit status 0, or 1 when a kernel reports an error.
#include <cmath>
#include <functional>
#include <numeric>

#include "aot_call.h"

namespace {

using harness::Attrs;
using harness::Tensor;
using harness::from_values;
using harness::zeros;

const char *const kFloatTypes[] = {"float32", "float16", "bfloat16"};
const char *const kActivations[] = {"fastgelu", "gelu", "relu", "silu"};
Tensor none;

class Runner {
 public:
  Runner(harness::Library &lib, FILE *out) : lib_(lib), out_(out) {}

  // Calls kernel(inputs..., outputs...) and records the outputs as "<name>/<output name>".
  void run(const std::string &name, const std::string &kernel, std::vector<Tensor *> inputs,
           std::vector<std::pair<std::string, Tensor *>> outputs, Attrs &attrs) {
    std::vector<Tensor *> args = inputs;
    for (auto &o : outputs) args.push_back(o.second);
    if (int rc = lib_.call(kernel, args, attrs)) {
      std::fprintf(stderr, "kernel_cases: %s (%s) returned %d\n", name.c_str(), kernel.c_str(), rc);
      failed_ = true;
      return;
    }
    for (auto &o : outputs) {
      Tensor &t = *o.second;
      std::string dims;
      for (size_t i = 0; i < t.shape.size(); ++i) dims += (i ? "," : "") + std::to_string(t.shape[i]);
      std::fprintf(out_, "%s/%s %s %s %zu\n", name.c_str(), o.first.c_str(), t.dtype.c_str(),
                   dims.empty() ? "-" : dims.c_str(), t.bytes.size());
      std::fwrite(t.bytes.data(), 1, t.bytes.size(), out_);
    }
  }
  // Calls kernel with arguments it must refuse and records its message (uint8 bytes): the
  // exception thrown inside the library reaches the caller with its text, on every host.
  void refuse(const std::string &name, const std::string &kernel, std::vector<Tensor *> args,
              Attrs &attrs) {
    if (lib_.call(kernel, args, attrs) == 0) {
      std::fprintf(stderr, "kernel_cases: %s (%s) accepted a call it must refuse\n", name.c_str(),
                   kernel.c_str());
      failed_ = true;
      return;
    }
    const std::string &message = lib_.last_error();
    std::fprintf(out_, "%s/message uint8 %zu %zu\n", name.c_str(), message.size(), message.size());
    std::fwrite(message.data(), 1, message.size(), out_);
  }
  bool failed() const { return failed_; }

 private:
  harness::Library &lib_;
  FILE *out_;
  bool failed_ = false;
};

std::vector<double> counts_for(harness::Rng &rng, int64_t groups, int64_t rows) {
  // random split of rows into groups (some empty)
  std::vector<double> c(groups, 0.0);
  for (int64_t r = 0; r < rows; ++r) c[rng.integer(0, groups - 1)] += 1;
  if (groups > 1) {  // one empty group, its rows given to the next
    c[1] += c[0];
    c[0] = 0;
  }
  return c;
}

void swiglu(Runner &r) {
  for (const char *dt : kFloatTypes)
    for (int variant = 0; variant < 2; ++variant) {
      harness::Rng rng(11 + variant);
      const int64_t rows = 5, h = 1040;  // 1040 > one 512-element block
      const bool opts = variant == 1;  // clamp, weight and group truncation
      Tensor x = from_values(dt, {rows, 2 * h}, rng.values(rows * 2 * h, 4.0));
      Tensor w = opts ? from_values("float32", {rows, 1}, rng.values(rows)) : none;
      Tensor gi = opts ? from_values("int64", {2}, {3, 1}) : none;
      Tensor y = zeros(dt, {rows, h}), yo = zeros(dt, {rows, h});
      Attrs attrs;
      attrs.set_float("clamp_limit", opts ? 0.7f : 0.f);
      const std::string name = std::string("swiglu_") + dt + (opts ? "_opts" : "");
      r.run(name, "SwigluGroup", {&x, &w, &gi}, {{"y", &y}, {"y_origin", &yo}}, attrs);
      Tensor gy = from_values(dt, {rows, h}, rng.values(rows * h));
      Tensor gx = zeros(dt, {rows, 2 * h}), gw = zeros("float32", {rows, 1});
      Tensor yo_in = opts ? yo : none;
      r.run(name + "_grad", "SwigluGroupQuantGrad", {&gy, &x, &w, &yo_in, &gi},
            {{"grad_x", &gx}, {"grad_weight", &gw}}, attrs);
    }
}

void gating(Runner &r) {
  struct Config {
    const char *name;
    int64_t n, k, k_group, groups, mode, renorm, norm_type;
    bool bias, ties;
  };
  const Config configs[] = {
      {"sigmoid_groups", 64, 8, 4, 8, 1, 0, 1, true, false},
      {"sigmoid_max_groups", 64, 6, 2, 4, 0, 0, 1, false, false},
      {"softmax", 64, 8, 1, 1, 0, 1, 0, false, false},
      {"softmax_plain", 32, 4, 1, 1, 0, 0, 0, true, false},
      {"large_k", 64, 40, 1, 1, 0, 0, 1, false, false},
      {"ties", 64, 40, 3, 4, 0, 0, 1, false, true},
  };
  for (const char *dt : kFloatTypes)
    for (const Config &c : configs) {
      harness::Rng rng(21);
      const int64_t m = 33;
      Tensor x = from_values(dt, {m, c.n}, c.ties ? std::vector<double>(m * c.n, 0.0) : rng.values(m * c.n, 3.0));
      Tensor bias = c.bias ? from_values(dt, {c.n}, rng.values(c.n, 0.1)) : none;
      Tensor y = zeros(dt, {m, c.k}), idx = zeros("int32", {m, c.k}), xn = zeros("float32", {m, c.n});
      Attrs attrs;
      attrs.set_int("k", c.k).set_int("k_group", c.k_group).set_int("group_count", c.groups);
      attrs.set_int("group_select_mode", c.mode).set_int("renorm", c.renorm).set_int("norm_type", c.norm_type);
      attrs.set_float("routed_scaling_factor", 2.5f).set_float("eps", 1e-20f);
      const std::string name = std::string("gating_") + c.name + "_" + dt;
      r.run(name, "MoeGatingTopK", {&x, &bias}, {{"y", &y}, {"expert_idx", &idx}, {"x_norm", &xn}}, attrs);
      Tensor gy = from_values(dt, {m, c.k}, rng.values(m * c.k));
      Tensor gx = zeros(dt, {m, c.n});
      const char *backward = c.norm_type == 1 ? "MoeGatingTopKBackward" : "MoeGatingTopKSoftmaxBackward";
      r.run(name + "_grad", backward, {&xn, &gy, &idx}, {{"grad_x", &gx}}, attrs);
    }
}

void grouped_matmul(Runner &r) {
  for (const char *dt : kFloatTypes)
    for (const char *form : {"plain", "transpose_weight", "transpose_x"}) {
      harness::Rng rng(31);
      const int64_t m = 45, k = 24, n = 40, g = 4;
      const bool tw = std::string(form) == "transpose_weight", tx = std::string(form) == "transpose_x";
      Tensor x = from_values(dt, {m, k}, rng.values(m * k));
      Tensor w = tx ? from_values(dt, {m, n}, rng.values(m * n))
                    : from_values(dt, tw ? std::vector<int64_t>{g, n, k} : std::vector<int64_t>{g, k, n},
                                  rng.values(g * k * n));
      Tensor groups = from_values("int64", {g}, counts_for(rng, g, m));
      Tensor bias = tx ? none : from_values(dt, {g, n}, rng.values(g * n));
      Tensor out = tx ? zeros(dt, {g, k, n}) : zeros(dt, {m, n});
      Attrs attrs;
      attrs.set_bool("transpose_x", tx).set_bool("transpose_weight", tw).set_bool("cumulative", false);
      r.run(std::string("grouped_matmul_") + form + "_" + dt, "GroupedMatmul", {&x, &w, &groups, &bias},
            {{"out", &out}}, attrs);
    }
}

void moe_ffn(Runner &r) {
  for (const char *dt : kFloatTypes)
    for (const char *act : kActivations) {
      harness::Rng rng(41);
      const int64_t m = 20, h = 24, f = 40, e = 3;
      Tensor x = from_values(dt, {m, h}, rng.values(m * h));
      Tensor tokens = from_values("int64", {e}, counts_for(rng, e, m));
      Tensor w1 = from_values(dt, {e, h, f}, rng.values(e * h * f, 0.25));
      Tensor b1 = from_values(dt, {e, f}, rng.values(e * f, 0.5));
      Tensor w2 = from_values(dt, {e, f, h}, rng.values(e * f * h, 0.25));
      Tensor b2 = from_values(dt, {e, h}, rng.values(e * h, 0.5));
      Tensor y = zeros(dt, {m, h});
      Attrs attrs;
      attrs.set_str("activation", act).set_bool("tokens_index_flag", false);
      const std::string name = std::string("moe_ffn_") + act + "_" + dt;
      r.run(name, "MoeFFN", {&x, &tokens, &w1, &b1, &w2, &b2, &none, &none, &none, &none},
            {{"y", &y}}, attrs);
      Tensor hv = from_values(dt, {m, f}, rng.values(m * f, 4.0));
      Tensor ga = from_values(dt, {m, f}, rng.values(m * f));
      Tensor gh = zeros(dt, {m, f}), a = zeros(dt, {m, f});
      r.run(name + "_activation_grad", "MoeFFNActivationGrad", {&hv, &ga}, {{"grad_h", &gh}, {"a", &a}}, attrs);
    }
}

void moe_ffn_int8(Runner &r) {
  for (const char *out : {"float32", "float16", "bfloat16"})
    for (const char *act : kActivations) {
      harness::Rng rng(51);
      const int64_t m = 37, h = 70, f = 130, e = 3;  // tile tails in every dimension
      auto ints = [&](int64_t n, int64_t lo, int64_t hi) {
        std::vector<double> v(n);
        for (double &x : v) x = static_cast<double>(rng.integer(lo, hi));
        return v;
      };
      auto scales = [&](int64_t n, double base) {  // positive, on a dyadic grid
        std::vector<double> v(n);
        for (double &x : v) x = base * static_cast<double>(rng.integer(512, 1536)) / 1024.0;
        return v;
      };
      Tensor x = from_values("int8", {m, h}, ints(m * h, -128, 127));
      Tensor tokens = from_values("int64", {e}, counts_for(rng, e, m));
      Tensor w1 = from_values("int8", {e, h, f}, ints(e * h * f, -128, 127));
      Tensor b1 = from_values("int32", {e, f}, ints(e * f, -2000, 2000));
      Tensor w2 = from_values("int8", {e, f, h}, ints(e * f * h, -128, 127));
      Tensor b2 = from_values("int32", {e, h}, ints(e * h, -2000, 2000));
      Tensor scale = from_values("float32", {e}, scales(e, 0.5));
      Tensor offset = from_values("float32", {e}, rng.values(e, 4.0));
      Tensor dq1 = from_values("float32", {e, f}, scales(e * f, 1.0 / 4096));
      Tensor dq2 = from_values("float32", {e, h}, scales(e * h, 1.0 / 2048));
      Tensor y = zeros(out, {m, h});
      Attrs attrs;
      attrs.set_str("activation", act).set_bool("tokens_index_flag", false);
      r.run(std::string("moe_ffn_int8_") + act + "_" + out, "MoeFFN",
            {&x, &tokens, &w1, &b1, &w2, &b2, &scale, &offset, &dq1, &dq2}, {{"y", &y}}, attrs);
    }
}

void permute(Runner &r) {
  for (const char *dt : kFloatTypes) {
    harness::Rng rng(61);
    const int64_t t = 19, k = 3, h = 20, e = 8;
    Tensor x = from_values(dt, {t, h}, rng.values(t * h));
    std::vector<double> idx(t * k);
    for (double &v : idx) v = static_cast<double>(rng.integer(0, e - 1));
    Tensor ei = from_values("int32", {t, k}, idx);
    Tensor permuted = zeros(dt, {t * k, h}), sorted = zeros("int32", {t * k}), counts = zeros("int64", {e});
    Attrs attrs;
    attrs.set_int("num_experts", e).set_int("top_k", k);
    const std::string name = std::string("permute_") + dt;
    r.run(name, "MoeTokenPermute", {&x, &ei},
          {{"permuted", &permuted}, {"sorted_index", &sorted}, {"counts", &counts}}, attrs);
    for (const char *probs_dtype : {"float32", "same", "none"}) {
      const std::string pd = std::string(probs_dtype) == "same" ? dt : probs_dtype;
      Tensor probs = pd == "none" ? none : from_values(pd, {t, k}, rng.values(t * k));
      Tensor out = zeros(dt, {t, h});
      const std::string pname = name + "_probs_" + probs_dtype;
      r.run(pname + "_unpermute", "MoeTokenUnpermute", {&permuted, &sorted, &probs}, {{"out", &out}}, attrs);
      Tensor dout = from_values(dt, {t, h}, rng.values(t * h));
      Tensor dperm = zeros(dt, {t * k, h}), dprobs = zeros(pd == "none" ? "float32" : pd, {t, k});
      r.run(pname + "_unpermute_grad", "MoeTokenUnpermuteBackward", {&permuted, &sorted, &probs, &dout},
            {{"grad_permuted", &dperm}, {"grad_probs", &dprobs}}, attrs);
    }
  }
}

// A data fault: an expert index out of range, found before anything is written.
void refusals(Runner &r) {
  Tensor x = from_values("float32", {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor ei = from_values("int32", {2, 1}, {0, 7});
  Tensor permuted = zeros("float32", {2, 3}), sorted = zeros("int32", {2}), counts = zeros("int64", {4});
  Attrs attrs;
  attrs.set_int("num_experts", 4);
  r.refuse("refusal_permute", "MoeTokenPermute", {&x, &ei, &permuted, &sorted, &counts}, attrs);
}

// float32 -> float16/bfloat16 rounding alone: an unpermute with one slot per token multiplies
// rows of powers of two by float32 weights (exact), then rounds each product to the dtype. The
// weights' bit patterns cover normal, subnormal, overflowing and half-way cases.
void conversions(Runner &r) {
  const int64_t t = 4096;
  const std::vector<double> row = {1.0, 0x1p-8, 0x1p-14, 0x1p-20, 0x1p-24, 0x1p8, 0x1p15, 0x1p-3};
  const int64_t h = static_cast<int64_t>(row.size());
  harness::Rng rng(71);
  std::vector<double> probs(t);
  for (int64_t i = 0; i < t; ++i) {
    // exponent in [-22, 2], random 23-bit mantissa whose low 12 bits are often a half-way point
    uint32_t bits = static_cast<uint32_t>(rng.integer(105, 129)) << 23 |
                    static_cast<uint32_t>(rng.next() & 0x7fffff);
    if (i % 3 == 0) bits = (bits & ~0x1fffu) | 0x1000u;  // a float16 tie (13 dropped bits)
    if (i % 3 == 1) bits = (bits & ~0xffffu) | 0x8000u;  // a bfloat16 tie
    if (i % 2) bits |= 0x80000000u;
    float f;
    std::memcpy(&f, &bits, 4);
    probs[i] = f;
  }
  Tensor p = from_values("float32", {t, 1}, probs);
  Tensor sorted = zeros("int32", {t});
  std::iota(sorted.as<int32_t>(), sorted.as<int32_t>() + t, 0);
  for (const char *dt : {"float16", "bfloat16"}) {
    std::vector<double> rows;
    for (int64_t i = 0; i < t; ++i) rows.insert(rows.end(), row.begin(), row.end());
    Tensor permuted = from_values(dt, {t, h}, rows), out = zeros(dt, {t, h});
    Attrs attrs;
    attrs.set_int("top_k", 1);
    r.run(std::string("rounding_") + dt, "MoeTokenUnpermute", {&permuted, &sorted, &p}, {{"out", &out}}, attrs);
  }
  // the cast kernel between every pair of float dtypes, on the same values (ties of both 16-bit
  // formats; past the threads' blocks of 4096): bitwise equal everywhere
  std::vector<double> many;
  for (int r2 = 0; r2 < 17; ++r2) many.insert(many.end(), probs.begin(), probs.end());
  const int64_t n = static_cast<int64_t>(many.size());
  for (const char *from : kFloatTypes)
    for (const char *to : kFloatTypes) {
      Tensor x = from_values(from, {n}, many), y = zeros(to, {n});
      Attrs attrs;
      attrs.set_str("dtype", to);
      r.run(std::string("rounding_cast_") + from + "_" + to, "Cast", {&x}, {{"y", &y}}, attrs);
    }
  {  // dequantize: 3 of 4 experts (one twice), past the 256 KB kept on the calling thread; bitwise equal
    const int64_t e = 4, k = 200, n = 131;  // 3 x 200 x 131 floats: 314 KB
    std::vector<double> q(e * k * n), s(e * n);
    for (int64_t i = 0; i < e * k * n; ++i) q[i] = static_cast<double>(i * 37 % 255) - 127;
    for (int64_t i = 0; i < e * n; ++i) s[i] = probs[i % probs.size()] / 64.0;
    Tensor w = from_values("int8", {e, k, n}, q), scale = from_values("float32", {e, n}, s);
    Tensor index = from_values("int32", {3}, {2, 0, 2}), y = zeros("float32", {3, k, n});
    Attrs none;
    r.run("dequantize", "Dequantize", {&w, &scale, &index}, {{"y", &y}}, none);
  }
  {  // weight_quant_grouped_matmul: groups cut along K (3 rows, 1 row), one of 20 rows (uncut), an
     // empty one and 2 padded rows; K = 300 past two chunks and off the unrolled 8 rows
    const int64_t e = 4, k = 300, n = 37, m = 26;
    std::vector<double> xs(m * k), q(e * k * n), s(e * n);
    for (int64_t i = 0; i < m * k; ++i) xs[i] = probs[i % probs.size()] * (i % 5 - 2);
    for (int64_t i = 0; i < e * k * n; ++i) q[i] = static_cast<double>(i * 37 % 255) - 127;
    for (int64_t i = 0; i < e * n; ++i) s[i] = probs[i % probs.size()] / 64.0;
    Tensor x = from_values("float32", {m, k}, xs), w = from_values("int8", {e, k, n}, q);
    Tensor scale = from_values("float32", {e, n}, s), y = zeros("float32", {m, n});
    Tensor counts = from_values("int64", {e}, {3, 0, 20, 1});
    Attrs none;
    r.run("weight_quant_grouped_matmul", "WeightQuantGroupedMatmul", {&x, &w, &scale, &counts},
          {{"y", &y}}, none);
  }
  {  // rms_norm: 300 rows of 1031 (past the threads' share, off the vector widths)
    const int64_t rows = 300, h = 1031;
    std::vector<double> xs(rows * h), ws(h);
    for (int64_t i = 0; i < rows * h; ++i) xs[i] = probs[i % probs.size()] * (i % 7 - 3);
    for (int64_t j = 0; j < h; ++j) ws[j] = 0.5 + probs[j % probs.size()];
    Tensor x = from_values("float32", {rows, h}, xs), w = from_values("float32", {h}, ws);
    Tensor y = zeros("float32", {rows, h});
    Attrs attrs;
    attrs.set_float("eps", 1e-6f);
    r.run("rms_norm", "RmsNorm", {&x, &w}, {{"y", &y}}, attrs);
  }
  {  // add_rms_norm: 300 rows of 1031, the residual of other values
    const int64_t rows = 300, h = 1031;
    std::vector<double> xs(rows * h), rs(rows * h), ws(h);
    for (int64_t i = 0; i < rows * h; ++i) {
      xs[i] = probs[i % probs.size()] * (i % 7 - 3);
      rs[i] = probs[(i * 3) % probs.size()] * (i % 5 - 2);
    }
    for (int64_t j = 0; j < h; ++j) ws[j] = 0.5 + probs[j % probs.size()];
    Tensor x = from_values("float32", {rows, h}, xs), res = from_values("float32", {rows, h}, rs);
    Tensor w = from_values("float32", {h}, ws);
    Tensor y = zeros("float32", {rows, h}), sum = zeros("float32", {rows, h});
    Attrs attrs;
    attrs.set_float("eps", 1e-6f);
    r.run("add_rms_norm", "AddRmsNorm", {&x, &res, &w}, {{"y", &y}, {"sum", &sum}}, attrs);
  }
  {  // decode_attention: 2 sequences, 16 query heads on 4 key heads of 64, 300 cached positions
    const int64_t b = 2, heads = 16, kv = 4, length = 300, d = 64;
    auto values = [&](int64_t n, int salt) {
      std::vector<double> v(n);
      for (int64_t i = 0; i < n; ++i) v[i] = probs[(i * 7 + salt) % probs.size()] * ((i + salt) % 5 - 2);
      return v;
    };
    std::vector<double> cos(b * d), sin(b * d), mask(b * length);
    for (int64_t i = 0; i < b * d; ++i) {
      const double angle = 0.37 * static_cast<double>(i % (d / 2) + 1) * (1 + i / d);
      cos[i] = std::cos(angle);
      sin[i] = std::sin(angle);
    }
    for (int64_t i = 0; i < b * length; ++i) mask[i] = i % 11 == 3 ? -3.0e38 : 0.0;
    Tensor q = from_values("float32", {b, heads, 1, d}, values(b * heads * d, 1));
    Tensor k = from_values("float32", {b, kv, 1, d}, values(b * kv * d, 2));
    Tensor v = from_values("float32", {b, kv, 1, d}, values(b * kv * d, 3));
    Tensor c = from_values("float32", {b, 1, 1, d}, cos), s = from_values("float32", {b, 1, 1, d}, sin);
    Tensor kc = from_values("float32", {b, kv, length, d}, values(b * kv * length * d, 4));
    Tensor vc = from_values("float32", {b, kv, length, d}, values(b * kv * length * d, 5));
    Tensor m = from_values("float32", {b, 1, 1, length}, mask);
    Tensor slot = from_values("int32", {}, {123});
    Tensor out = zeros("float32", {b, heads, 1, d}), kco = zeros("float32", {b, kv, length, d}),
           vco = zeros("float32", {b, kv, length, d});
    Attrs attrs;
    attrs.set_float("scaling", 0.125f);
    r.run("decode_attention", "DecodeAttention", {&q, &k, &v, &c, &s, &kc, &vc, &m, &slot},
          {{"out", &out}, {"key_cache_out", &kco}, {"value_cache_out", &vco}}, attrs);
  }
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s LIBRARY OUTPUT\n", argv[0]);
    return 2;
  }
  harness::Library lib(argv[1]);
  auto paths = reinterpret_cast<const char *(*)()>(lib.symbol("MsMoeOpsIsaPaths"));
  std::printf("paths: %s\n", paths ? paths() : "?");
  std::fflush(stdout);
  FILE *out = std::fopen(argv[2], "wb");
  if (!out) {
    std::perror(argv[2]);
    return 2;
  }
  Runner r(lib, out);
  for (auto group : {swiglu, gating, grouped_matmul, moe_ffn, moe_ffn_int8, permute, refusals, conversions}) group(r);
  std::fclose(out);
  return r.failed() ? 1 : 0;
}
