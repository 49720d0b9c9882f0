#!/usr/bin/env python3
"""Drives QEMU guests against vgpu-backend for ci/qemu/guest-test.sh.

One backend serves the VMs: `qemu` (a Linux guest under QEMU, TCG, whose generic
vhost-user device has no shared-memory region (shmem=off), so vgpu.ko runs forwarded; with
--expect-mode direct it has the region and runs direct), `loop` (a loopback VM in direct
mode, `vgpu-throttle --loopback` on the host) and, with --expect-mode direct, `fwd` (a
second QEMU guest, forwarded). Steps, each printing "QG-STEP <name> ok|FAIL ...":

  boot       the guests boot, vgpu.ko binds, /sys/class/misc/vgpu/submission and the API
             say the expected mode
  checks     the rig's guest checks (smoke, two processes, hostile, VRAM swap under CPU
             stores through the aperture (direct only: the loopback VM takes VRAM
             meanwhile; chunks must have moved, none failed, no store lost, and QEMU's
             guest-error log shows no rejected access to the region's mappings),
             killed process, quick bench, a clean backend) in the `qemu` guest
  bench      (--bench) vgpu-guest-bench --submit-only in each QEMU guest in turn:
             "QG-BENCH vm=... mode=..." lines with round trips and the submission rate
  fair       every VM saturates the GPU (guests: 1 ms kernels, 32 in flight; the loopback
             VM: 5 ms kernels, 8 in flight); each VM's share in the API's 10 s window stays
             within 3 pp of its entitlement (weighted max-min, equal weights). In direct
             mode, after the samples, the operator's pause shadows every channel of the
             `qemu` guest (SHMEM_MAPs over its slots in QEMU's BAR): the GPU must run
             nothing of it for 3 s while its throttle keeps storing GP_PUT, and run it
             again after the resume; no shadow switch (the scheduler's either) may fail
  reload     rmmod + insmod vgpu.ko in `qemu` (device reset: the backend must log a
             RESET_DEVICE, patch 0006's get_vhost); smoke
  reboot     QMP system_reset while a guest process holds GPU objects; after the reboot
             the backend holds none of them (RESET_DEVICE freed them) and vgpu-smoke passes
  restart    while a guest process keeps the GPU busy, the backend is killed and started
             again; QEMU reconnects (reconnect-ms), the busy process ends with an error
             (its GPU state is gone) instead of hanging, and a new process passes
             vgpu-smoke in the expected mode

Exit status 0 iff every step passed. Everything the guests print goes to the log files.
"""
import argparse
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time


def log(msg):
    print(f"guest-test: {msg}", file=sys.stderr, flush=True)


def dump_tail(name, path, lines):
    """Prints the last `lines` lines of a log, for a failure's report."""
    try:
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
    except OSError as e:
        log(f"no {name} log: {e}")
        return
    print(f"==== {name} log ({path}, last {len(tail)} lines)", flush=True)
    for line in tail:
        print(f"  {line}", flush=True)


