/* What every runtime test program does on an error: say which call failed and how. */
#ifndef VGPU_CUDART_CHECK_H
#define VGPU_CUDART_CHECK_H
#include <stdio.h>
#include <stdlib.h>
#include "cuda_runtime_subset.h"

#define CHECK(call)                                                                    \
    do {                                                                               \
        cudaError_t r_ = (call);                                                       \
        if (r_ != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,          \
                    cudaGetErrorName(r_), cudaGetErrorString(r_));                     \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)
#endif
