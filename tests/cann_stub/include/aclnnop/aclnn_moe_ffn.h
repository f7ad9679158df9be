// Stub of CANN's aclnnop/aclnn_moe_ffn.h: the first-stage prototype below is copied word for word
// from its source (tests/data/aclnn_prototypes.json keeps the same text); the second stage is
// the two-stage interface's common form. See acl/acl_base.h for what this tree is.
// Source: CANN operator document aclnnMoeFFN.md, section 接口原型 (the seed). Not bound: expertTokens
// is a host aclIntArray, which a Custom primitive of MindSpore 2.10 can only receive as a constant
// of the graph (no input of a Custom primitive is read on the host at run time), and current CANN
// operator sources no longer have this kernel (aclnnFFN/aclnnFFNV3 carry its computation). Its
// char* activation would cross..
#ifndef STUB_ACLNNOP_ACLNN_MOE_FFN_H_
#define STUB_ACLNNOP_ACLNN_MOE_FFN_H_
#include "aclnn/aclnn_base.h"

#ifdef __cplusplus
extern "C" {
#endif

aclnnStatus aclnnMoeFFNGetWorkspaceSize(const aclTensor *x, const aclIntArray *expertTokens, const aclTensor *weight1, const aclTensor *bias1, const aclTensor *weight2, const aclTensor *bias2, const aclTensor *scale, const aclTensor *offset, const aclTensor *deqScale1, const aclTensor *deqScale2, char *activation, const aclTensor *y, uint64_t *workspaceSize, aclOpExecutor **executor);

aclnnStatus aclnnMoeFFN(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream);

#ifdef __cplusplus
}
#endif
#endif  // STUB_ACLNNOP_ACLNN_MOE_FFN_H_
