/* Driver API: a module's __device__ global, set by one kernel and read by another, then
 * read and written by copies at its address (cuMemcpyDtoH/HtoD, as cudaMemcpyToSymbol).
 * usage: device_global MODULE.ptx VALUE */
#include <stdint.h>
#include "check.h"

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODULE.ptx VALUE\n", argv[0]);
        return 2;
    }
    uint32_t v = (uint32_t)strtoul(argv[2], 0, 0), got = 0, one = 1;
    setup();
    CUmodule mod;
    CUfunction set, copy;
    CUdeviceptr g, out;
    size_t size;
    CHECK(cuModuleLoad(&mod, argv[1]));
    CHECK(cuModuleGetFunction(&set, mod, "vgpu_test_set_global"));
    CHECK(cuModuleGetFunction(&copy, mod, "vgpu_test_copy_u32"));
    CHECK(cuModuleGetGlobal(&g, &size, mod, "vgpu_test_counter"));
    if (size != 4) {
        fprintf(stderr, "global of %zu bytes, expected 4\n", size);
        return 1;
    }
    CHECK(cuMemAlloc(&out, 4));
    void *p1[] = {&v};
    CHECK(cuLaunchKernel(set, 1, 1, 1, 1, 1, 1, 0, 0, p1, 0));
    void *p2[] = {&out, &g, &one};
    CHECK(cuLaunchKernel(copy, 1, 1, 1, 32, 1, 1, 0, 0, p2, 0));
    CHECK(cuMemcpyDtoH(&got, out, 4));
    if (got != v) {
        fprintf(stderr, "global read back %#x, expected %#x\n", got, v);
        return 1;
    }
    /* The global itself, copied out at its address; then a new value copied in, which
     * the next kernel reads. */
    uint32_t direct = 0, w = v ^ 0x5a5a5a5au;
    CHECK(cuMemcpyDtoH(&direct, g, 4));
    if (direct != v) {
        fprintf(stderr, "global copied out %#x, expected %#x\n", direct, v);
        return 1;
    }
    CHECK(cuMemcpyHtoD(g, &w, 4));
    CHECK(cuLaunchKernel(copy, 1, 1, 1, 32, 1, 1, 0, 0, p2, 0));
    CHECK(cuMemcpyDtoH(&got, out, 4));
    if (got != w) {
        fprintf(stderr, "global copied in %#x, kernel read %#x\n", w, got);
        return 1;
    }

    CHECK(cuMemFree(out));
    CHECK(cuModuleUnload(mod));
    printf("device_global value=%u copied_in=%u\n", v, w);
    return 0;
}
