// Stub of CANN's acl/acl_rt.h (runtime types): see acl_base.h for what this tree is.
#pragma once
#include "acl/acl_base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef void *aclrtStream;
typedef void *aclrtEvent;
typedef void *aclrtContext;
typedef void *aclrtDrvMemHandle;
typedef struct aclrtExceptionInfo aclrtExceptionInfo;
typedef struct aclrtAllocatorDesc aclrtAllocatorDesc;
typedef void (*aclrtCallback)(void *userData);
typedef void (*aclrtExceptionInfoCallback)(aclrtExceptionInfo *exceptionInfo);

typedef enum aclrtRunMode { ACL_DEVICE = 0, ACL_HOST = 1 } aclrtRunMode;
typedef enum aclrtMemcpyKind {
  ACL_MEMCPY_HOST_TO_HOST = 0,
  ACL_MEMCPY_HOST_TO_DEVICE = 1,
  ACL_MEMCPY_DEVICE_TO_HOST = 2,
  ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
  ACL_MEMCPY_DEFAULT = 4,
} aclrtMemcpyKind;
typedef enum aclrtMemMallocPolicy {
  ACL_MEM_MALLOC_HUGE_FIRST = 0,
  ACL_MEM_MALLOC_HUGE_ONLY = 1,
  ACL_MEM_MALLOC_NORMAL_ONLY = 2,
  ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3,
  ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4,
  ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5,
  ACL_MEM_TYPE_LOW_BAND_WIDTH = 0x100,
  ACL_MEM_TYPE_HIGH_BAND_WIDTH = 0x1000,
} aclrtMemMallocPolicy;
typedef enum aclrtMemAttr { ACL_DDR_MEM = 0, ACL_HBM_MEM = 1, ACL_DDR_MEM_HUGE = 2 } aclrtMemAttr;
typedef enum aclrtStreamStatus { ACL_STREAM_STATUS_COMPLETE = 0, ACL_STREAM_STATUS_NOT_READY = 1 } aclrtStreamStatus;
typedef enum aclrtEventRecordedStatus {
  ACL_EVENT_RECORDED_STATUS_NOT_READY = 0,
  ACL_EVENT_RECORDED_STATUS_COMPLETE = 1,
} aclrtEventRecordedStatus;
typedef enum aclrtCallbackBlockType { ACL_CALLBACK_NO_BLOCK = 0, ACL_CALLBACK_BLOCK = 1 } aclrtCallbackBlockType;
typedef enum aclrtLastErrLevel { ACL_RT_THREAD_LEVEL = 0 } aclrtLastErrLevel;
typedef enum aclrtFloatOverflowMode { ACL_RT_OVERFLOW_MODE_SATURATION = 0, ACL_RT_OVERFLOW_MODE_INFNAN = 1 } aclrtFloatOverflowMode;
typedef enum aclrtMemHandleType { ACL_MEM_HANDLE_TYPE_NONE = 0 } aclrtMemHandleType;
typedef enum aclSysParamOpt { ACL_OPT_DETERMINISTIC = 0, ACL_OPT_ENABLE_DEBUG_KERNEL = 1 } aclSysParamOpt;
typedef enum aclrtDeviceStatus { ACL_RT_DEVICE_STATUS_NORMAL = 0, ACL_RT_DEVICE_STATUS_ABNORMAL = 1 } aclrtDeviceStatus;
typedef enum aclrtMemLocationType { ACL_MEM_LOCATION_TYPE_HOST = 0, ACL_MEM_LOCATION_TYPE_DEVICE = 1 } aclrtMemLocationType;
typedef enum aclrtMemAllocationType { ACL_MEM_ALLOCATION_TYPE_PINNED = 0 } aclrtMemAllocationType;

typedef struct aclrtMemUceInfo {
  void *addr;
  size_t len;
  size_t reserved[14];
} aclrtMemUceInfo;
typedef struct aclrtMemLocation {
  uint32_t id;
  aclrtMemLocationType type;
} aclrtMemLocation;
typedef struct aclrtPhysicalMemProp {
  aclrtMemHandleType handleType;
  aclrtMemAllocationType allocationType;
  aclrtMemAttr memAttr;
  aclrtMemLocation location;
  uint64_t reserve;
} aclrtPhysicalMemProp;

aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void *devPtr);
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind);
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);
aclError aclrtGetDevice(int32_t *deviceId);
aclError aclrtSetDevice(int32_t deviceId);

#ifdef __cplusplus
}
#endif
