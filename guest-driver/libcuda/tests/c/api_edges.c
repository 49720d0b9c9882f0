/* Driver API edges a program may hit: calls before cuInit, bad handles and ranges,
 * garbage module images, entry points the library does not cover, cuGetProcAddress.
 * usage: api_edges [MODULE.ptx]  (without a module: the GPU refuses module loads) */
#include <stdint.h>
#include <string.h>
#include "check.h"

int main(int argc, char **argv) {
    CUdeviceptr p;
    CUmodule mod;
    CUfunction f;
    CUstream s;
    void *fn = 0;
    int status = -1;
    EXPECT(cuMemAlloc(&p, 4096), CUDA_ERROR_NOT_INITIALIZED);
    setup();
    EXPECT(cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemAlloc(&p, 4096));
    uint8_t buf[8192] = {0};
    EXPECT(cuMemcpyHtoD(p + 4000, buf, 200), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemcpyDtoH(buf, p - 8, 16), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemFree(p + 8), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamSynchronize((CUstream)(uintptr_t)0x7777), CUDA_ERROR_INVALID_HANDLE);
    EXPECT(cuModuleGetFunction(&f, (CUmodule)(uintptr_t)0x7777, "x"), CUDA_ERROR_INVALID_HANDLE);
    EXPECT(cuLaunchKernel((CUfunction)(uintptr_t)0x7777, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0),
           CUDA_ERROR_INVALID_HANDLE);
    EXPECT(cuGraphCreate(0, 0), CUDA_ERROR_NOT_SUPPORTED);
    CHECK(cuGetProcAddress("cuMemAlloc", &fn, 12000, 0, &status));
    CUdeviceptr q;
    if (!fn || status != 0 || ((CUresult(*)(CUdeviceptr *, size_t))fn)(&q, 64) != 0) {
        fprintf(stderr, "cuGetProcAddress(cuMemAlloc) = %p, status %d\n", fn, status);
        return 1;
    }
    CHECK(cuMemFree(q));
    CHECK(cuGetProcAddress("cuGraphCreate", &fn, 12000, 0, &status));
    if (((CUresult(*)(CUgraph *, unsigned int))fn)(0, 0) != CUDA_ERROR_NOT_SUPPORTED)
        return 1;
    EXPECT(cuGetProcAddress("cuNoSuchEntryPoint", &fn, 12000, 0, &status), CUDA_ERROR_NOT_FOUND);
    if (fn != 0 || status != 1)
        return 1;
    /* Garbage and truncated images. */
    static const char garbage[] = "\x7f" "ELF\x01 not a cubin";
    if (cuModuleLoadData(&mod, "") == CUDA_SUCCESS)
        return 1;
    CUresult r = cuModuleLoadData(&mod, garbage);
    if (r == CUDA_SUCCESS) {
        fprintf(stderr, "a garbage image loaded\n");
        return 1;
    }
    r = cuModuleLoadData(&mod, ".version 8.0\n.target sm_90\n.visible .entry f(\n");
    if (argc < 2) {
        /* The GPU runs no guest modules: every load says so. */
        EXPECT(r, CUDA_ERROR_NOT_SUPPORTED);
        printf("api_edges modules=refused (%s)\n", err_name(r));
    } else {
        CHECK(cuModuleLoad(&mod, argv[1]));
        EXPECT(cuModuleGetFunction(&f, mod, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
        CHECK(cuModuleGetFunction(&f, mod, "vgpu_test_vadd_u32"));
        /* A packed parameter buffer whose size is not the kernel's, and blocks CUDA
         * refuses; the context stays usable. */
        static uint64_t packed[512] = {0};
        size_t size = 4000;
        void *extra[] = {(void *)1, packed, (void *)2, &size, (void *)0};
        EXPECT(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, 0, 0, extra), CUDA_ERROR_INVALID_VALUE);
        size = 28;
        EXPECT(cuLaunchKernel(f, 1, 1, 1, 2048, 1, 1, 0, 0, 0, extra), CUDA_ERROR_INVALID_VALUE);
        EXPECT(cuLaunchKernel(f, 0, 1, 1, 32, 1, 1, 0, 0, 0, extra), CUDA_ERROR_INVALID_VALUE);
        CHECK(cuCtxSynchronize());
        printf("api_edges modules=loaded\n");
    }
    CHECK(cuStreamCreate(&s, 0));
    CHECK(cuStreamDestroy(s));
    return 0;
}
