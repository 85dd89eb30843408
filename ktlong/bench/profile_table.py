"""torch.profiler's tables of some work, for the benches' --profile: where its host and device
time went."""

from __future__ import annotations

import time

import torch


def print_profile(fn, host_rows: int = 20, device_rows: int = 12):
    """Run fn() once under torch.profiler and print its operators by host time (a copy that
    holds the host shows as cudaMemcpyAsync or aten::to here) and, on a GPU, its kernels by
    device time (each kernel a CUDA graph replays is its own row) and each stream's busy time:
    which stream bounds the work (busy close to the wall) and which waits."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=host_rows, max_name_column_width=50))
    if cuda:
        print(table.table(sort_by="self_device_time_total", row_limit=device_rows, max_name_column_width=50))
        busy: dict[int, float] = {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                busy[e.device_resource_id] = busy.get(e.device_resource_id, 0.0) + e.time_range.elapsed_us() / 1e3
        shown = ", ".join(f"stream {s}: {ms:.1f} ms" for s, ms in sorted(busy.items(), key=lambda kv: -kv[1]))
        print(f"device busy per stream over {wall * 1e3:.1f} ms of wall clock (profiled): {shown}")
