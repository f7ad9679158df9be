// Stub of CANN's hccl/hccl_types.h (HCCL API reference): see acl/acl_base.h for what this tree is.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
typedef void *HcclComm;
typedef enum {
  HCCL_SUCCESS = 0,
  HCCL_E_PARA = 1,
  HCCL_E_RESERVED
} HcclResult;
typedef enum {
  HCCL_REDUCE_SUM = 0,
  HCCL_REDUCE_PROD = 1,
  HCCL_REDUCE_MAX = 2,
  HCCL_REDUCE_MIN = 3,
  HCCL_REDUCE_RESERVED
} HcclReduceOp;
typedef enum {
  HCCL_DATA_TYPE_INT8 = 0,
  HCCL_DATA_TYPE_INT16 = 1,
  HCCL_DATA_TYPE_INT32 = 2,
  HCCL_DATA_TYPE_FP16 = 3,
  HCCL_DATA_TYPE_FP32 = 4,
  HCCL_DATA_TYPE_INT64 = 5,
  HCCL_DATA_TYPE_UINT64 = 6,
  HCCL_DATA_TYPE_UINT8 = 7,
  HCCL_DATA_TYPE_UINT16 = 8,
  HCCL_DATA_TYPE_UINT32 = 9,
  HCCL_DATA_TYPE_FP64 = 10,
  HCCL_DATA_TYPE_BFP16 = 11,
  HCCL_DATA_TYPE_RESERVED
} HcclDataType;
const uint32_t HCCL_ROOT_INFO_BYTES = 4108;
typedef struct HcclRootInfoDef {
  char internal[HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;
typedef struct HcclCommConfigDef {
  char reserved[1024];
} HcclCommConfig;
#ifdef __cplusplus
}
#endif
