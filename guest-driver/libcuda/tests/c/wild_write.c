/* Driver API: a kernel that writes a wild pointer. The launch or the synchronize after
 * it fails, and the context stays failed (a real GPU's sticky error).
 * usage: wild_write MODULE.ptx */
#include "check.h"

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODULE.ptx\n", argv[0]);
        return 2;
    }
    setup();
    CUmodule mod;
    CUfunction wild;
    CUdeviceptr p = 0x10, q;
    CHECK(cuModuleLoad(&mod, argv[1]));
    CHECK(cuModuleGetFunction(&wild, mod, "vgpu_test_wild_write"));
    void *params[] = {&p};
    CUresult r = cuLaunchKernel(wild, 1, 1, 1, 1, 1, 1, 0, 0, params, 0);
    if (r == CUDA_SUCCESS)
        r = cuCtxSynchronize();
    if (r == CUDA_SUCCESS) {
        fprintf(stderr, "the wild write went unnoticed\n");
        return 1;
    }
    CUresult again = cuMemAlloc(&q, 4096);
    if (again == CUDA_SUCCESS) {
        fprintf(stderr, "the context works after the fault\n");
        return 1;
    }
    printf("wild_write fault=%s then=%s\n", err_name(r), err_name(again));
    return 0;
}
