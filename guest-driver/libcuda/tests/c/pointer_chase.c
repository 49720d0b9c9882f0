/* Identity addressing: a kernel follows pointers stored in device memory. A linked
 * list is laid out over two allocations, nodes in a shuffled order, each node's next
 * pointer the device address cuMemAlloc returned plus an offset, as a user builds it;
 * one thread walks it and sums the nodes' values. A second walk starts from a copy of
 * the head the GPU made (cuMemcpyDtoD): pointers copied on the device stay valid. A
 * third walks a list whose every node is a cuMemAlloc of its own.
 * usage: pointer_chase MODULE.ptx [NODES] */
#include <stdint.h>
#include <string.h>
#include "check.h"

struct node {
    uint64_t next;
    uint32_t value;
    uint32_t pad;
};

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODULE.ptx [NODES]\n", argv[0]);
        return 2;
    }
    unsigned int n = argc > 2 ? (unsigned int)strtoul(argv[2], 0, 0) : 1u << 16;
    /* Two allocations of 2 MiB pages at least: where guest addresses are the device's. */
    size_t half = ((size_t)n * sizeof(struct node) + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    unsigned int per = (unsigned int)(half / sizeof(struct node));
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction chase;
    CUdeviceptr pool[2], out;

    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate(&ctx, 0, dev));
    CHECK(cuModuleLoad(&mod, argv[1]));
    CHECK(cuModuleGetFunction(&chase, mod, "vgpu_test_chase"));
    CHECK(cuMemAlloc(&pool[0], half));
    CHECK(cuMemAlloc(&pool[1], half));
    CHECK(cuMemAlloc(&out, 4));

    /* Node k of the walk lives in pool k % 2 at a shuffled index. */
    unsigned int *slot = malloc(sizeof *slot * n);
    for (unsigned int i = 0; i < n; i++)
        slot[i] = i;
    uint32_t seed = 12345;
    for (unsigned int i = n - 1; i > 0; i--) {
        seed = seed * 1664525u + 1013904223u;
        unsigned int j = seed % (i + 1), t = slot[i];
        slot[i] = slot[j];
        slot[j] = t;
    }
    struct node *host[2] = {calloc(per, sizeof(struct node)), calloc(per, sizeof(struct node))};
    uint32_t want = 0;
    for (unsigned int k = 0; k < n; k++) {
        struct node *nd = &host[k % 2][slot[k] % per];
        unsigned int nk = (k + 1) % n;
        nd->next = pool[nk % 2] + (uint64_t)(slot[nk] % per) * sizeof(struct node);
        nd->value = k * 2654435761u;
        want += nd->value;
    }
    CHECK(cuMemcpyHtoD(pool[0], host[0], half));
    CHECK(cuMemcpyHtoD(pool[1], host[1], half));
    CUdeviceptr head = pool[0] + (uint64_t)(slot[0] % per) * sizeof(struct node);
    void *params[] = {&head, &out, &n};
    CHECK(cuLaunchKernel(chase, 1, 1, 1, 1, 1, 1, 0, 0, params, 0));
    CHECK(cuCtxSynchronize());
    uint32_t got = 0;
    CHECK(cuMemcpyDtoH(&got, out, 4));
    if (got != want) {
        fprintf(stderr, "walk of %u nodes: sum %#x, expected %#x\n", n, got, want);
        return 1;
    }
    /* A device-to-device copy of the first pool: its copy of the head holds the same
     * pointer, so a walk starting there reads the copy once, then the originals. */
    CUdeviceptr copy;
    CHECK(cuMemAlloc(&copy, half));
    CHECK(cuMemcpyDtoD(copy, pool[0], half));
    CUdeviceptr head2 = copy + (head - pool[0]);
    void *params2[] = {&head2, &out, &n};
    CHECK(cuLaunchKernel(chase, 1, 1, 1, 1, 1, 1, 0, 0, params2, 0));
    CHECK(cuCtxSynchronize());
    uint32_t again = 0;
    CHECK(cuMemcpyDtoH(&again, out, 4));
    if (again != want) {
        fprintf(stderr, "walk from the copy: sum %#x, expected %#x\n", again, want);
        return 1;
    }
    /* A textbook list: every node its own cuMemAlloc of 16 bytes. */
    unsigned int m = 300;
    CUdeviceptr *own = malloc(sizeof *own * m);
    for (unsigned int i = 0; i < m; i++)
        CHECK(cuMemAlloc(&own[i], sizeof(struct node)));
    uint32_t want3 = 0;
    for (unsigned int i = 0; i < m; i++) {
        struct node nd = {own[(i + 1) % m], i * 3 + 1, 0};
        CHECK(cuMemcpyHtoD(own[i], &nd, sizeof nd));
        want3 += nd.value;
    }
    void *params3[] = {&own[0], &out, &m};
    CHECK(cuLaunchKernel(chase, 1, 1, 1, 1, 1, 1, 0, 0, params3, 0));
    CHECK(cuCtxSynchronize());
    uint32_t small = 0;
    CHECK(cuMemcpyDtoH(&small, out, 4));
    if (small != want3) {
        fprintf(stderr, "walk of %u small nodes: sum %#x, expected %#x\n", m, small, want3);
        return 1;
    }
    for (unsigned int i = 0; i < m; i++)
        CHECK(cuMemFree(own[i]));
    printf("pointer_chase nodes=%u sum=%#x small=%u\n", n, got, m);
    return 0;
}
