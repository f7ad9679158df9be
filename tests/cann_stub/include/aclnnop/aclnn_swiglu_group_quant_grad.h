// Stub of CANN's aclnnop/aclnn_swiglu_group_quant_grad.h: the first-stage prototype below is copied word for word
// from its source (tests/data/aclnn_prototypes.json keeps the same text); the second stage is
// the two-stage interface's common form. See acl/acl_base.h for what this tree is.
// Source: CANN ops-nn generated header aclnnop/aclnn_swiglu_group_quant_grad.h (groupIndexOptional
// an aclTensor, as the operator document's parameter table also says: aclTensor*, INT64, 1-D).
#ifndef STUB_ACLNNOP_ACLNN_SWIGLU_GROUP_QUANT_GRAD_H_
#define STUB_ACLNNOP_ACLNN_SWIGLU_GROUP_QUANT_GRAD_H_
#include "aclnn/aclnn_base.h"

#ifdef __cplusplus
extern "C" {
#endif

aclnnStatus aclnnSwigluGroupQuantGradGetWorkspaceSize(const aclTensor *gradY, const aclTensor *x, const aclTensor *weightOptional, const aclTensor *yOriginOptional, const aclTensor *groupIndexOptional, double clampLimit, const aclTensor *gradXOut, const aclTensor *gradWeightOutOptional, uint64_t *workspaceSize, aclOpExecutor **executor);

aclnnStatus aclnnSwigluGroupQuantGrad(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream);

#ifdef __cplusplus
}
#endif
#endif  // STUB_ACLNNOP_ACLNN_SWIGLU_GROUP_QUANT_GRAD_H_
