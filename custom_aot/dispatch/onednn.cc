// Finds oneDNN at run time (see ../onednn.h). Compiled once, with the baseline flags.
#include "../onednn.h"

#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

#if defined(__linux__) && defined(__x86_64__)
#include <dlfcn.h>
#define MOE_ONEDNN 1
#endif

namespace moe {
namespace onednn {
namespace {

struct Version {
  int major, minor, patch;
  const char *hash;
  unsigned cpu_runtime, gpu_runtime;
};

// dnnl_cpu_isa_t values (dnnl_types.h): each ISA's bits include those of the ones below it.
constexpr unsigned kAvx512Core = 0x27, kAvx512CoreBf16 = 0xe7;

struct Found {
  Sgemm *sgemm = nullptr;
  GemmBf16 *gemm_bf16 = nullptr;
  std::string about;
};

Found look(const char *path) {
  Found f;
#if defined(MOE_ONEDNN)
  // the one MindSpore loaded (RTLD_NOLOAD: never a second copy), or the named file
  void *lib = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL)
                   : dlopen("libdnnl.so.3", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) {
    const char *why = dlerror();
    f.about = path ? std::string("oneDNN: cannot load ") + path + ": " + (why ? why : "?")
                   : "oneDNN: none in the process (MindSpore's libdnnl.so.3 is not loaded)";
    return f;
  }
  auto version = reinterpret_cast<const Version *(*)()>(dlsym(lib, "dnnl_version"));
  auto isa = reinterpret_cast<unsigned (*)()>(dlsym(lib, "dnnl_get_effective_cpu_isa"));
  auto sgemm = reinterpret_cast<Sgemm *>(dlsym(lib, "dnnl_sgemm"));
  auto bf16 = reinterpret_cast<GemmBf16 *>(dlsym(lib, "dnnl_gemm_bf16bf16f32"));
  if (!version || !isa || !sgemm || !bf16) {
    f.about = "oneDNN: the library lacks dnnl_version, dnnl_get_effective_cpu_isa, dnnl_sgemm or "
              "dnnl_gemm_bf16bf16f32";
    return f;
  }
  const Version *v = version();
  const unsigned have = isa();
  const bool f32 = (have & kAvx512Core) == kAvx512Core, b16 = (have & kAvx512CoreBf16) == kAvx512CoreBf16;
  if (f32) f.sgemm = sgemm;
  if (b16) f.gemm_bf16 = bf16;
  char line[256];
  std::snprintf(line, sizeof(line), "oneDNN %d.%d.%d (%s), CPU ISA 0x%x: %s", v->major, v->minor,
                v->patch, path ? path : "libdnnl.so.3 in the process", have,
                b16 ? "AVX-512 float32 and bfloat16 dot-product kernels"
                    : f32 ? "AVX-512 float32 kernels, no bfloat16 dot product"
                          : "no AVX-512 kernels (not used)");
  f.about = line;
#else
  (void)path;
  f.about = "oneDNN: not looked for on this target (x86-64 Linux only)";
#endif
  return f;
}

// The library MS_MOE_OPS_ONEDNN asks for, looked up once per value (lookups are kept: a caller
// may still hold one). Called for every product, so the common case takes no lock.
const Found &current() {
  static const Found off{nullptr, nullptr, "oneDNN: not used (MS_MOE_OPS_ONEDNN=0)"};
  const char *want = std::getenv("MS_MOE_OPS_ONEDNN");
  if (want && std::strcmp(want, "0") == 0) return off;
  if (want == nullptr || *want == '\0') {
    static const Found in_process = look(nullptr);  // MindSpore loads it when imported
    return in_process;
  }
  static std::mutex mu;
  static std::map<std::string, Found> named;
  std::lock_guard<std::mutex> hold(mu);
  auto it = named.find(want);
  if (it == named.end()) it = named.emplace(want, look(want)).first;
  return it->second;
}

}  // namespace

Sgemm *sgemm() { return current().sgemm; }
GemmBf16 *gemm_bf16() { return current().gemm_bf16; }
const char *about() {
  thread_local std::string line;
  line = current().about;
  return line.c_str();
}

}  // namespace onednn
}  // namespace moe
