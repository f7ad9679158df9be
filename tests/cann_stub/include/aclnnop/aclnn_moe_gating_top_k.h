// Stub of CANN's aclnnop/aclnn_moe_gating_top_k.h: the first-stage prototype below is copied word for word
// from its source (tests/data/aclnn_prototypes.json keeps the same text); the second stage is
// the two-stage interface's common form. See acl/acl_base.h for what this tree is.
// Source: CANN ops-transformer, generated header aclnnop/aclnn_moe_gating_top_k.h; the same text
// in its operator document aclnnMoeGatingTopK.md.
#ifndef STUB_ACLNNOP_ACLNN_MOE_GATING_TOP_K_H_
#define STUB_ACLNNOP_ACLNN_MOE_GATING_TOP_K_H_
#include "aclnn/aclnn_base.h"

#ifdef __cplusplus
extern "C" {
#endif

aclnnStatus aclnnMoeGatingTopKGetWorkspaceSize(const aclTensor *x, const aclTensor *biasOptional, int64_t k, int64_t kGroup, int64_t groupCount, int64_t groupSelectMode, int64_t renorm, int64_t normType, bool outFlag, double routedScalingFactor, double eps, const aclTensor *yOut, const aclTensor *expertIdxOut, const aclTensor *outOut, uint64_t *workspaceSize, aclOpExecutor **executor);

aclnnStatus aclnnMoeGatingTopK(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream);

#ifdef __cplusplus
}
#endif
#endif  // STUB_ACLNNOP_ACLNN_MOE_GATING_TOP_K_H_
