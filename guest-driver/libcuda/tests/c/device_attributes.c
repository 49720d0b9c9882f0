/* Driver API: the device as a program sizes its work by. Prints the compute capability,
 * then every attribute 1..LAST as "attr N=VALUE" (or "=unsupported"), one per line, so
 * two runs (NVIDIA's library and vgpu's) can be compared line by line.
 * usage: device_attributes [LAST] */
#include "check.h"

int main(int argc, char **argv) {
    int last = argc > 1 ? atoi(argv[1]) : 147;
    CUdevice dev;
    int major = -1, minor = -1;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CUresult r = cuDeviceComputeCapability(&major, &minor, dev);
    if (r == CUDA_SUCCESS)
        printf("cc=%d.%d\n", major, minor);
    else if (r == CUDA_ERROR_NOT_SUPPORTED)
        printf("cc=unsupported\n");
    else
        CHECK(r);
    for (int a = 1; a <= last; a++) {
        int v = 0;
        r = cuDeviceGetAttribute(&v, a, dev);
        if (r == CUDA_SUCCESS)
            printf("attr %d=%d\n", a, v);
        else if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_INVALID_VALUE)
            printf("attr %d=unsupported\n", a);
        else
            CHECK(r);
    }
    return 0;
}
