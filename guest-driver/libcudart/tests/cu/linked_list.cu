// A runtime-API program whose kernels store and follow pointers, as a user writes one:
// one kernel links nodes in device memory (each node's `next` is an address the kernel
// computed from the cudaMalloc'd pointer it was passed), another walks the list and sums
// it; the host checks the sum and reads one stored pointer back.
// usage: linked_list [NODES]
#include <cstdio>
#include <cstdlib>

struct Node {
    Node *next;
    long long value;
};

__global__ void link(Node *nodes, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        nodes[i].next = &nodes[(int)(((long long)i * 7 + 1) % n)];
        nodes[i].value = i;
    }
}

__global__ void walk(const Node *head, int steps, long long *out) {
    long long sum = 0;
    const Node *p = head;
    for (int k = 0; k < steps; k++) {
        sum += p->value;
        p = p->next;
    }
    *out = sum;
}

#define CK(x)                                                                         \
    do {                                                                              \
        cudaError_t e_ = (x);                                                         \
        if (e_ != cudaSuccess) {                                                      \
            fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                  \
            return 1;                                                                 \
        }                                                                             \
    } while (0)

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1 << 20;
    int steps = n;
    Node *nodes;
    long long *out;
    CK(cudaMalloc(&nodes, sizeof(Node) * n));
    CK(cudaMalloc(&out, sizeof(long long)));
    link<<<(n + 255) / 256, 256>>>(nodes, n);
    CK(cudaGetLastError());
    walk<<<1, 1>>>(nodes, steps, out);
    CK(cudaGetLastError());
    long long sum = 0;
    Node first;
    CK(cudaMemcpy(&sum, out, sizeof sum, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&first, nodes, sizeof first, cudaMemcpyDeviceToHost));
    long long want = 0;
    for (long long k = 0, i = 0; k < steps; k++) {
        want += i;
        i = (i * 7 + 1) % n;
    }
    if (sum != want || first.next != &nodes[1]) {
        fprintf(stderr, "sum %lld (expected %lld), node 0 -> %p (expected %p)\n", sum, want,
                (void *)first.next, (void *)&nodes[1]);
        return 1;
    }
    printf("linked_list n=%d sum=%lld\n", n, sum);
    return 0;
}
