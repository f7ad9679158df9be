// Which instruction-set path the exported kernels call (see isa.h). Compiled once, with the
// baseline flags: it must run on any CPU of the target architecture.
#include "../isa.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace moe {
namespace dispatch {
namespace {

const char *const kPaths[] = {"generic", "avx2", "avx512"};

// The best path the CPU offers and the library holds (libgcc's feature test also checks that
// the OS saves the AVX/AVX-512 registers).
int best_path() {
#if defined(MOE_X86_PATHS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512vnni")) return 2;
  if (__builtin_cpu_supports("x86-64-v3")) return 1;
#endif
  return 0;
}

const int kBest = best_path();

thread_local std::string last_error;

// One line on stderr (the message also reaches the exception) and the message kept.
void report(const std::string &message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  last_error = message;
}

std::string available() {
  std::string s;
  for (int p = 0; p <= kBest; ++p) s += std::string(p ? " " : "") + kPaths[p];
  return s;
}

}  // namespace

// MS_MOE_OPS_ISA is read at every call, so it can be changed between calls.
int path() {
  const char *want = std::getenv("MS_MOE_OPS_ISA");
  if (want == nullptr || *want == '\0') return kBest;
  for (int p = 0; p < 3; ++p) {
    if (std::strcmp(want, kPaths[p]) != 0) continue;
    if (p <= kBest) return p;
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

// The paths this CPU and library can run, lowest first ("generic avx2 avx512"), for callers
// that want to test or report them.
MOE_EXPORT const char *MsMoeOpsIsaPaths() {
  static const std::string paths = moe::dispatch::available();
  return paths.c_str();
}
