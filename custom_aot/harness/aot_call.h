// Calls the kernel library the way MindSpore does, from plain C++: load the library, look a
// kernel up by its exported name, call it through the CPU AOT ABI with tensors and attributes
// built here. Used by kernel_cases.cc (the cross-architecture check) and meant for any other
// driver of the kernels (a sanitizer or fuzz run, a debugger session).
//
//   harness::Library lib("ms_moe_ops/_kernels....so");
//   harness::Tensor x = harness::from_values("float32", {4, 8}, values), y = ...;
//   harness::Attrs attrs;
//   attrs.set_float("clamp_limit", 0.f);
//   int rc = lib.call("SwigluGroup", {&x, &none, &none, &y, &y_origin}, attrs);
//
// Build with the kernels' ABI flag (-D_GLIBCXX_USE_CXX11_ABI=0) and -ldl (Windows: nothing).
#pragma once

#if defined(_WIN32)
#include <windows.h>
#else
#include <dlfcn.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common.h"

namespace harness {

// One kernel argument: MindSpore's dtype string, shape and bytes. dtype "none" (no bytes) is an
// absent optional input, passed as a null pointer.
struct Tensor {
  std::string dtype = "none";
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  void *data() { return dtype == "none" ? nullptr : bytes.data(); }
  template <typename T>
  T *as() { return reinterpret_cast<T *>(bytes.data()); }
};

inline size_t dtype_size(const std::string &dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"float32", 4}, {"float16", 2}, {"bfloat16", 2}, {"float64", 8}, {"int8", 1},
      {"uint8", 1},   {"int32", 4},   {"int64", 8},    {"uint64", 8},  {"bool", 1}};
  const auto it = sizes.find(dtype);
  if (it == sizes.end()) {
    std::fprintf(stderr, "harness: unknown dtype '%s'\n", dtype.c_str());
    std::abort();
  }
  return it->second;
}

inline Tensor zeros(const std::string &dtype, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.assign(static_cast<size_t>(t.numel()) * dtype_size(dtype), 0);
  return t;
}

// A tensor holding `values` (row-major): floating dtypes rounded to nearest even by the kernels'
// own conversion, integer dtypes cast.
inline Tensor from_values(const std::string &dtype, std::vector<int64_t> shape,
                          const std::vector<double> &values) {
  Tensor t = zeros(dtype, std::move(shape));
  if (static_cast<int64_t>(values.size()) != t.numel()) {
    std::fprintf(stderr, "harness: %zu values for %lld elements\n", values.size(),
                 (long long)t.numel());
    std::abort();
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    if (dtype == "float32") t.as<float>()[i] = static_cast<float>(v);
    else if (dtype == "float16") t.as<moe::f16>()[i] = moe::from_f32<moe::f16>(static_cast<float>(v));
    else if (dtype == "bfloat16") t.as<moe::bf16>()[i] = moe::from_f32<moe::bf16>(static_cast<float>(v));
    else if (dtype == "float64") t.as<double>()[i] = v;
    else if (dtype == "int8") t.as<int8_t>()[i] = static_cast<int8_t>(v);
    else if (dtype == "uint8" || dtype == "bool") t.as<uint8_t>()[i] = static_cast<uint8_t>(v);
    else if (dtype == "int32") t.as<int32_t>()[i] = static_cast<int32_t>(v);
    else if (dtype == "int64") t.as<int64_t>()[i] = static_cast<int64_t>(v);
    else if (dtype == "uint64") t.as<uint64_t>()[i] = static_cast<uint64_t>(v);
  }
  return t;
}

// Attributes, as MindSpore hands them to a kernel. Asking for an attribute that was not set is a
// driver bug: it aborts with the name.
class Attrs : public mindspore::AotExtra {
 public:
  Attrs &set_int(const std::string &name, int64_t v) { ints_[name] = v; return *this; }
  Attrs &set_float(const std::string &name, float v) { floats_[name] = v; return *this; }
  Attrs &set_bool(const std::string &name, bool v) { bools_[name] = v; return *this; }
  Attrs &set_str(const std::string &name, const std::string &v) { strs_[name] = v; return *this; }

