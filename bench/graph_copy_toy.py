"""Pinned host-to-device copies inside a CUDA graph against the same copies run eagerly, on a toy with the
segment runner's dependency pattern, to find why the runner's copies run at about 50 GB/s in its graph
replays and at 55 eagerly (bench/results/graph_copy_waits_cuda_20261130_s12.log).

    python3 bench/graph_copy_toy.py [--segments 64] [--copy-mib 8] [--compute-us 100] [--slots 4]

The toy: --segments segments, each a group of compute kernels taking about --compute-us and one copy of
--copy-mib from pinned memory into a ring of --slots slots on the device. Copy k waits for the compute of
segment k - slots, whose slot it overwrites ("copy waits"); segment k's compute waits for copy k ("compute
waits"); copies are queued as far ahead as the ring allows, as the runner queues them. Variants: eager or one
captured graph; both waits, one of them, or none (the copy stream is joined at the end either way); the
compute a spin kernel (no memory traffic), fp16 matmuls, a memory-bound add, or one of the UNet's kernels at
SD1.5's full resolution (cuDNN convolution, SDPA attention, group norm): on the H200 the UNet's own graph
copies at 50 GB/s where spin, matmul and add leave the toy's at 53 to 55. With compute shorter than a
copy the call is copy-bound, so the copies' rate is about segments x copy bytes / call time. Prints one row
per variant: ms per call (median of --calls), GB/s of the copies over the call, and the call time of the
copies alone and of the compute alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import graphed, time_step  # noqa: E402

MIB = 1024**2
KINDS = ("none", "spin", "matmul", "add", "conv", "attention", "groupnorm")  # compute per segment
WAITS = ("both", "copy", "compute", "none")  # which waits of the runner's pattern the toy keeps


def timed(device: torch.device, call: Callable[[], None], calls: int) -> float:
    """Median milliseconds of `call` over `calls` calls, after two warm-up calls."""
    for _ in range(2):
        call()
    return statistics.median(time_step(device, call) for _ in range(calls))


def compute_kernels(kind: str, micros: float, device: torch.device) -> Callable[[], None]:
    """A group of kernels of `kind` that takes about `micros` microseconds on the GPU."""
    if kind == "none":
        return lambda: None
    if kind == "spin":
        probe = 1_000_000
        torch.cuda._sleep(probe)  # load the kernel
        ms = timed(device, lambda: torch.cuda._sleep(probe), 5)
        cycles = int(probe * micros / 1e3 / ms)
        return lambda: torch.cuda._sleep(cycles)
    if kind == "matmul":
        a = torch.randn(2048, 2048, dtype=torch.float16, device=device)
        out = torch.empty_like(a)
        one = lambda: torch.mm(a, a, out=out)  # noqa: E731
    elif kind == "add":
        x = torch.zeros(64 * MIB, dtype=torch.float16, device=device)  # 128 MiB read and written
        one = lambda: x.add_(1.0)  # noqa: E731
    elif kind == "conv":  # SD1.5's full-resolution 3x3 convolution (cuDNN)
        x = torch.randn(2, 320, 64, 64, dtype=torch.float16, device=device)
        w = torch.randn(320, 320, 3, 3, dtype=torch.float16, device=device)
        one = lambda: F.conv2d(x, w, padding=1)  # noqa: E731
    elif kind == "attention":  # SD1.5's full-resolution self-attention: (batch, heads, tokens, head dim)
        q = torch.randn(2, 8, 4096, 40, dtype=torch.float16, device=device)
        one = lambda: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
    elif kind == "groupnorm":
        x = torch.randn(2, 320, 64, 64, dtype=torch.float16, device=device)
        one = lambda: F.group_norm(x, 32)  # noqa: E731
    else:
        raise ValueError(f"unknown compute kind {kind!r}; accepted: {', '.join(KINDS)}")
    repeats = max(1, round(micros / 1e3 / timed(device, one, 5)))  # ms wanted / ms of one

    def group() -> None:
        for _ in range(repeats):
            one()

    return group


def toy_call(device: torch.device, host: torch.Tensor, ring: list[torch.Tensor],
             copy_stream: torch.cuda.Stream, compute: Callable[[], None], segments: int,
             copy_waits: bool, compute_waits: bool, copies: bool = True, shift: int = 0
             ) -> Callable[[], None]:
    """One toy call; each copy reads from `shift` bytes past its slot's start in `host`."""
    slots, chunk = len(ring), ring[0].numel()

    def call() -> None:
        main = torch.cuda.current_stream(device)
        copy_stream.wait_stream(main)
        done: list[torch.cuda.Event] = []
        copied: list[torch.cuda.Event] = []
        queued = 0
        for k in range(segments):
            while copies and queued < segments and queued - slots < k:
                with torch.cuda.stream(copy_stream):
                    if copy_waits and queued >= slots:
                        copy_stream.wait_event(done[queued - slots])
                    first = (queued % slots) * chunk + shift
                    ring[queued % slots].copy_(host[first: first + chunk], non_blocking=True)
                    copied.append(torch.cuda.Event())
                    copied[-1].record(copy_stream)
                queued += 1
            if copies and compute_waits:
                main.wait_event(copied[k])
            compute()
            done.append(torch.cuda.Event())
            done[-1].record(main)
        main.wait_stream(copy_stream)

    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, default=64)
    parser.add_argument("--copy-mib", type=float, default=8.0)
    parser.add_argument("--compute-us", type=float, default=100.0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--kinds", default="spin,matmul,add")
    parser.add_argument("--waits", default="both,copy,compute,none")
    parser.add_argument("--shifts", default="0",
                        help="comma-separated byte offsets of each copy's source past a 2 MiB boundary (its "
                             "target stays aligned): copies whose source and target differ in alignment")
    args = parser.parse_args()
    if args.segments < 1 or args.slots < 1 or args.copy_mib <= 0 or args.compute_us < 0:
        parser.error("--segments and --slots must be at least 1, --copy-mib above 0, --compute-us at least 0")
    for name, given, accepted in (("--kinds", args.kinds, KINDS), ("--waits", args.waits, WAITS)):
        bad = [value for value in given.split(",") if value not in accepted]
        if bad:
            parser.error(f"unknown {name} value(s) {', '.join(map(repr, bad))}; "
                         f"accepted: {', '.join(accepted)}")
    if not all(s.isdigit() for s in args.shifts.split(",")):
        parser.error(f"bad --shifts {args.shifts!r}; accepted: comma-separated byte counts, e.g. 0,256")
    device = torch.device("cuda")
    chunk = int(args.copy_mib * MIB)
    shifts = [int(s) for s in args.shifts.split(",")]
    host = torch.empty(args.slots * chunk + max(shifts), dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    ring = [torch.empty(chunk, dtype=torch.uint8, device=device) for _ in range(args.slots)]
    copy_stream = torch.cuda.Stream(device)
    moved = args.segments * chunk
    print(f"{args.segments} segments, copies of {args.copy_mib} MiB into {args.slots} slots, compute about "
          f"{args.compute_us} us per segment")
    print("| compute | shift | mode | waits | ms / call | copies GB/s over the call | copies alone ms "
          "| compute alone ms |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for kind in args.kinds.split(","):
        compute = compute_kernels(kind, args.compute_us, device)
        for shift in shifts:
            for mode in ("eager", "graph"):
                wrap = graphed if mode == "graph" else (lambda _device, call: call)
                alone = timed(device, wrap(device, toy_call(device, host, ring, copy_stream, lambda: None,
                                                            args.segments, False, False, shift=shift)),
                              args.calls)
                compute_only = toy_call(device, host, ring, copy_stream, compute, args.segments, False, False,
                                        copies=False)
                only = timed(device, wrap(device, compute_only), args.calls)
                for waits in args.waits.split(","):
                    call = toy_call(device, host, ring, copy_stream, compute, args.segments,
                                    waits in ("both", "copy"), waits in ("both", "compute"), shift=shift)
                    ms = timed(device, wrap(device, call), args.calls)
                    print(f"| {kind} | {shift} | {mode} | {waits} | {ms:.2f} | {moved / ms / 1e6:.1f} | "
                          f"{alone:.2f} | {only:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
