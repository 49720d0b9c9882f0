/* Driver API: back-to-back launches of a small kernel on one stream, the way inference
 * loops issue them; prints the rate. The last launch's result is checked.
 * usage: launch_rate MODULE.ptx [KERNELS] [N] */
#include <stdint.h>
#include "check.h"

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODULE.ptx [KERNELS] [N]\n", argv[0]);
        return 2;
    }
    unsigned int kernels = argc > 2 ? (unsigned int)strtoul(argv[2], 0, 0) : 10000;
    unsigned int n = argc > 3 ? (unsigned int)strtoul(argv[3], 0, 0) : 256;
    size_t bytes = (size_t)n * 4;
    CUmodule mod;
    CUfunction vadd;
    CUdeviceptr a, b, c;
    setup();
    CHECK(cuModuleLoad(&mod, argv[1]));
    CHECK(cuModuleGetFunction(&vadd, mod, "vgpu_test_vadd_u32"));
    CHECK(cuMemAlloc(&a, bytes));
    CHECK(cuMemAlloc(&b, bytes));
    CHECK(cuMemAlloc(&c, bytes));
    CHECK(cuMemsetD32(a, 3, n));
    CHECK(cuMemsetD32(b, 4, n));
    void *params[] = {&a, &b, &c, &n};
    unsigned int blocks = (n + 255) / 256;
    /* Warm up: the first launches load the module's code. */
    for (int i = 0; i < 100; i++)
        CHECK(cuLaunchKernel(vadd, blocks, 1, 1, 256, 1, 1, 0, 0, params, 0));
    CHECK(cuCtxSynchronize());
    double t0 = now_seconds();
    for (unsigned int i = 0; i < kernels; i++)
        CHECK(cuLaunchKernel(vadd, blocks, 1, 1, 256, 1, 1, 0, 0, params, 0));
    double issued = now_seconds() - t0;
    CHECK(cuCtxSynchronize());
    double secs = now_seconds() - t0;
    uint32_t last;
    CHECK(cuMemcpyDtoH(&last, c + bytes - 4, 4));
    if (last != 7) {
        fprintf(stderr, "c[n-1] = %u, expected 7\n", last);
        return 1;
    }
    printf("launch_rate kernels=%u n=%u seconds=%.6f issue_seconds=%.6f rate=%.0f\n", kernels,
           n, secs, issued, kernels / secs);
    return 0;
}
