// MoeFFN int8 path (SPEC §4 quant path).
#include "ffn.h"

namespace moe {

int moe_ffn_int8(const Args &args, Extra *extra) {
  return fail("moe_ffn", "the int8 path is not built yet");
}

}  // namespace moe
