/* Driver API: a module's __device__ global, set by one kernel and read by another.
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
    CHECK(cuMemFree(out));
    CHECK(cuModuleUnload(mod));
    printf("device_global value=%u\n", got);
    return 0;
}
