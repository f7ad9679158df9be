// Stub of CANN's aclnnop/aclnn_moe_gating_top_k_backward.h: the first-stage prototype below is copied word for word
// from its source (tests/data/aclnn_prototypes.json keeps the same text); the second stage is
// the two-stage interface's common form. See acl/acl_base.h for what this tree is.
// Source: CANN operator document aclnnMoeGatingTopKBackward.md, section 函数原型.
#ifndef STUB_ACLNNOP_ACLNN_MOE_GATING_TOP_K_BACKWARD_H_
#define STUB_ACLNNOP_ACLNN_MOE_GATING_TOP_K_BACKWARD_H_
#include "aclnn/aclnn_base.h"

#ifdef __cplusplus
extern "C" {
#endif

aclnnStatus aclnnMoeGatingTopKBackwardGetWorkspaceSize(const aclTensor *xNorm, const aclTensor *gradY, const aclTensor *expertIdx, int64_t renorm, int64_t normType, double routedScalingFactor, double eps, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor);

aclnnStatus aclnnMoeGatingTopKBackward(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream);

#ifdef __cplusplus
}
#endif
#endif  // STUB_ACLNNOP_ACLNN_MOE_GATING_TOP_K_BACKWARD_H_
