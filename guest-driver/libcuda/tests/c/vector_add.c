/* Driver API: a vector add from a PTX module, checked against the CPU.
 * usage: vector_add MODULE.ptx [N] */
#include <stdint.h>
#include <string.h>
#include "check.h"

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODULE.ptx [N]\n", argv[0]);
        return 2;
    }
    unsigned int n = argc > 2 ? (unsigned int)strtoul(argv[2], 0, 0) : 1u << 20;
    size_t bytes = (size_t)n * 4;
    int version, count, threads, warp;
    char name[128];
    size_t total, free_b, total_b;
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction vadd;
    CUdeviceptr a, b, c;

    CHECK(cuInit(0));
    CHECK(cuDriverGetVersion(&version));
    CHECK(cuDeviceGetCount(&count));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDeviceGetName(name, sizeof name, dev));
    CHECK(cuDeviceTotalMem(&total, dev));
    CHECK(cuDeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, dev));
    CHECK(cuDeviceGetAttribute(&warp, CU_DEVICE_ATTRIBUTE_WARP_SIZE, dev));
    fprintf(stderr, "driver %d, %d device(s): %s, %zu MiB, %d threads/block, warp %d\n",
            version, count, name, total >> 20, threads, warp);
    CHECK(cuCtxCreate(&ctx, 0, dev));
    CHECK(cuModuleLoad(&mod, argv[1]));
    CHECK(cuModuleGetFunction(&vadd, mod, "vgpu_test_vadd_u32"));

    uint32_t *ha = malloc(bytes), *hb = malloc(bytes), *hc = malloc(bytes);
    for (unsigned int i = 0; i < n; i++) {
        ha[i] = i * 2654435761u;
        hb[i] = ~i + 7;
    }
    CHECK(cuMemAlloc(&a, bytes));
    CHECK(cuMemAlloc(&b, bytes));
    CHECK(cuMemAlloc(&c, bytes));
    CHECK(cuMemGetInfo(&free_b, &total_b));
    if (free_b > total_b) {
        fprintf(stderr, "cuMemGetInfo: free %zu > total %zu\n", free_b, total_b);
        return 1;
    }
    CHECK(cuMemsetD32(c, 0xdeadbeef, n));
    CHECK(cuMemcpyHtoD(a, ha, bytes));
    CHECK(cuMemcpyHtoD(b, hb, bytes));
    void *params[] = {&a, &b, &c, &n};
    CHECK(cuLaunchKernel(vadd, (n + 255) / 256, 1, 1, 256, 1, 1, 0, 0, params, 0));
    CHECK(cuCtxSynchronize());
    CHECK(cuMemcpyDtoH(hc, c, bytes));
    uint64_t sum = 0;
    for (unsigned int i = 0; i < n; i++) {
        if (hc[i] != ha[i] + hb[i]) {
            fprintf(stderr, "c[%u] = %#x, expected %#x\n", i, hc[i], ha[i] + hb[i]);
            return 1;
        }
        sum += hc[i];
    }
    /* A device-to-device copy and a byte set, read back. */
    CHECK(cuMemcpyDtoD(a, c, bytes));
    CHECK(cuMemsetD8(b, 0x5a, bytes));
    CHECK(cuMemcpyDtoH(ha, a, bytes));
    CHECK(cuMemcpyDtoH(hb, b, bytes));
    if (memcmp(ha, hc, bytes) != 0 || hb[n - 1] != 0x5a5a5a5au) {
        fprintf(stderr, "device-to-device copy or memset differ\n");
        return 1;
    }
    CHECK(cuMemFree(a));
    CHECK(cuMemFree(b));
    CHECK(cuMemFree(c));
    CHECK(cuModuleUnload(mod));
    CHECK(cuCtxDestroy(ctx));
    printf("vector_add n=%u sum=%llu\n", n, (unsigned long long)sum);
    return 0;
}
