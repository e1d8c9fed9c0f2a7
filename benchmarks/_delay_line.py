"""A fixed one-way delay for packets routed through a TUN device: netem's ``delay`` in user space.

    ip netns exec <router ns> python benchmarks/_delay_line.py --tun lrd0 --delay-ms 1.0

Used by ``emulated_cluster.py`` when the kernel has no ``sch_netem`` (the benchmark machine's
kernel has TBF but not netem, and there is no modprobe). The router namespace sends every packet
arriving from a node's veth into the TUN device (policy routing); this process holds each packet
for ``--delay-ms`` and writes it back, and the kernel then forwards it to the destination node.
The delay is the same for every packet, so a FIFO keeps their order.

Prints ``ready`` once the device exists (the caller then brings it up and routes into it) and runs
until killed or until ``--max-seconds``; the device disappears with the process.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run(fd: int, delay_s: float, deadline: float) -> tuple[int, int]:
    """Forward packets with a fixed delay until ``deadline`` (monotonic); returns (packets, bytes).

    Per wakeup: one clock read, every packet queued in the device read (a TUN read returns one
    packet), every due packet written. The packets read in one wakeup share their arrival time,
    the wakeup's (they were all waiting when it began), so the FIFO stays in order.
    """
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    packets = nbytes = 0
    read, write, append, popleft, clock = os.read, os.write, queue.append, queue.popleft, time.monotonic
    now = clock()
    while now < deadline:
        timeout = min(1.0, max(0.0, queue[0][0] - now)) if queue else 1.0
        if select.select([fd], [], [], timeout)[0]:  # microsecond timeout (epoll/poll round up to whole ms)
            due = clock() + delay_s
            while True:  # drain everything queued in the device
                try:
                    append((due, read(fd, 65536)))
                except BlockingIOError:
                    break
        now = clock()
        while queue and queue[0][0] <= now:
            packet = popleft()[1]
            try:
                write(fd, packet)
            except BlockingIOError:  # the kernel's queue is full: count it as a drop, like a full link
                continue
            packets += 1
            nbytes += len(packet)
    return packets, nbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tun", required=True, help="TUN device name to create (at most 15 characters)")
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long in any case")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error(f"--delay-ms={args.delay_ms} must be >= 0")
    # SIGTERM from the benchmark's cleanup ends the loop; the device goes away with the fd.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fd = open_tun(args.tun)
    print("ready", flush=True)
    packets, nbytes = run(fd, args.delay_ms / 1e3, time.monotonic() + args.max_seconds)
    user, system = os.times()[:2]
    print(f"forwarded {packets} packets, {nbytes} bytes; CPU {user:.2f} s user, {system:.2f} s system", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
