#!/usr/bin/env python3
"""Checks a QEMU's vhost-user shared memory (patches 0005/0006) without a guest.

Plays a minimal vhost-user backend (just enough for QEMU's generic vhost-user device to
realize) that declares VIRTIO Shared Memory Regions in GET_SHMEM_CONFIG, then drives the
backend channel by hand while QEMU runs SeaBIOS (no guest kernel): the device's BAR 4 is
found through QMP query-pci and read through the monitor (xp), so what the BAR shows is
checked end to end. Steps, each printing "SP-STEP <name> ok|FAIL <detail>":

  negotiate  QEMU acks VHOST_USER_PROTOCOL_F_SHMEM (bit 22) and asks GET_SHMEM_CONFIG
  bar        BAR 4 is 64-bit, prefetchable, as large as the regions together
  map        SHMEM_MAP of a memfd into region 0 and into the second region: acked, and
             the BAR reads the memfd's bytes at the region's offset
  one-slot   (patch 0008) the writable mapping is no memory region of its own: each
             region is one RAM region over a reserved window (one KVM memory slot) in
             which the backend's pages are placed with mmap(MAP_FIXED); the read-only
             mapping overlays it
  reject     a mapping past its region's end, an unknown region and an unmap of
             nothing are each answered with a failure, and the channel still works
  replace    (patch 0007) a map over one page inside a mapping: the BAR shows the new
             page there and the old mapping's bytes on either side
  unmap      SHMEM_UNMAP of the original range (three mappings now): acked, the BAR no
             longer shows the bytes
  reconnect  the backend's connection closes with a mapping in place: QEMU drops it,
             reconnects, asks GET_SHMEM_CONFIG again, and the BAR no longer shows it
  reset      a device reset (QMP system_reset) sends RESET_DEVICE (the backend acks
             that protocol feature; patch 0006's get_vhost) and leaves no mapping, as
             the series' spec says
  pow2       a backend whose regions do not total a power of two is refused at
             realize with a message (QEMU 11.1 asserts)

Usage: shmem_probe.py --qemu BIN [--device vhost-user-device-pci] [--bios DIR] [--work DIR]
Exit status 0 iff every step passed. Needs no root, no KVM (TCG), no network.
"""
import argparse
import array
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

HDR = struct.Struct("<III")
VERSION, REPLY, NEED_REPLY = 0x1, 0x4, 0x8
# Front-end requests we answer.
GET_FEATURES, SET_OWNER, GET_VRING_BASE = 1, 3, 11
GET_PROTOCOL_FEATURES, GET_QUEUE_NUM, SET_BACKEND_REQ_FD = 15, 17, 21
GET_CONFIG, RESET_DEVICE, GET_MAX_MEM_SLOTS, GET_SHMEM_CONFIG = 24, 34, 36, 44
# Back-end requests we send.
SHMEM_MAP, SHMEM_UNMAP = 9, 10
MAP_RW = 1
# Protocol features: REPLY_ACK, BACKEND_REQ, CONFIG, BACKEND_SEND_FD, RESET_DEVICE, SHMEM.
F_SHMEM = 22
PROTOCOL = (1 << 3) | (1 << 5) | (1 << 9) | (1 << 10) | (1 << 13) | (1 << F_SHMEM)
FEATURES = (1 << 32) | (1 << 30)  # VERSION_1, PROTOCOL_FEATURES
MIB = 1 << 20
PAGE = 4096


def recv_exact(sock, n, fds):
    buf = b""
    while len(buf) < n:
        data, anc, _, _ = sock.recvmsg(n - len(buf), socket.CMSG_SPACE(8 * 4))
        if not data:
            raise EOFError
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", raw[: len(raw) - len(raw) % 4]))
        buf += data
    return buf


