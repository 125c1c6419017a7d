"""Pinned host-to-device copy rate per pinned allocation and per NUMA node of the allocating thread.

    python3 bench/pinned_numa.py [--buffers 6] [--mib 1024]

Allocates --buffers pinned buffers of --mib each (kept alive, so the pinned caching allocator cannot hand the
same pages back), first with the process's CPU affinity as it is, then with the thread bound to the CPUs of
each NUMA node in turn, and prints the best of three copies of each buffer into device memory: a pinned buffer
whose pages lie on a node far from the GPU copies more slowly (PCIe reads cross the socket link).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.memory.stream_model import pinned_copy_rate  # noqa: E402

MIB = 1024**2


def node_cpus() -> dict[int, set[int]]:
    nodes = {}
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        cpus = set()
        for part in (path / "cpulist").read_text().strip().split(","):
            if part:
                first, _, last = part.partition("-")
                cpus.update(range(int(first), int(last or first) + 1))
        nodes[int(path.name[4:])] = cpus
    return nodes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffers", type=int, default=6)
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_properties(device)
    bus = f"{gpu.pci_domain_id:04x}:{gpu.pci_bus_id:02x}:{gpu.pci_device_id:02x}.0"
    numa = Path(f"/sys/bus/pci/devices/{bus}/numa_node")
    print(f"GPU {bus}, NUMA node {numa.read_text().strip() if numa.exists() else '?'}; "
          f"allowed CPUs {sorted(os.sched_getaffinity(0))}")
    nodes = node_cpus()
    print("nodes:", {n: f"{min(c)}-{max(c)} ({len(c)})" for n, c in nodes.items()})
    target = torch.empty(args.mib * MIB, dtype=torch.uint8, device=device)
    allowed = os.sched_getaffinity(0)
    kept = []
    for label, cpus in [("as started", allowed)] + [(f"node {n}", c & allowed) for n, c in nodes.items()]:
        if not cpus:
            print(f"{label}: no allowed CPU")
            continue
        os.sched_setaffinity(0, cpus)
        rates = []
        for _ in range(args.buffers):
            host = torch.empty(args.mib * MIB, dtype=torch.uint8, pin_memory=True)
            host.fill_(1)
            kept.append(host)
            rates.append(pinned_copy_rate(host, target) / 1e9)
        print(f"{label}: " + " ".join(f"{r:.1f}" for r in rates) + " GB/s", flush=True)
    os.sched_setaffinity(0, allowed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
