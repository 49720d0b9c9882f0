/* Driver API: a kernel-dominated loop (a large vector add, repeated), timed by the wall
 * clock and by events; the result is checked. With COLD_MIB, that much more device
 * memory is allocated and written once before the loop and never touched again (a cold
 * set: on an oversubscribed VM it is what should be swapped out).
 * usage: vadd_loop MODULE.ptx [ITERATIONS] [N] [COLD_MIB] */
#include <stdint.h>
#include "check.h"

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODULE.ptx [ITERATIONS] [N]\n", argv[0]);
        return 2;
    }
    unsigned int iters = argc > 2 ? (unsigned int)strtoul(argv[2], 0, 0) : 200;
    unsigned int n = argc > 3 ? (unsigned int)strtoul(argv[3], 0, 0) : 1u << 26;
    unsigned int cold_mib = argc > 4 ? (unsigned int)strtoul(argv[4], 0, 0) : 0;
    size_t bytes = (size_t)n * 4;
    CUmodule mod;
    CUfunction vadd;
    CUdeviceptr a, b, c;
    CUevent start, stop;
    setup();
    CHECK(cuModuleLoad(&mod, argv[1]));
    CHECK(cuModuleGetFunction(&vadd, mod, "vgpu_test_vadd_u32"));
    CHECK(cuMemAlloc(&a, bytes));
    CHECK(cuMemAlloc(&b, bytes));
    CHECK(cuMemAlloc(&c, bytes));
    CHECK(cuMemsetD32(a, 1, n));
    CHECK(cuMemsetD32(b, 2, n));
    /* The cold set, in 64 MiB pieces. */
    for (unsigned int m = 0; m < cold_mib; m += 64) {
        CUdeviceptr cold;
        size_t piece = (size_t)(cold_mib - m < 64 ? cold_mib - m : 64) << 20;
        CHECK(cuMemAlloc(&cold, piece));
        CHECK(cuMemsetD32(cold, m, piece / 4));
    }
    CHECK(cuEventCreate(&start, CU_EVENT_DEFAULT));
    CHECK(cuEventCreate(&stop, CU_EVENT_DEFAULT));
    void *params[] = {&a, &b, &c, &n};
    unsigned int blocks = (n + 255) / 256;
    CHECK(cuLaunchKernel(vadd, blocks, 1, 1, 256, 1, 1, 0, 0, params, 0));
    CHECK(cuCtxSynchronize());
    double t0 = now_seconds();
    CHECK(cuEventRecord(start, 0));
    for (unsigned int i = 0; i < iters; i++)
        CHECK(cuLaunchKernel(vadd, blocks, 1, 1, 256, 1, 1, 0, 0, params, 0));
    CHECK(cuEventRecord(stop, 0));
    CHECK(cuEventSynchronize(stop));
    double secs = now_seconds() - t0;
    float ms;
    CHECK(cuEventElapsedTime(&ms, start, stop));
    uint32_t last;
    CHECK(cuMemcpyDtoH(&last, c + bytes - 4, 4));
    if (last != 3) {
        fprintf(stderr, "c[n-1] = %u, expected 3\n", last);
        return 1;
    }
    printf("vadd_loop iterations=%u n=%u cold_mib=%u seconds=%.6f event_ms=%.3f "
           "ms_per_kernel=%.4f\n",
           iters, n, cold_mib, secs, ms, secs * 1e3 / iters);
    return 0;
}
