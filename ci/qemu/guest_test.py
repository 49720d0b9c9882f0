#!/usr/bin/env python3
"""Drives one QEMU guest against vgpu-backend for ci/qemu/guest-test.sh.

One backend serves two VMs: `qemu` (a Linux guest under QEMU with TCG, whose generic
vhost-user device has no shared-memory region (shmem=off; with --expect-mode direct it has
one), so vgpu.ko runs forwarded) and `loop` (a
loopback VM in direct mode, `vgpu-throttle --loopback` on the host). Steps, each one
printing "QG-STEP <name> ok|FAIL ...":

  boot       the guest boots, vgpu.ko binds, /sys/class/misc/vgpu/submission = forwarded,
             the API and vgpuctl say so too
  checks     the rig's guest checks (smoke, two processes, hostile, killed process, quick
             bench, a clean backend) in the guest
  fair       both VMs saturate the GPU, the guest with 1 ms kernels (32 in flight), the
             host's loopback VM with 5 ms kernels (8 in flight; the GPU's own arbitration
             would favour those); each VM's GPU share in the API's 10 s window stays
             within 3 pp of its entitlement (the scheduler's weighted max-min, 1:1 here)
  reload     rmmod + insmod vgpu.ko (device reset, vrings stopped and started); smoke
  reboot     QMP system_reset; the guest boots again and passes vgpu-smoke
  restart    while a guest process keeps the GPU busy, the backend is killed and started
             again; QEMU reconnects (reconnect-ms), the busy process ends with an error
             (its GPU state is gone) instead of hanging, and a new process passes
             vgpu-smoke

Exit status 0 iff every step passed. Everything the guest prints goes to the log file.
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
    def __init__(self, binary, work, logfile):
        self.cmd = [binary, "--socket-dir", work, "--vm", "qemu", "--vm", "loop",
                    "--api-socket", os.path.join(work, "api.sock")]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qemu", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--initrd", required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--vgpuctl", required=True)
    ap.add_argument("--throttle", required=True, help="host vgpu-throttle with --loopback")
    ap.add_argument("--work", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--fair-secs", type=int, default=40)
    ap.add_argument("--mem-mib", type=int, default=512)
    ap.add_argument("--expect-mode", choices=["forwarded", "direct"], default="forwarded",
                    help="the submission mode the device must show (direct: a QEMU with SHMEM)")
    args = ap.parse_args()

    work = args.work
    api = os.path.join(work, "api.sock")
    results = {}

    def step(name, ok, detail=""):
        results[name] = ok
        print(f"QG-STEP {name} {'ok' if ok else 'FAIL'} {detail}".rstrip(), flush=True)

    backend = Backend(args.backend, work, os.path.join(work, "backend.log"))
    backend.start()
    if not wait_until(lambda: os.path.exists(os.path.join(work, "qemu.sock")), 20):
        step("boot", False, "the backend did not listen")
        return 1
    qemu_cmd = [
        args.qemu, "-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", f"{args.mem_mib}M",
        "-machine", "pc,memory-backend=mem",
        "-object", f"memory-backend-memfd,id=mem,size={args.mem_mib}M,share=on",
        "-nodefaults", "-display", "none", "-serial", "stdio", "-monitor", "none",
        "-qmp", f"unix:{work}/qmp.sock,server=on,wait=off",
        "-L", "/usr/share/seabios", "-L", "/usr/share/qemu",
        "-kernel", args.kernel, "-initrd", args.initrd,
        "-append", "console=ttyS0 quiet panic=-1 reboot=k",
        "-chardev", f"socket,id=c0,path={work}/qemu.sock,reconnect-ms=500",
        "-device", f"{args.device},chardev=c0,virtio-id=60,num_vqs=2,vq_size=256,config_size=32"
        # Our QEMU negotiates vhost-user shared memory unless told not to (patch 0006's
        # property; a QEMU 11.1 has none and always does).
        + (",shmem=off" if args.expect_mode == "forwarded" else ""),
    ]
    guest = Guest(qemu_cmd, args.log)
    t0 = time.monotonic()
    try:
        # ---- boot ---------------------------------------------------------------
        line, seen = guest.expect("QG-BOOT", 300)
        boot_s = time.monotonic() - t0
        ok = line is not None and f"submission={args.expect_mode}" in line
        ready, _ = guest.expect("QG-READY", 60)
        api_mode = None
        try:
            api_mode = vgpuctl(args, api, "vm", "show", "qemu").get("submission")
        except Exception as e:
            log(f"vgpuctl: {e}")
        step("boot", ok and ready is not None and api_mode == args.expect_mode,
             f"boot_s={boot_s:.1f} guest=[{line}] api={api_mode}")
        if not results["boot"]:
            log("\n".join(seen[-30:]))
            return 1

        # ---- checks -------------------------------------------------------------
        t = time.monotonic()
        rc, out = guest.run("checks", 900)
        failed = [l for l in out if "L2-GUEST-CHECK FAIL" in l]
        step("checks", rc == 0, f"secs={time.monotonic() - t:.0f} failed={failed}")
        if rc != 0:
            log("\n".join(out[-40:]))

        # ---- fair ---------------------------------------------------------------
        secs = args.fair_secs
        host_load = subprocess.Popen(
            [args.throttle, "--loopback", os.path.join(work, "loop.sock"),
             "--kernel-us", "5000", "--depth", "8", "--duration", str(secs + 10)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        guest.send(f"throttle {secs + 10}")
        time.sleep(min(15, secs // 2))
        samples = []
        end = time.monotonic() + secs - 15
        while time.monotonic() < end:
            time.sleep(3)
            try:
                row = {}
                for vm in ("qemu", "loop"):
                    st = vgpuctl(args, api, "vm", "stats", vm)
                    w = next(x for x in st["windows"] if x["window_s"] == 10)
                    row[vm] = (w["share"], w.get("entitled"), w.get("deviation_pp"))
                samples.append(row)
                log(f"fair sample {row}")
            except Exception as e:
                log(f"fair sample failed: {e}")
        _, out = guest.expect("QG-END throttle rc=", secs + 60)
        guest_line = next((l for l in out if l.startswith("VGPU-THROTTLE")), "")
        host_out = host_load.communicate(timeout=120)[0]
        devs = [abs(s[vm][2]) for s in samples for vm in ("qemu", "loop")
                if s[vm][2] is not None]
        shares = [s["qemu"][0] for s in samples]
        worst = max(devs) if devs else None
        mean_share = sum(shares) / len(shares) if shares else None
        step("fair", worst is not None and worst <= 3.0 and len(samples) >= 3,
             f"samples={len(samples)} worst_deviation_pp={worst} qemu_mean_share={mean_share}"
             f" guest=[{guest_line}] host=[{host_out.strip().splitlines()[-1] if host_out.strip() else ''}]")

        # ---- reload -------------------------------------------------------------
        t = time.monotonic()
        rc, out = guest.run("reload", 600)
        reloaded = next((l for l in out if l.startswith("QG-RELOADED")), "")
        step("reload", rc == 0 and f"submission={args.expect_mode}" in reloaded,
             f"secs={time.monotonic() - t:.0f} rc={rc} guest=[{reloaded}]")

        # ---- reboot -------------------------------------------------------------
        r = qmp(os.path.join(work, "qmp.sock"), "system_reset")
        t = time.monotonic()
        line, _ = guest.expect("QG-READY", 300)
        rc, out = guest.run("smoke", 600) if line else (None, [])
        step("reboot", line is not None and rc == 0,
             f"qmp={'ok' if 'return' in r else r} reboot_s={time.monotonic() - t:.1f} smoke_rc={rc}")

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
            lambda: vgpuctl(args, api, "vm", "show", "qemu").get("connected"), 60)
        # The driver notices the lost backend (its requests time out or the device asks
        # for a reset) and starts the device over; a new process then works.
        rc = None
        for _ in range(6):
            rc, out = guest.run("smoke", 600)
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
        guest.run("halt", 30)
    finally:
        guest.stop()
        backend.kill()
    ok = all(results.get(s) for s in ("boot", "checks", "fair", "reload", "reboot", "restart"))
    if not ok:
        # The logs stay in the work directory, which CI does not keep: print their tails.
        for name, path in (("backend", os.path.join(work, "backend.log")),
                           ("guest console", args.log)):
            dump_tail(name, path, 60)
    print(f"QG-RESULT {'ok' if ok else 'FAIL'} " +
          " ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in results.items()) +
          f" total_s={time.monotonic() - t0:.0f}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