class FakeBackend:
    """Serves one vhost-user connection at a time on `path` (QEMU connects)."""

    def __init__(self, path, sizes):
        self.sizes = sizes  # region id -> size
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.conn = None
        self.channel = None  # the backend channel (SET_BACKEND_REQ_FD)
        self.acked_protocol = None
        self.shmem_configs = 0  # GET_SHMEM_CONFIG requests seen
        self.resets = 0  # RESET_DEVICE requests seen
        self.connected = threading.Event()
        self.channel_ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conn = conn
            self.connected.set()
            try:
                while True:
                    self._one(conn)
            except (EOFError, OSError):
                pass
            conn.close()

    def _reply(self, conn, req, payload):
        conn.sendall(HDR.pack(req, VERSION | REPLY, len(payload)) + payload)

    def _one(self, conn):
        fds = []
        req, flags, size = HDR.unpack(recv_exact(conn, HDR.size, fds))
        payload = recv_exact(conn, size, fds) if size else b""
        u64 = lambda v: struct.pack("<Q", v)
        if req == GET_FEATURES:
            self._reply(conn, req, u64(FEATURES))
        elif req == GET_PROTOCOL_FEATURES:
            self._reply(conn, req, u64(PROTOCOL))
        elif req == 16:  # SET_PROTOCOL_FEATURES
            self.acked_protocol = struct.unpack("<Q", payload[:8])[0]
        elif req == GET_QUEUE_NUM:
            self._reply(conn, req, u64(2))
        elif req == GET_MAX_MEM_SLOTS:
            self._reply(conn, req, u64(32))
        elif req == GET_CONFIG:
            offset, csize, cflags = struct.unpack("<III", payload[:12])
            self._reply(conn, req, struct.pack("<III", offset, csize, cflags) + bytes(csize))
        elif req == GET_VRING_BASE:
            self._reply(conn, req, payload[:4] + struct.pack("<I", 0))
        elif req == GET_SHMEM_CONFIG:
            self.shmem_configs += 1
            sizes = [0] * 256
            for shmid, sz in self.sizes.items():
                sizes[shmid] = sz
            self._reply(conn, req, struct.pack("<II256Q", len(self.sizes), 0, *sizes))
        elif req == RESET_DEVICE:
            self.resets += 1
        elif req == SET_BACKEND_REQ_FD and fds:
            self.channel = socket.socket(fileno=fds.pop(0))
            self.channel_ready.set()
        for fd in fds:
            os.close(fd)
        if flags & NEED_REPLY and req not in (GET_FEATURES, GET_PROTOCOL_FEATURES,
                                             GET_QUEUE_NUM, GET_MAX_MEM_SLOTS, GET_CONFIG,
                                             GET_VRING_BASE, GET_SHMEM_CONFIG):
            self._reply(conn, req, u64(0))

    def request(self, req, shmid, fd_offset, shm_offset, length, flags, fd=None):
        """One SHMEM_MAP/UNMAP with NEED_REPLY; QEMU's answer (0: success)."""
        body = struct.pack("<B7xQQQQ", shmid, fd_offset, shm_offset, length, flags)
        msg = HDR.pack(req, VERSION | NEED_REPLY, len(body)) + body
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))] if fd else []
        self.channel.sendmsg([msg], anc)
        fds = []
        _, _, size = HDR.unpack(recv_exact(self.channel, HDR.size, fds))
        return struct.unpack("<Q", recv_exact(self.channel, size, fds)[:8])[0]

    def drop_connection(self):
        self.connected.clear()
        self.channel_ready.clear()
        self.channel.close()
        self.conn.shutdown(socket.SHUT_RDWR)


def qmp(path, command, **arguments):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(path)
    f = s.makefile("rwb", buffering=0)
    json.loads(f.readline())
    f.write(b'{"execute": "qmp_capabilities"}\n')
    json.loads(f.readline())
    cmd = {"execute": command}
    if arguments:
        cmd["arguments"] = arguments
    f.write(json.dumps(cmd).encode() + b"\n")
    while True:
        r = json.loads(f.readline())
        if "return" in r or "error" in r:
            s.close()
            return r


def hmp(path, line):
    return qmp(path, "human-monitor-command", **{"command-line": line}).get("return", "")


def read_u64(path, addr):
    """The 8 bytes at guest physical `addr` (xp through the monitor); None where nothing
    is mapped ("Cannot access memory")."""
    out = hmp(path, f"xp /1gx {addr:#x}")
    word = out.split(":", 1)[1].split()[0]
    return None if word == "Cannot" else int(word, 16)


