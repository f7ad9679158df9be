// Which instruction-set path the exported kernels call (see isa.h). Compiled once, with the
// baseline flags: it must run on any CPU of the target architecture. The CPU is asked directly
// (cpuid and the OS's register state on x86-64, the kernel's hardware capabilities on aarch64),
// so the same code serves GCC, Clang and Apple Clang on Linux, macOS and Windows.
#include "../isa.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(MOE_X86_PATHS)
#include <cpuid.h>
#elif defined(MOE_ARM_PATHS) && defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace moe {
namespace dispatch {
namespace {

const char *const kPaths[] = {MOE_PATH_LIST(MOE_PATH_NAME, _)};
constexpr int kCount = sizeof(kPaths) / sizeof(kPaths[0]);

#if defined(__APPLE__)
bool sysctl_flag(const char *name) {
  int value = 0;
  size_t size = sizeof(value);
  return sysctlbyname(name, &value, &size, nullptr, 0) == 0 && value != 0;
}
#endif

#if defined(MOE_X86_PATHS)
struct Cpuid {
  unsigned a = 0, b = 0, c = 0, d = 0;
};
Cpuid cpuid(unsigned leaf, unsigned sub) {
  Cpuid r;
  if (leaf > __get_cpuid_max(leaf & 0x80000000u, nullptr)) return r;  // (zeros: no feature)
  __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
  return r;
}
bool bit(unsigned word, int i) { return (word >> i) & 1u; }

// Which paths this CPU runs: the instructions (cpuid) and the OS saving their registers (XCR0).
void supported(bool *ok) {
  const Cpuid l1 = cpuid(1, 0), l7 = cpuid(7, 0), l71 = cpuid(7, 1), e1 = cpuid(0x80000001u, 0);
  unsigned long long xcr0 = 0;
  if (bit(l1.c, 27)) {  // OSXSAVE: xgetbv may be executed
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<unsigned long long>(hi) << 32) | lo;
  }
  const bool ymm_state = (xcr0 & 0x6) == 0x6;
#if defined(__APPLE__)
  // macOS turns the AVX-512 state on at a thread's first AVX-512 instruction: XCR0 does not show
  // it before; the kernel's own flag says whether it will.
  const bool zmm_state = ymm_state && sysctl_flag("hw.optional.avx512f");
#else
  const bool zmm_state = ymm_state && (xcr0 & 0xe0) == 0xe0;
#endif
  // x86-64-v3: AVX, AVX2, BMI1, BMI2, F16C, FMA, LZCNT, MOVBE
  const bool v3 = ymm_state && bit(l1.c, 28) && bit(l7.b, 5) && bit(l7.b, 3) && bit(l7.b, 8) &&
                  bit(l1.c, 29) && bit(l1.c, 12) && bit(e1.c, 5) && bit(l1.c, 22);
  // x86-64-v4: AVX-512 F, BW, CD, DQ, VL
  const bool v4 = v3 && zmm_state && bit(l7.b, 16) && bit(l7.b, 30) && bit(l7.b, 28) &&
                  bit(l7.b, 17) && bit(l7.b, 31);
  ok[0] = true;
  ok[1] = v3;
  ok[2] = v3 && bit(l71.a, 4);   // AVX-VNNI (VEX-encoded vpdpbusd)
  ok[3] = v4 && bit(l7.c, 11);   // AVX-512 VNNI
}
#elif defined(MOE_ARM_PATHS)
void supported(bool *ok) {
  ok[0] = true;  // ARMv8-A: NEON and FP are part of the base architecture
#if defined(__linux__)
  ok[1] = (getauxval(AT_HWCAP) & (1ul << 20)) != 0;  // HWCAP_ASIMDDP
#elif defined(__APPLE__)
  ok[1] = sysctl_flag("hw.optional.arm.FEAT_DotProd");
#else
  ok[1] = false;
#endif
}
#else
void supported(bool *ok) { ok[0] = true; }
#endif

struct Paths {
  bool ok[kCount] = {};
  int best = 0;
  Paths() {
    supported(ok);
    for (int p = 0; p < kCount; ++p)
      if (ok[p]) best = p;
  }
};

const Paths kHere;

thread_local std::string last_error;

// One line on stderr (the message also reaches the exception) and the message kept.
void report(const std::string &message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  last_error = message;
}

}  // namespace

std::string available() {
  std::string s;
  for (int p = 0; p < kCount; ++p)
    if (kHere.ok[p]) s += std::string(s.empty() ? "" : " ") + kPaths[p];
  return s;
}

// MS_MOE_OPS_ISA is read at every call, so it can be changed between calls.
int path() {
  const char *want = std::getenv("MS_MOE_OPS_ISA");
  if (want == nullptr || *want == '\0') return kHere.best;
  for (int p = 0; p < kCount; ++p) {
    if (std::strcmp(want, kPaths[p]) != 0) continue;
    if (kHere.ok[p]) return p;
    report(std::string("ms_moe_ops: MS_MOE_OPS_ISA=") + want + ": this CPU (or build) has no " +
           want + " path; it runs: " + available());
    return -1;
  }
  report(std::string("ms_moe_ops: MS_MOE_OPS_ISA=") + want + " is not a path; use one of: " +
         available());
  return -1;
}

void record_error(const char *message) { last_error = message; }

void throw_error() {
  throw std::runtime_error(last_error.empty() ? "ms_moe_ops: kernel failed" : last_error);
}

}  // namespace dispatch
}  // namespace moe

// The paths this CPU and library can run, lowest first ("generic avx2 avxvnni avx512"), for
// callers that want to test or report them.
MOE_EXPORT const char *MsMoeOpsIsaPaths() {
  static const std::string paths = moe::dispatch::available();
  return paths.c_str();
}

// Every path the library holds, whether this CPU runs it or not ("generic avx2 avxvnni avx512").
MOE_EXPORT const char *MsMoeOpsIsaBuilt() {
  static const std::string paths = [] {
    std::string s;
    for (const char *p : moe::dispatch::kPaths) s += std::string(s.empty() ? "" : " ") + p;
    return s;
  }();
  return paths.c_str();
}
