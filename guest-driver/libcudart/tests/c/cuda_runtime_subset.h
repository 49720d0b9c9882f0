/* The part of NVIDIA's cuda_runtime_api.h (and of what nvcc's generated host code
 * declares) the test programs use: the same names, types and values, so a program built
 * against it calls exactly what an nvcc-built program calls. */
#ifndef VGPU_CUDA_RUNTIME_SUBSET_H
#define VGPU_CUDA_RUNTIME_SUBSET_H
#include <stddef.h>

typedef int cudaError_t;
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct dim3 { unsigned int x, y, z; } dim3;

#define cudaSuccess 0
#define cudaErrorInvalidValue 1
#define cudaErrorInvalidDeviceFunction 98
#define cudaErrorInvalidDevice 101
#define cudaErrorNotSupported 801
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                      cudaMemcpyDeviceToDevice, cudaMemcpyDefault };

cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDeviceProperties_v2(void *prop, int dev);
cudaError_t cudaDeviceGetAttribute(int *v, int attr, int dev);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDeviceReset(void);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorName(cudaError_t e);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind k,
                            cudaStream_t s);
cudaError_t cudaMemset(void *p, int v, size_t n);
cudaError_t cudaGetSymbolAddress(void **p, const void *symbol);
cudaError_t cudaMemcpyToSymbol(const void *symbol, const void *src, size_t n, size_t offset,
                               enum cudaMemcpyKind k);
cudaError_t cudaMemcpyFromSymbol(void *dst, const void *symbol, size_t n, size_t offset,
                                 enum cudaMemcpyKind k);
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaLaunchKernel(const void *f, dim3 g, dim3 b, void **args, size_t shm,
                             cudaStream_t s);

/* What nvcc's generated code calls. */
void **__cudaRegisterFatBinary(void *wrapper);
void __cudaRegisterFatBinaryEnd(void **h);
void __cudaUnregisterFatBinary(void **h);
void __cudaRegisterFunction(void **h, const char *hostFun, char *deviceFun,
                            const char *deviceName, int threadLimit, void *tid, void *bid,
                            dim3 *bDim, dim3 *gDim, int *wSize);
void __cudaRegisterVar(void **h, char *hostVar, char *deviceAddress, const char *deviceName,
                       int ext, size_t size, int constant, int global);
unsigned __cudaPushCallConfiguration(dim3 g, dim3 b, size_t shm, void *stream);
cudaError_t __cudaPopCallConfiguration(dim3 *g, dim3 *b, size_t *shm, void *stream);
cudaError_t __cudaGetKernel(void **kernel, const void *fun);
cudaError_t __cudaLaunchKernel(void *kernel, dim3 g, dim3 b, void **args, size_t shm,
                               cudaStream_t s);
#endif