def show(v):
    return "unmapped" if v is None else hex(v)


def memfd_with(pattern_u64, size):
    fd = os.memfd_create("shmem-probe")
    os.ftruncate(fd, size)
    os.pwrite(fd, struct.pack("<Q", pattern_u64) * (size // 8), 0)
    return fd


def qemu_cmd(args, work, tag):
    return [args.qemu, "-accel", "tcg", "-machine", "pc", "-m", "128M", "-nodefaults",
            "-display", "none", "-serial", "none", "-monitor", "none",
            "-L", args.bios, "-qmp", f"unix:{work}/qmp-{tag}.sock,server=on,wait=off",
            "-chardev", f"socket,id=c0,path={work}/{tag}.sock,reconnect-ms=300",
            "-device", f"{args.device},chardev=c0,virtio-id=60,num_vqs=2,config_size=32"]


def wait_until(pred, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return True
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.2)
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qemu", required=True)
    ap.add_argument("--device", default="vhost-user-device-pci")
    ap.add_argument("--bios", default="/usr/share/seabios")
    ap.add_argument("--work")
    args = ap.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="shmem-probe.")
    results = {}

    def step(name, ok, detail=""):
        results[name] = bool(ok)
        print(f"SP-STEP {name} {'ok' if ok else 'FAIL'} {detail}".rstrip(), flush=True)

    # Regions 0 and 3 (ids need not be contiguous), 1 MiB each: BAR of 2 MiB.
    backend = FakeBackend(f"{work}/a.sock", {0: MIB, 3: MIB})
    log = open(f"{work}/qemu-a.log", "w")
    qemu = subprocess.Popen(qemu_cmd(args, work, "a"), stdout=log, stderr=subprocess.STDOUT)
    qmp_a = f"{work}/qmp-a.sock"
    try:
        up = wait_until(lambda: qmp(qmp_a, "query-status")["return"]["running"], 30)
        # (x-query-virtio-status has no vhost section for the generic device.)
        ok = up and backend.acked_protocol is not None and \
            backend.acked_protocol >> F_SHMEM & 1 and backend.shmem_configs == 1
        acked = backend.acked_protocol
        step("negotiate", ok, f"acked_protocol={acked if acked is None else hex(acked)} "
             f"get_shmem_config={backend.shmem_configs}")
        if not ok:
            return 1

        # SeaBIOS assigns the BARs shortly after reset.
        bar = {}

        def find_bar():
            for bus in qmp(qmp_a, "query-pci")["return"]:
                for dev in bus["devices"]:
                    if dev["id"]["device"] == 0x1040 + 60:
                        for r in dev["regions"]:
                            if r["bar"] == 4 and r["address"] not in (0, -1, 0xffffffffffffffff):
                                bar.update(r)
                                return True
            return False
        wait_until(find_bar, 30)
        step("bar", bar.get("size") == 2 * MIB and bar.get("prefetch") and bar.get("mem_type_64"),
             f"bar4={ {k: bar.get(k) for k in ('address', 'size', 'prefetch', 'mem_type_64')} }")
        if not results["bar"]:
            return 1
        base = bar["address"]

        backend.channel_ready.wait(10)
        fd_a = memfd_with(0x5EED0000CAFE0001, 64 * 1024)
        fd_b = memfd_with(0x5EED0000CAFE0003, 2 * PAGE)
        r0 = backend.request(SHMEM_MAP, 0, 0, 16 * PAGE, 64 * 1024, MAP_RW, fd_a)
        r3 = backend.request(SHMEM_MAP, 3, PAGE, 0, PAGE, 0, fd_b)  # read-only, 2nd page
        got0 = read_u64(qmp_a, base + 16 * PAGE + 8)
        got3 = read_u64(qmp_a, base + MIB)
        step("map", r0 == 0 and r3 == 0 and got0 == 0x5EED0000CAFE0001
             and got3 == 0x5EED0000CAFE0003,
             f"replies={r0},{r3} region0={show(got0)} region3={show(got3)}")

        # Patch 0008: a writable mapping is placed in the region's window (one RAM
        # region, one KVM memory slot), not a memory region of its own; a read-only
        # one still overlays the window (a store to it waits for its replacement).
        mtree = hmp(qmp_a, "info mtree")
        step("one-slot", "virtio-shmem-0-window" in mtree and "virtio-shmem-3-window" in mtree
             and "virtio-shmem-0@" not in mtree and "virtio-shmem-3@0x0" in mtree,
             "regions: " + " ".join(sorted(set(re.findall(r"virtio-shmem-[0-9@x-]+\w*", mtree)))))

        bad = [backend.request(SHMEM_MAP, 0, 0, MIB - PAGE, 2 * PAGE, MAP_RW, fd_a),
               backend.request(SHMEM_MAP, 7, 0, 0, PAGE, MAP_RW, fd_a),
               backend.request(SHMEM_UNMAP, 0, 0, 0, PAGE, 0)]
        again = backend.request(SHMEM_MAP, 0, 0, 0, PAGE, MAP_RW, fd_a)
        step("reject", all(b != 0 for b in bad) and again == 0,
             f"replies={bad} then a good map={again}")

        # Patch 0007: a map over part of a mapping replaces that part, the rest stays.
        over = backend.request(SHMEM_MAP, 0, 0, 17 * PAGE, PAGE, MAP_RW, fd_b)
        head = read_u64(qmp_a, base + 16 * PAGE + 8)
        mid = read_u64(qmp_a, base + 17 * PAGE + 8)
        tail = read_u64(qmp_a, base + 18 * PAGE + 8)
        step("replace", over == 0 and head == 0x5EED0000CAFE0001 and mid == 0x5EED0000CAFE0003
             and tail == 0x5EED0000CAFE0001,
             f"reply={over} before={show(head)} replaced={show(mid)} after={show(tail)}")

        # The whole range, now three mappings, goes with one unmap (0007 again).
        u = backend.request(SHMEM_UNMAP, 0, 0, 16 * PAGE, 64 * 1024, 0)
        after = read_u64(qmp_a, base + 16 * PAGE + 8)
        step("unmap", u == 0 and after != 0x5EED0000CAFE0001,
             f"reply={u} region0 now {show(after)}")

        # The mapping of region 3 and the one at region 0's start are still there.
        backend.drop_connection()
        back = wait_until(lambda: backend.shmem_configs == 2 and backend.channel_ready.is_set(), 30)
        gone3 = read_u64(qmp_a, base + MIB)
        gone0 = read_u64(qmp_a, base)
        remap = backend.request(SHMEM_MAP, 3, PAGE, 0, PAGE, 0, fd_b) if back else None
        step("reconnect", back and gone3 != 0x5EED0000CAFE0003 and gone0 != 0x5EED0000CAFE0001
             and remap == 0,
             f"reconnected={back} region3={show(gone3)} region0={show(gone0)} map again={remap}")

        shown = read_u64(qmp_a, base + MIB) if remap == 0 else None
        resets = backend.resets
        qmp(qmp_a, "system_reset")
        time.sleep(1)  # the reset happens in QEMU's main loop, after the reply
        bar.clear()
        wait_until(find_bar, 30)
        after_reset = read_u64(qmp_a, bar["address"] + MIB) if bar else 0x5EED0000CAFE0003
        reset_devices = backend.resets - resets
        step("reset", shown == 0x5EED0000CAFE0003 and bar and after_reset != 0x5EED0000CAFE0003
             and reset_devices >= 1,
             f"before={show(shown)} after={show(after_reset)} reset_device={reset_devices}")
    finally:
        qemu.terminate()
        qemu.wait(10)
        log.close()

    # A backend whose regions total 3 MiB.
    FakeBackend(f"{work}/b.sock", {0: 2 * MIB, 1: MIB})
    r = subprocess.run(qemu_cmd(args, work, "b"), capture_output=True, text=True, timeout=60)
    step("pow2", r.returncode != 0 and "power" in r.stderr,
         f"rc={r.returncode} stderr={r.stderr.strip()[-200:]!r}")

    print(f"SP-RESULT {'ok' if all(results.values()) else 'FAIL'} (work {work})", flush=True)
    return 0 if all(results.values()) and len(results) == 10 else 1


if __name__ == "__main__":
    sys.exit(main())