  bool HasAttr(std::string name) override {
    return ints_.count(name) || floats_.count(name) || bools_.count(name) || strs_.count(name);
  }
  bool GetAttrBool(std::string name) override { return get(bools_, name); }
  int64_t GetAttrInt(std::string name) override { return get(ints_, name); }
  float GetAttrFloat(std::string name) override { return get(floats_, name); }
  std::string GetAttrStr(std::string name) override { return get(strs_, name); }
  std::vector<int64_t> GetAttrIntVec(std::string name) override { return missing<std::vector<int64_t>>(name); }
  std::vector<float> GetAttrFloatVec(std::string name) override { return missing<std::vector<float>>(name); }
  std::vector<std::vector<int64_t>> GetAttrInt2DVec(std::string name) override {
    return missing<std::vector<std::vector<int64_t>>>(name);
  }
  std::vector<std::vector<float>> GetAttrFloat2DVec(std::string name) override {
    return missing<std::vector<std::vector<float>>>(name);
  }

 private:
  template <typename V>
  static V get(const std::map<std::string, V> &m, const std::string &name) {
    const auto it = m.find(name);
    return it != m.end() ? it->second : missing<V>(name);
  }
  template <typename V>
  static V missing(const std::string &name) {
    std::fprintf(stderr, "harness: the kernel asked for attribute '%s', which was not set\n",
                 name.c_str());
    std::abort();
  }
  std::map<std::string, int64_t> ints_;
  std::map<std::string, float> floats_;
  std::map<std::string, bool> bools_;
  std::map<std::string, std::string> strs_;
};

// The kernel library, loaded like MindSpore loads it (dlopen, then dlsym per kernel; Windows:
// LoadLibrary and GetProcAddress, as a loader there would).
class Library {
 public:
  explicit Library(const std::string &path) : handle_(open(path)) {
    if (!handle_) {
      std::fprintf(stderr, "harness: cannot load %s: %s\n", path.c_str(), error().c_str());
      std::exit(2);
    }
  }
  Library(const Library &) = delete;
  Library &operator=(const Library &) = delete;
#if defined(_WIN32)
  ~Library() { FreeLibrary(static_cast<HMODULE>(handle_)); }
  void *symbol(const std::string &name) {
    return reinterpret_cast<void *>(GetProcAddress(static_cast<HMODULE>(handle_), name.c_str()));
  }
#else
  ~Library() { dlclose(handle_); }
  // Any exported symbol (nullptr when absent), e.g. MsMoeOpsIsaPaths.
  void *symbol(const std::string &name) { return dlsym(handle_, name.c_str()); }
#endif

  // Calls `kernel` with args = inputs, then outputs (MindSpore's order); returns its status: 0,
  // or 1 when the kernel refused the call (the exported kernels throw std::runtime_error, which
  // MindSpore catches; here its message is kept for last_error()).
  int call(const std::string &kernel, const std::vector<Tensor *> &args, Attrs &attrs) {
    auto fn = reinterpret_cast<moe::KernelFn *>(symbol(kernel));
    if (!fn) {
      std::fprintf(stderr, "harness: the library exports no kernel '%s'\n", kernel.c_str());
      std::exit(2);
    }
    std::vector<void *> params;
    std::vector<int> ndims;
    std::vector<int64_t *> shapes;
    std::vector<const char *> dtypes;
    for (Tensor *t : args) {
      params.push_back(t->data());
      ndims.push_back(static_cast<int>(t->shape.size()));
      shapes.push_back(t->shape.data());
      dtypes.push_back(t->dtype.c_str());
    }
    last_error_.clear();
    try {
      return fn(static_cast<int>(args.size()), params.data(), ndims.data(), shapes.data(),
                dtypes.data(), nullptr, &attrs);
    } catch (const std::exception &e) {
      last_error_ = e.what();
      return 1;
    }
  }

  // The message of the last refused call ("" after a successful one).
  const std::string &last_error() const { return last_error_; }

 private:
#if defined(_WIN32)
  static void *open(const std::string &path) { return LoadLibraryA(path.c_str()); }
  static std::string error() { return "LoadLibrary error " + std::to_string(GetLastError()); }
#else
  static void *open(const std::string &path) { return dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL); }
  static std::string error() { return dlerror(); }
#endif
  void *handle_;
  std::string last_error_;
};

// Deterministic random numbers, the same on every platform (splitmix64). Values are dyadic
// rationals, exact in float32 and double, so no platform rounds them differently.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // An integer in [lo, hi].
  int64_t integer(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
  // n values in [-scale, scale] on a grid of scale / 1024.
  std::vector<double> values(int64_t n, double scale = 1.0) {
    std::vector<double> v(n);
    for (double &x : v) x = static_cast<double>(integer(-1024, 1024)) * (scale / 1024.0);
    return v;
  }

 private:
  uint64_t state_;
};

}  // namespace harness
