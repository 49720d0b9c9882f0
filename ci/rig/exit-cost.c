/* Exit costs as an L2 guest sees them, on the vgpu virtio-pci function of vgpu-vmm.
 *
 *   exit-cost PCI_SYSFS_DIR [N]
 *
 * Maps BAR0 (resource0) and the shared-memory BAR (resource2) of the function and times
 *   - mmio_read:  a 32-bit read of device configuration space in BAR0, which KVM
 *                 cannot serve: an exit to vgpu-vmm's vCPU thread and back;
 *   - doorbell:   a 16-bit write to queue 1's doorbell, which vgpu-vmm registered as an
 *                 ioeventfd: KVM signals an eventfd and resumes the guest, no userspace;
 *   - pio_read:   an `inl` from the PCI configuration data port (0xCFC), a port-I/O exit
 *                 to vgpu-vmm;
 *   - shm_read:   a 32-bit read of the shared-memory BAR, which is a memslot: no exit.
 * and prints "EXIT-COST name=<ns per op> ..." on one line. Static build:
 *   gcc -O2 -static -o exit-cost exit-cost.c
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/io.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define DEVICE_CFG_OFFSET 0x2000
#define NOTIFY_OFFSET 0x3000
#define NOTIFY_MULTIPLIER 4

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static volatile uint8_t *map_bar(const char *dir, int bar, size_t len) {
    char path[512];
    snprintf(path, sizeof path, "%s/resource%d", dir, bar);
    int fd = open(path, O_RDWR | O_SYNC);
    if (fd < 0) {
        perror(path);
        exit(2);
    }
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(2);
    }
    close(fd);
    return p;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s PCI_SYSFS_DIR [N]\n", argv[0]);
        return 2;
    }
    long n = argc > 2 ? atol(argv[2]) : 2000;
    volatile uint8_t *bar0 = map_bar(argv[1], 0, 0x4000);
    volatile uint8_t *shm = map_bar(argv[1], 2, 0x1000);
    if (iopl(3) != 0) {
        perror("iopl");
        return 2;
    }
    uint32_t sink = 0;
    double t0, mmio, bell, pio, mem;

    t0 = now_ns();
    for (long i = 0; i < n; i++)
        sink += *(volatile uint32_t *)(bar0 + DEVICE_CFG_OFFSET);
    mmio = (now_ns() - t0) / n;

    t0 = now_ns();
    for (long i = 0; i < n; i++)
        *(volatile uint16_t *)(bar0 + NOTIFY_OFFSET + 1 * NOTIFY_MULTIPLIER) = 1;
    bell = (now_ns() - t0) / n;

    t0 = now_ns();
    for (long i = 0; i < n; i++) {
        outl(0x80000000u, 0xcf8);
        sink += inl(0xcfc);
    }
    /* Two port exits per iteration. */
    pio = (now_ns() - t0) / n / 2;

    t0 = now_ns();
    for (long i = 0; i < n * 100; i++)
        sink += *(volatile uint32_t *)(shm + (i & 0x3ff) * 4);
    mem = (now_ns() - t0) / (n * 100);

    printf("EXIT-COST n=%ld mmio_read_ns=%.0f doorbell_ioeventfd_ns=%.0f pio_ns=%.0f "
           "shm_read_ns=%.1f sink=%u\n",
           n, mmio, bell, pio, mem, sink & 1);
    return 0;
}
