// Stub of CANN's aclnnop/aclnn_ffn_v3.h: the first-stage prototype below is copied word for word
// from its source (tests/data/aclnn_prototypes.json keeps the same text); the second stage is
// the two-stage interface's common form. See acl/acl_base.h for what this tree is.
// Source: CANN ops-transformer generated header ffn/ffn/op_host/op_api/aclnn_ffn_v3.h
// ("该FFN算子提供MoeFFN和FFN的计算功能"; expertTokensOptional a device aclTensor, activation a char*).
#ifndef STUB_ACLNNOP_ACLNN_FFN_V3_H_
#define STUB_ACLNNOP_ACLNN_FFN_V3_H_
#include "aclnn/aclnn_base.h"

#ifdef __cplusplus
extern "C" {
#endif

aclnnStatus aclnnFFNV3GetWorkspaceSize(const aclTensor *x, const aclTensor *weight1, const aclTensor *weight2, const aclTensor *expertTokensOptional, const aclTensor *bias1Optional, const aclTensor *bias2Optional, const aclTensor *scaleOptional, const aclTensor *offsetOptional, const aclTensor *deqScale1Optional, const aclTensor *deqScale2Optional, const aclTensor *antiquantScale1Optional, const aclTensor *antiquantScale2Optional, const aclTensor *antiquantOffset1Optional, const aclTensor *antiquantOffset2Optional, const char *activation, int64_t innerPrecise, bool tokensIndexFlag, const aclTensor *y, uint64_t *workspaceSize, aclOpExecutor **executor);

aclnnStatus aclnnFFNV3(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream);

#ifdef __cplusplus
}
#endif
#endif  // STUB_ACLNNOP_ACLNN_FFN_V3_H_