class Guest:
    """QEMU with the guest's serial console on stdin/stdout."""

    def __init__(self, cmd, logfile):
        self.lines = queue.Queue()
        self.log = open(logfile, "a", buffering=1)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\r\n")
            self.log.write(line + "\n")
            self.lines.put(line)
        self.lines.put(None)

    def send(self, line):
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def expect(self, prefix, timeout):
        """The first console line starting with `prefix` (None on timeout or exit);
        also returns every line seen meanwhile."""
        seen = []
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None, seen
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None, seen
            if line is None:
                return None, seen
            seen.append(line)
            if line.startswith(prefix):
                return line, seen

    def run(self, cmd, timeout):
        """Sends a guest command; its rc (None if it never ended) and its output."""
        self.send(cmd)
        word = cmd.split()[0]
        line, seen = self.expect(f"QG-END {word} rc=", timeout)
        if line is None:
            return None, seen
        return int(line.rsplit("=", 1)[1]), seen

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def qmp(path, command):
    """One QMP command on a fresh connection; its reply."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    f = s.makefile("rwb", buffering=0)
    json.loads(f.readline())  # greeting
    f.write(b'{"execute": "qmp_capabilities"}\n')
    json.loads(f.readline())
    f.write(json.dumps({"execute": command}).encode() + b"\n")
    while True:
        r = json.loads(f.readline())
        if "return" in r or "error" in r:
            s.close()
            return r


class Backend:
    def __init__(self, binary, work, logfile, vms):
        # 256 MiB of VRAM, a VRAM quota of 128 MiB and 256 MiB of swap per VM: the
        # guest checks' swap run (160 MiB of pressure beside a 16 MiB buffer the CPU
        # stores into through the aperture) then really moves chunks.
        self.cmd = [binary, "--socket-dir", work, "--api-socket", os.path.join(work, "api.sock"),
                    "--vram-mib", "256", "--vm-vram-mib", "128", "--vm-swap-mib", "256"]
        for vm in vms:
            self.cmd += ["--vm", vm]
        self.logfile = logfile
        self.proc = None

    def start(self):
        out = open(self.logfile, "a")
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"))
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def device_resets(self, vm):
        """How many RESET_DEVICEs of `vm` the backend logged (every run of it so far)."""
        try:
            with open(self.logfile, errors="replace") as f:
                return sum(1 for line in f if f"VM {vm}: device reset" in line)
        except OSError:
            return 0


def vgpuctl(args, api, *cmd):
    r = subprocess.run([args.vgpuctl, "--socket", api, "--json", *cmd],
                       capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        raise RuntimeError(f"vgpuctl {' '.join(cmd)}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def wait_until(pred, timeout, step=0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return True
        except Exception:
            pass
        time.sleep(step)
    return False


def qemu_command(args, work, name, shmem):
    """The QEMU command line of guest `name` on the backend's socket `<name>.sock`;
    `shmem` False adds shmem=off (patch 0006's property: no region, forwarded)."""
    cpu = "host" if args.accel == "kvm" else "max"
    return [
        args.qemu, "-accel", args.accel, "-cpu", cpu, "-smp", "1", "-m", f"{args.mem_mib}M",
        "-machine", "pc,memory-backend=mem",
        "-object", f"memory-backend-memfd,id=mem,size={args.mem_mib}M,share=on",
        "-nodefaults", "-display", "none", "-serial", "stdio", "-monitor", "none",
        "-qmp", f"unix:{work}/{name}-qmp.sock,server=on,wait=off",
        # Guest errors (accesses QEMU rejects) to a file of their own: the checks step
        # looks there for accesses to the shared-memory region's mappings.
        "-d", "guest_errors,invalid_mem", "-D", f"{work}/{name}-guest-errors.log",
        "-L", "/usr/share/seabios", "-L", "/usr/share/qemu",
        "-kernel", args.kernel, "-initrd", args.initrd,
        "-append", "console=ttyS0 quiet panic=-1 reboot=k",
        "-chardev", f"socket,id=c0,path={work}/{name}.sock,reconnect-ms=500",
        "-device", f"{args.device},chardev=c0,virtio-id=60,num_vqs=2,vq_size=256,config_size=32"
        # Our QEMU negotiates vhost-user shared memory unless told not to (a QEMU 11.1
        # has no such property and always does).
        + ("" if shmem else ",shmem=off"),
    ]


def rejected_shmem_accesses(work, name):
    """Accesses of guest `name` that QEMU rejected on a mapping of the shared-memory
    region (e.g. a store dispatched through a stale TLB entry to a RAM mapping, which
    QEMU drops in silence but for this log)."""
    try:
        with open(os.path.join(work, f"{name}-guest-errors.log"), errors="replace") as f:
            return [l.strip() for l in f if "virtio-shmem" in l and "Invalid" in l]
    except FileNotFoundError:
        return []


def boot(guest, args, api, vm, mode, t0):
    """Waits for `vm`'s guest to report its device; (ok, detail, console lines)."""
    line, seen = guest.expect("QG-BOOT", 600)
    boot_s = time.monotonic() - t0
    ok = line is not None and f"submission={mode}" in line
    ready, _ = guest.expect("QG-READY", 60)
    api_mode = None
    try:
        api_mode = vgpuctl(args, api, "vm", "show", vm).get("submission")
    except Exception as e:
        log(f"vgpuctl: {e}")
    ok = ok and ready is not None and api_mode == mode
    return ok, f"{vm}: boot_s={boot_s:.1f} guest=[{line}] api={api_mode}", seen


def usage(args, api, vm):
    """The VM's GPU objects in the backend: (contexts, channels, VRAM bytes)."""
    u = vgpuctl(args, api, "vm", "show", vm)["usage"]
    return u["contexts"], u["channels"], u["vram_bytes"]


def bench_figures(out):
    """{figure name: value} of the vgpu-guest-bench --json lines in `out`."""
    figs = {}
    for line in out:
        if line.startswith("{"):
            try:
                f = json.loads(line)
                figs[f["name"]] = f["value"]
            except (ValueError, KeyError):
                pass
    return figs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qemu", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--initrd", required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--vgpuctl", required=True)
    ap.add_argument("--throttle", required=True, help="host vgpu-throttle with --loopback")
    ap.add_argument("--smoke", help="host vgpu-smoke with --loopback: VRAM pressure from the"
                    " loopback VM during the guest checks (direct mode)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--fair-secs", type=int, default=40)
    ap.add_argument("--mem-mib", type=int, default=512)
    ap.add_argument("--accel", choices=["tcg", "kvm"], default="tcg",
                    help="kvm only where /dev/kvm runs a Linux guest (not the dev machines)")
    ap.add_argument("--expect-mode", choices=["forwarded", "direct"], default="forwarded",
                    help="the submission mode the device must show (direct: a QEMU with SHMEM;"
                    " a second QEMU guest, forwarded, then joins the fairness run)")
    ap.add_argument("--bench", action="store_true",
                    help="also run vgpu-guest-bench --submit-only in each QEMU guest, one"
                    " after the other (QG-BENCH lines)")
    args = ap.parse_args()
    # A killed test still stops its guests and backend (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))

    work = args.work
    api = os.path.join(work, "api.sock")
    direct = args.expect_mode == "direct"
    results = {}

    def step(name, ok, detail=""):
        results[name] = ok
        print(f"QG-STEP {name} {'ok' if ok else 'FAIL'} {detail}".rstrip(), flush=True)

    # `qemu`: the guest under test; `fwd`: (direct mode) a forwarded QEMU guest beside
    # it; `loop`: a loopback VM in direct mode driven from the host.
    vms = ["qemu", "loop"] + (["fwd"] if direct else [])
    backend = Backend(args.backend, work, os.path.join(work, "backend.log"), vms)
    backend.start()
    if not wait_until(lambda: os.path.exists(os.path.join(work, "qemu.sock")), 20):
        step("boot", False, "the backend did not listen")
        return 1
    guest = Guest(qemu_command(args, work, "qemu", direct), args.log)
    fwd = Guest(qemu_command(args, work, "fwd", False), args.log + ".fwd") if direct else None
    guests = [("qemu", guest, args.expect_mode)] + ([("fwd", fwd, "forwarded")] if fwd else [])
    t0 = time.monotonic()
    try:
        # ---- boot ---------------------------------------------------------------
        ok, details = True, []
        for vm, g, mode in guests:
            o, d, seen = boot(g, args, api, vm, mode, t0)
            ok, details = ok and o, details + [d]
            if not o:
                log("\n".join(seen[-30:]))
        step("boot", ok, " ".join(details))
        if not ok:
            return 1

        # ---- checks -------------------------------------------------------------
        t = time.monotonic()
        vram0 = vgpuctl(args, api, "vm", "vram", "qemu")
        # The loopback VM wants VRAM too meanwhile (its own swap run), so the VRAM
        # manager shrinks the guest's share and moves its buffer's chunks while the
        # guest's CPU stores into them through the aperture.
        pressure = None
        if direct and args.smoke:
            pressure = subprocess.Popen(
                [args.smoke, "--loopback", os.path.join(work, "loop.sock"), "--swap", "60",
                 "--swap-buffer-mib", "16", "--swap-pressure-mib", "160"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        rc, out = guest.run("checks", 900)
        vram1 = vgpuctl(args, api, "vm", "vram", "qemu")
        if pressure:
            pressure.kill()
            pout = pressure.communicate()[0].strip().splitlines()
            log(f"host VRAM pressure: {pout[-3:]}")
        failed = [l for l in out if "L2-GUEST-CHECK FAIL" in l]
        swap = next((l for l in out if "swap_cpu_stores" in l), "")
        moved = {k: vram1[k] - vram0[k] for k in ("evictions", "swap_ins", "move_failures")}
        rejected = rejected_shmem_accesses(work, "qemu")
        if rejected:
            log(f"QEMU rejected {len(rejected)} accesses to the region's mappings: "
                + "\n".join(rejected[:20]))
        ok = rc == 0
        if direct:
            # The swap check ran with the aperture: chunks must have moved under its
            # stores (read-only views through SHMEM_MAP, patch 0007), none failed, no
            # store was lost and QEMU rejected no access to the region's mappings (what
            # an access through a stale TLB entry came to before 0007's fix).
            ok = ok and moved["evictions"] > 0 and moved["move_failures"] == 0 \
                and not rejected
        step("checks", ok, f"secs={time.monotonic() - t:.0f} failed={failed} [{swap}] vram={moved} "
             f"rejected={len(rejected)}")
        if rc != 0:
            log("\n".join(out[-40:]))

        # ---- bench --------------------------------------------------------------
        if args.bench:
            ok = True
            for vm, g, mode in guests:
                rc, out = g.run("bench", 600)
                figs = bench_figures(out)
                ok = ok and rc == 0 and bool(figs)
                print(f"QG-BENCH vm={vm} mode={mode} accel={args.accel} rc={rc} "
                      + " ".join(f"{k}={v:.2f}" for k, v in sorted(figs.items())), flush=True)
            step("bench", ok)

        # ---- fair ---------------------------------------------------------------
        secs = args.fair_secs
        sh0 = vgpuctl(args, api, "vm", "show", "qemu")["shadow"]
        host_load = subprocess.Popen(
            [args.throttle, "--loopback", os.path.join(work, "loop.sock"),
             "--kernel-us", "5000", "--depth", "8", "--duration", str(secs + 25)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _, g, _ in guests:
            g.send(f"throttle {secs + 25}")
        time.sleep(min(15, secs // 2))
        samples = []
        end = time.monotonic() + secs - 15
        while time.monotonic() < end:
            time.sleep(3)
            try:
                row = {}
                for vm in vms:
                    st = vgpuctl(args, api, "vm", "stats", vm)
                    w = next(x for x in st["windows"] if x["window_s"] == 10)
                    row[vm] = (w["share"], w.get("entitled"), w.get("deviation_pp"))
                samples.append(row)
                log(f"fair sample {row}")
            except Exception as e:
                log(f"fair sample failed: {e}")
        held = None
        if direct:
            # The operator's pause shadows every channel of the VM (a shadow page mapped
            # over each slot in QEMU's BAR): the guest keeps storing GP_PUT, into the
            # shadow pages, and the GPU must run none of it until the resume.
            busy = lambda: vgpuctl(args, api, "vm", "stats", "qemu")["gpu_busy_ns"]
            try:
                vgpuctl(args, api, "vm", "pause", "qemu")
                time.sleep(3)  # kernels already fetched finish; busy time is booked
                shadowed = vgpuctl(args, api, "vm", "show", "qemu")["shadow"]["shadowed_now"]
                b0 = busy()
                time.sleep(3)
                b1 = busy()
                vgpuctl(args, api, "vm", "resume", "qemu")
                time.sleep(3)
                b2 = busy()
                held = (shadowed, b1 - b0, b2 - b1)
            except Exception as e:
                log(f"pause check: {e}")
        guest_lines = []
        for _, g, _ in guests:
            _, out = g.expect("QG-END throttle rc=", secs + 120)
            guest_lines.append(next((l for l in out if l.startswith("VGPU-THROTTLE")), ""))
        host_out = host_load.communicate(timeout=120)[0]
        devs = [abs(s[vm][2]) for s in samples for vm in vms if s[vm][2] is not None]
        shares = {vm: sum(s[vm][0] for s in samples) / len(samples) if samples else None
                  for vm in vms}
        worst = max(devs) if devs else None
        fair_ok = worst is not None and worst <= 3.0 and len(samples) >= 3
        # The scheduler holds a direct channel back by shadowing it: a SHMEM_MAP of a
        # shadow page over the slot in QEMU's BAR, and the real page mapped back later.
        sh1 = vgpuctl(args, api, "vm", "show", "qemu")["shadow"]
        shadows = sh1["shadows"] - sh0["shadows"]
        if direct:
            fair_ok = fair_ok and held is not None and held[0] > 0 and held[1] == 0 \
                and held[2] > 0 and sh1["failures"] == sh0["failures"]
        step("fair", fair_ok,
             f"samples={len(samples)} worst_deviation_pp={worst} mean_shares="
             + ",".join(f"{vm}:{v:.3f}" for vm, v in shares.items() if v is not None)
             + f" qemu_shadows={shadows} qemu_unshadows={sh1['unshadows'] - sh0['unshadows']}"
             f" shadow_failures={sh1['failures'] - sh0['failures']}"
             + (f" paused=(shadowed={held[0]} busy_ns_while_paused={held[1]}"
                f" busy_ns_after_resume={held[2]})" if held else "")
             + f" guests={guest_lines}"
             f" host=[{host_out.strip().splitlines()[-1] if host_out.strip() else ''}]")

        # ---- reload -------------------------------------------------------------
        t = time.monotonic()
        resets = backend.device_resets("qemu")
        rc, out = guest.run("reload", 600)
        reloaded = next((l for l in out if l.startswith("QG-RELOADED")), "")
        new_resets = backend.device_resets("qemu") - resets
        step("reload", rc == 0 and f"submission={args.expect_mode}" in reloaded
             and new_resets >= 1,
             f"secs={time.monotonic() - t:.0f} rc={rc} device_resets={new_resets}"
             f" guest=[{reloaded}]")

        # ---- reboot -------------------------------------------------------------
        # With a process's GPU objects alive: the reset must free them (RESET_DEVICE),
        # not leave them to the next disconnect.
        guest.send("throttle 120")
        held = wait_until(lambda: usage(args, api, "qemu")[1] > 0, 60)
        resets = backend.device_resets("qemu")
        r = qmp(os.path.join(work, "qemu-qmp.sock"), "system_reset")
        t = time.monotonic()
        line, _ = guest.expect("QG-READY", 600)
        left = None
        try:
            left = usage(args, api, "qemu")
        except Exception as e:
            log(f"vgpuctl: {e}")
        new_resets = backend.device_resets("qemu") - resets
        rc, out = guest.run("smoke", 600) if line else (None, [])
        step("reboot", line is not None and rc == 0 and held and left == (0, 0, 0)
             and new_resets >= 1,
             f"qmp={'ok' if 'return' in r else r} objects_before={held}"
             f" objects_after={left} device_resets={new_resets}"
             f" reboot_s={time.monotonic() - t:.1f} smoke_rc={rc}")

        # ---- restart ------------------------------------------------------------
        guest.send("throttle 120")
        time.sleep(5)
        backend.kill()
        time.sleep(2)
        backend.start()
        t = time.monotonic()
        # The busy process must end (with an error: its GPU objects died with the
        # backend) long before its 120 s are up.
        end_line, _ = guest.expect("QG-END throttle rc=", 100)
        busy_end_s = time.monotonic() - t
        busy_rc = int(end_line.rsplit("=", 1)[1]) if end_line else None
        connected = wait_until(
            lambda: all(vgpuctl(args, api, "vm", "show", vm).get("connected")
                        for vm, _, _ in guests), 60)
        # The driver notices the lost backend (its requests time out or the device asks
        # for a reset) and starts the device over; a new process then works.
        rc = None
        for _ in range(3):
            rc, out = guest.run("smoke", 90)
            if rc == 0:
                break
            time.sleep(5)
        mode = None
        try:
            mode = vgpuctl(args, api, "vm", "show", "qemu").get("submission")
        except Exception as e:
            log(f"vgpuctl: {e}")
        step("restart", connected and busy_rc not in (None, 0) and rc == 0
             and mode == args.expect_mode,
             f"reconnected={connected} busy_process_rc={busy_rc} ended_after_s={busy_end_s:.0f}"
             f" secs={time.monotonic() - t:.0f} smoke_rc={rc} api={mode}")
        for _, g, _ in guests:
            g.run("halt", 30)
    finally:
        for _, g, _ in guests:
            g.stop()
        backend.kill()
    names = ["boot", "checks"] + (["bench"] if args.bench else []) \
        + ["fair", "reload", "reboot", "restart"]
    ok = all(results.get(s) for s in names)
    if not ok:
        # The logs stay in the work directory, which CI does not keep: print their tails.
        for name, path in (("backend", os.path.join(work, "backend.log")),
                           ("guest console", args.log)) \
                + ((("forwarded guest console", args.log + ".fwd"),) if direct else ()):
            dump_tail(name, path, 60)
    print(f"QG-RESULT {'ok' if ok else 'FAIL'} " +
          " ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in results.items()) +
          f" total_s={time.monotonic() - t0:.0f}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
