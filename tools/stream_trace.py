"""Where a GPU iteration's time goes, stream by stream, from a torch.profiler trace.

A swap plan that the simulator predicts to hide every copy can still be slower than predicted: the
compute stream may sit idle waiting for a copy (a stall the schedule did not foresee), its kernels
may run slower while copies are in flight (memory-bandwidth contention), or the copies may move
fewer bytes per second together than the transfer model measured alone. One profiled run tells
these apart. :func:`trace_iterations` profiles a few iterations of a step with CUDA activity,
writes the Chrome trace (gzip) for Perfetto or ``chrome://tracing``, and :func:`summarize` reduces
its GPU events to per-iteration numbers:

- per stream: busy time (the union of its kernels' and copies' intervals), kernels, copies, bytes
  copied each way and their rate while busy;
- the compute stream (the one with most kernel time): busy and idle time, how much of its busy
  time overlapped a copy on another stream, and how much of its idle time did (waiting for a copy,
  most likely; idle time with no copy running is the host launching late);
- ``kernel_slowdown_during_copies``: for each kernel (name and launch configuration) that ran both
  while a copy was in flight and while none was, the ratio of its mean durations, averaged over
  kernels weighted by calls (1.0: copies do not slow compute; above 1: contention).

The profiler's own host overhead (CPU activity is recorded too, to keep the trace readable) makes
the host slower than in an unprofiled run, so idle time with no copy running is an upper bound.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

#: Chrome-trace categories of the work a GPU runs.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[Interval]) -> float:
    """Total length of disjoint ``intervals``."""
    return sum(end - start for start, end in intervals)


def intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two sorted lists of disjoint intervals."""
    result: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            result.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return result


def _direction(event: dict[str, Any]) -> str:
    name = event.get("name", "")
    return "d2h" if "DtoH" in name else "h2d" if "HtoD" in name else "other"


def summarize(events: list[dict[str, Any]], iterations: int) -> dict[str, Any]:
    """Per-iteration stream numbers of a Chrome trace's events (times in ms; see the module docstring)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and "dur" in e]
    if not gpu:
        raise ValueError("the trace has no GPU events: was it profiled with CUDA activity on a GPU?")
    per_stream: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in gpu:
        per_stream[int(event.get("args", {}).get("stream", event.get("tid", -1)))].append(event)
    window = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    scale = 1e-3 / iterations  # microseconds over all iterations -> milliseconds per iteration
    busy = {s: merge((e["ts"], e["ts"] + e["dur"]) for e in evs) for s, evs in per_stream.items()}
    kernel_time = {s: sum(e["dur"] for e in evs if e["cat"] == "kernel") for s, evs in per_stream.items()}
    compute = max(kernel_time, key=lambda s: kernel_time[s])
    copies = merge((e["ts"], e["ts"] + e["dur"]) for s, evs in per_stream.items() if s != compute
                   for e in evs if e["cat"] == "gpu_memcpy")  # fmt: skip
    streams = {}
    for stream, evs in sorted(per_stream.items()):
        row: dict[str, Any] = {"busy_ms": round(length(busy[stream]) * scale, 3),
                               "kernels": sum(e["cat"] == "kernel" for e in evs) // iterations,
                               "copies": sum(e["cat"] == "gpu_memcpy" for e in evs) // iterations}  # fmt: skip
        for direction in ("d2h", "h2d"):
            moved = [e for e in evs if e["cat"] == "gpu_memcpy" and _direction(e) == direction]
            if moved:
                nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in moved)
                seconds = length(merge((e["ts"], e["ts"] + e["dur"]) for e in moved)) * 1e-6
                row[f"{direction}_bytes"] = nbytes // iterations
                row[f"{direction}_gb_per_s"] = round(nbytes / seconds / 1e9, 2) if seconds else None
        streams[str(stream)] = row
    compute_busy = busy[compute]
    return {
        "iterations": iterations,
        "window_ms": round(window * scale, 3),
        "compute_stream": str(compute),
        "compute_busy_ms": round(length(compute_busy) * scale, 3),
        "compute_idle_ms": round((window - length(compute_busy)) * scale, 3),
        "compute_busy_during_copies_ms": round(length(intersection(compute_busy, copies)) * scale, 3),
        # Idle while a copy ran: waiting for it, most likely; idle with no copy running: the host was late.
        "compute_idle_during_copies_ms": round((length(copies) - length(intersection(compute_busy, copies))) * scale,
                                               3),  # fmt: skip
        "copy_busy_ms": round(length(copies) * scale, 3),
        "kernel_slowdown_during_copies": _slowdown(per_stream[compute], copies),
        "streams": streams,
    }


def _slowdown(kernels: list[dict[str, Any]], copies: list[Interval]) -> float | None:
    """Mean duration of each kernel name while copies ran over while none did, weighted by calls."""
    durations: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    ends = [end for _, end in copies]
    for event in kernels:
        if event["cat"] != "kernel":
            continue
        first = bisect.bisect_right(ends, event["ts"])  # the first copy still running when the kernel starts
        during = first < len(copies) and copies[first][0] < event["ts"] + event["dur"]
        # One kernel name runs many shapes (GEMMs, convolutions); the launch configuration tells them apart.
        args = event.get("args", {})
        key = f"{event['name']} grid={args.get('grid')} block={args.get('block')}"
        durations[key][0 if during else 1].append(event["dur"])
    weighted, calls = 0.0, 0
    for with_copies, without in durations.values():
        if with_copies and without and sum(without) > 0:
            ratio = (sum(with_copies) / len(with_copies)) / (sum(without) / len(without))
            weighted += ratio * len(with_copies)
            calls += len(with_copies)
    return round(weighted / calls, 4) if calls else None


def trace_iterations(step: Callable[[], Any], device: torch.device, path: Path, iterations: int = 3) -> dict[str, Any]:
    """Profile ``iterations`` calls of ``step`` on ``device`` (a GPU), write the gzip Chrome trace
    to ``path`` and return :func:`summarize`'s numbers."""
    if device.type != "cuda":
        raise ValueError(f"a stream trace needs a CUDA device, not {device}")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(iterations):
            step()
        torch.cuda.synchronize(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, raw = tempfile.mkstemp(suffix=".json", dir=path.parent)
    os.close(handle)
    try:
        profiler.export_chrome_trace(raw)
        text = Path(raw).read_text(encoding="utf-8")
    finally:
        os.unlink(raw)
    with gzip.open(path, "wt", encoding="utf-8") as out:
        out.write(text)
    return {**summarize(json.loads(text)["traceEvents"], iterations), "trace": str(path)}
