/* Smallest possible proof that /dev/kvm in L1 runs guests: a real-mode L2 that writes
 * 42 to port 0x10 and halts. Build static, add to the rig, run it:
 *   gcc -O2 -static -o /tmp/kvm-smoke ci/rig/kvm-smoke.c
 *   ci/rig/run-l1.sh --add /tmp/kvm-smoke:/bin/kvm-smoke --cmd kvm-smoke
 */
#include <fcntl.h>
#include <linux/kvm.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>

#define CHECK(x) do { if ((x) < 0) { perror(#x); return 1; } } while (0)

int main(void) {
    /* mov al, 42; out 0x10, al; hlt */
    static const uint8_t code[] = {0xb0, 42, 0xe6, 0x10, 0xf4};
    int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
    CHECK(kvm);
    printf("KVM_GET_API_VERSION=%d\n", ioctl(kvm, KVM_GET_API_VERSION, 0));
    int vm = ioctl(kvm, KVM_CREATE_VM, 0);
    CHECK(vm);
    uint8_t *mem = mmap(NULL, 0x1000, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) { perror("mmap"); return 1; }
    memcpy(mem, code, sizeof(code));
    struct kvm_userspace_memory_region region = {
        .slot = 0, .guest_phys_addr = 0x1000, .memory_size = 0x1000,
        .userspace_addr = (uint64_t)(uintptr_t)mem,
    };
    CHECK(ioctl(vm, KVM_SET_USER_MEMORY_REGION, &region));
    int vcpu = ioctl(vm, KVM_CREATE_VCPU, 0);
    CHECK(vcpu);
    int run_size = ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
    CHECK(run_size);
    struct kvm_run *run = mmap(NULL, run_size, PROT_READ | PROT_WRITE, MAP_SHARED, vcpu, 0);
    if (run == MAP_FAILED) { perror("mmap run"); return 1; }
    struct kvm_sregs sregs;
    CHECK(ioctl(vcpu, KVM_GET_SREGS, &sregs));
    sregs.cs.base = 0; sregs.cs.selector = 0;
    CHECK(ioctl(vcpu, KVM_SET_SREGS, &sregs));
    struct kvm_regs regs = {.rip = 0x1000, .rflags = 2};
    CHECK(ioctl(vcpu, KVM_SET_REGS, &regs));
    int got_io = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        CHECK(ioctl(vcpu, KVM_RUN, 0));
        if (run->exit_reason == KVM_EXIT_IO && run->io.port == 0x10) {
            got_io = *((uint8_t *)run + run->io.data_offset);
            printf("L2 wrote %d to port 0x10\n", got_io);
        } else if (run->exit_reason == KVM_EXIT_HLT) {
            break;
        } else {
            printf("unexpected exit %u\n", run->exit_reason);
            return 1;
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("KVM-SMOKE %s (%.0f us)\n", got_io == 42 ? "OK" : "FAIL",
           (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3);
    return got_io == 42 ? 0 : 1;
}
