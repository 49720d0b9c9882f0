/* Driver API: several streams with pinned host buffers, async copies, launches and
 * events (timing, a cross-stream wait), checked against the CPU.
 * usage: streams_events MODULE.ptx [N] */
#include <stdint.h>
#include <string.h>
#include "check.h"

#define STREAMS 4

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODULE.ptx [N]\n", argv[0]);
        return 2;
    }
    unsigned int n = argc > 2 ? (unsigned int)strtoul(argv[2], 0, 0) : 1u << 18;
    size_t bytes = (size_t)n * 4;
    CUcontext ctx = setup();
    CUmodule mod;
    CUfunction vadd;
    CUstream s[STREAMS];
    CUevent start[STREAMS], stop[STREAMS];
    CUdeviceptr a[STREAMS], b[STREAMS], c[STREAMS];
    uint32_t *h[STREAMS];
    (void)ctx;

    CHECK(cuModuleLoad(&mod, argv[1]));
    CHECK(cuModuleGetFunction(&vadd, mod, "vgpu_test_vadd_u32"));
    for (int k = 0; k < STREAMS; k++) {
        CHECK(cuStreamCreate(&s[k], k % 2 ? CU_STREAM_NON_BLOCKING : 0));
        CHECK(cuEventCreate(&start[k], CU_EVENT_DEFAULT));
        CHECK(cuEventCreate(&stop[k], CU_EVENT_DEFAULT));
        CHECK(cuMemAlloc(&a[k], bytes));
        CHECK(cuMemAlloc(&b[k], bytes));
        CHECK(cuMemAlloc(&c[k], bytes));
        CHECK(cuMemAllocHost((void **)&h[k], 3 * bytes));
        for (unsigned int i = 0; i < n; i++) {
            h[k][i] = i + (uint32_t)k * 1000003u;
            h[k][n + i] = i * 31u + (uint32_t)k;
        }
    }
    for (int k = 0; k < STREAMS; k++) {
        CHECK(cuEventRecord(start[k], s[k]));
        CHECK(cuMemcpyHtoDAsync(a[k], h[k], bytes, s[k]));
        CHECK(cuMemcpyHtoDAsync(b[k], h[k] + n, bytes, s[k]));
        void *params[] = {&a[k], &b[k], &c[k], &n};
        CHECK(cuLaunchKernel(vadd, (n + 255) / 256, 1, 1, 256, 1, 1, 0, s[k], params, 0));
        CHECK(cuEventRecord(stop[k], s[k]));
    }
    /* Stream 1 adds stream 0's result to its own once stream 0 is done with it. */
    CHECK(cuStreamWaitEvent(s[1], stop[0], 0));
    void *params[] = {&c[0], &c[1], &a[1], &n};
    CHECK(cuLaunchKernel(vadd, (n + 255) / 256, 1, 1, 256, 1, 1, 0, s[1], params, 0));
    uint64_t sum = 0;
    for (int k = 0; k < STREAMS; k++) {
        CHECK(cuMemcpyDtoHAsync(h[k] + 2 * n, c[k], bytes, s[k]));
        CHECK(cuStreamSynchronize(s[k]));
        CHECK(cuEventSynchronize(stop[k]));
        CHECK(cuEventQuery(stop[k]));
        CHECK(cuStreamQuery(s[k]));
        float ms = -1;
        CHECK(cuEventElapsedTime(&ms, start[k], stop[k]));
        if (!(ms >= 0.0f)) {
            fprintf(stderr, "stream %d: elapsed %f ms\n", k, ms);
            return 1;
        }
        for (unsigned int i = 0; i < n; i++) {
            uint32_t want = h[k][i] + h[k][n + i];
            if (h[k][2 * n + i] != want) {
                fprintf(stderr, "stream %d c[%u] = %#x, expected %#x\n", k, i,
                        h[k][2 * n + i], want);
                return 1;
            }
            sum += want;
        }
    }
    /* The cross-stream sum: stream 0's c plus stream 1's c. */
    uint32_t *x = malloc(bytes);
    CHECK(cuMemcpyDtoH(x, a[1], bytes));
    for (unsigned int i = 0; i < n; i++) {
        uint32_t want = h[0][2 * n + i] + h[1][2 * n + i];
        if (x[i] != want) {
            fprintf(stderr, "cross-stream x[%u] = %#x, expected %#x\n", i, x[i], want);
            return 1;
        }
        sum += want;
    }
    for (int k = 0; k < STREAMS; k++) {
        CHECK(cuEventDestroy(start[k]));
        CHECK(cuEventDestroy(stop[k]));
        CHECK(cuStreamDestroy(s[k]));
        CHECK(cuMemFree(a[k]));
        CHECK(cuMemFree(b[k]));
        CHECK(cuMemFree(c[k]));
        CHECK(cuMemFreeHost(h[k]));
    }
    CHECK(cuModuleUnload(mod));
    CHECK(cuDevicePrimaryCtxRelease(0));
    printf("streams_events n=%u streams=%d sum=%llu\n", n, STREAMS, (unsigned long long)sum);
    return 0;
}
