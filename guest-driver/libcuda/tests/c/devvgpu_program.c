/* Driver API without modules, for a real guest over /dev/vgpu (the nested rig runs it in
 * L2 against the sim GPU): the device, memory, copies, sets, pinned memory, two streams
 * and events; then a module load, which a GPU that runs no guest modules refuses.
 * usage: devvgpu_program   (prints "devvgpu_program ok module_load=<the load's result>") */
#include <stdint.h>
#include <string.h>
#include "check.h"

#define N (256u * 1024u)

int main(void) {
    size_t bytes = (size_t)N * 4, total;
    char name[128];
    int warp;
    CUdeviceptr a, b;
    CUstream s[2];
    CUevent start, stop;
    CUmodule mod;
    uint32_t *h, *pinned;

    setup();
    CHECK(cuDeviceGetName(name, sizeof name, 0));
    CHECK(cuDeviceTotalMem(&total, 0));
    CHECK(cuDeviceGetAttribute(&warp, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0));
    fprintf(stderr, "%s, %zu MiB, warp %d\n", name, total >> 20, warp);
    h = malloc(bytes);
    for (uint32_t i = 0; i < N; i++)
        h[i] = i * 2654435761u;
    CHECK(cuMemAlloc(&a, bytes));
    CHECK(cuMemAlloc(&b, bytes));
    CHECK(cuMemAllocHost((void **)&pinned, bytes));
    /* Copies both ways and device to device. */
    CHECK(cuMemcpyHtoD(a, h, bytes));
    CHECK(cuMemcpyDtoD(b, a, bytes));
    memset(pinned, 0, bytes);
    CHECK(cuMemcpyDtoH(pinned, b, bytes));
    if (memcmp(pinned, h, bytes) != 0) {
        fprintf(stderr, "a device-to-device copy came back different\n");
        return 1;
    }
    /* Sets. */
    CHECK(cuMemsetD32(a, 0x01020304u, N));
    CHECK(cuMemsetD8(b + bytes / 2, 0x7f, bytes / 2));
    CHECK(cuMemcpyDtoH(h, a, bytes));
    CHECK(cuMemcpyDtoH(pinned, b, bytes));
    if (h[N - 1] != 0x01020304u || pinned[N - 1] != 0x7f7f7f7fu ||
        pinned[0] != 0u * 2654435761u || pinned[1] != 2654435761u) {
        fprintf(stderr, "sets came back wrong\n");
        return 1;
    }
    /* Two streams: stream 1 waits for stream 0's event before it copies a into b. */
    CHECK(cuStreamCreate(&s[0], 0));
    CHECK(cuStreamCreate(&s[1], CU_STREAM_NON_BLOCKING));
    CHECK(cuEventCreate(&start, CU_EVENT_DEFAULT));
    CHECK(cuEventCreate(&stop, CU_EVENT_DEFAULT));
    for (uint32_t i = 0; i < N; i++)
        pinned[i] = ~i;
    CHECK(cuEventRecord(start, s[0]));
    CHECK(cuMemcpyHtoDAsync(a, pinned, bytes, s[0]));
    CHECK(cuEventRecord(stop, s[0]));
    CHECK(cuStreamWaitEvent(s[1], stop, 0));
    CHECK(cuMemcpyDtoDAsync(b, a, bytes, s[1]));
    CHECK(cuStreamSynchronize(s[1]));
    CHECK(cuEventSynchronize(stop));
    float ms = -1;
    CHECK(cuEventElapsedTime(&ms, start, stop));
    CHECK(cuMemcpyDtoH(h, b, bytes));
    for (uint32_t i = 0; i < N; i++)
        if (h[i] != ~i) {
            fprintf(stderr, "stream copy: b[%u] = %#x\n", i, h[i]);
            return 1;
        }
    if (!(ms >= 0.0f)) {
        fprintf(stderr, "elapsed %f ms\n", ms);
        return 1;
    }
    /* A module: a GPU that runs no guest modules says so. */
    CUresult r = cuModuleLoadData(&mod, ".version 8.0\n.target sm_90\n.address_size 64\n");
    CHECK(cuEventDestroy(start));
    CHECK(cuEventDestroy(stop));
    CHECK(cuStreamDestroy(s[0]));
    CHECK(cuStreamDestroy(s[1]));
    CHECK(cuMemFreeHost(pinned));
    CHECK(cuMemFree(a));
    CHECK(cuMemFree(b));
    printf("devvgpu_program ok module_load=%s\n", err_name(r));
    return 0;
}
