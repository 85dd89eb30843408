"""The process group: started from torchrun's environment, checked against what was asked,
and the few collectives the engine needs.

Every rank runs the same program on the same inputs (SPMD): prompts, selections that depend
only on local heads, sampling with one seed. What crosses ranks is the all-reduce of partial
sums (attention output, MLP, shared block scores) on the device's backend, and, for the chat,
the user's input lines, broadcast from rank 0 over gloo, and whether each rank's part of a saved
cache was written or read alike; for the server, what rank 0 runs next and whether a prefill
stops (ktlong/parallel/mirrored_session.py).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ktlong.errors import ConfigError
from ktlong.parallel.launch import launched_rank, launched_world


_STARTING_CORES: list[int] | None = None


@dataclass
class TensorParallel:
    rank: int
    world: int
    group: object  # the device's backend: NCCL on GPUs, gloo on the CPU
    cpu_group: object  # gloo, for host-side values (block scores, input lines)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks in place (partial products of sharded matmuls)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_host(self, a: np.ndarray) -> np.ndarray:
        """Sum a float32 host array over ranks in place."""
        dist.all_reduce(torch.from_numpy(a), group=self.cpu_group)
        return a

    def broadcast_text(self, text: str | None, src: int = 0) -> str | None:
        """Rank src's text (None for end of input) on every rank, as UTF-8 bytes; no pickle."""
        data = b"" if text is None else text.encode()
        size = torch.tensor([len(data) if text is not None else -1], dtype=torch.int64)
        dist.broadcast(size, src, group=self.cpu_group)
        if size.item() < 0:
            return None
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src and data else \
            torch.empty(int(size.item()), dtype=torch.uint8)
        if size.item():
            dist.broadcast(buf, src, group=self.cpu_group)
        return bytes(buf.numpy()).decode() if self.rank != src else text

    def broadcast_flag(self, value: bool, src: int = 0) -> bool:
        """Rank src's value on every rank (the others' own are ignored)."""
        flag = torch.tensor([int(value)], dtype=torch.int64)
        dist.broadcast(flag, src, group=self.cpu_group)
        return bool(flag.item())

    def alike(self, reason: str, values: list[int], differ: str) -> str:
        """What every rank did, said alike on every rank: "" where none failed (reason "") and all
        hold the same integers (a part of a saved cache: its token count and ids); else each
        failed rank's reason ("rank 1: ..."), or `differ` where none failed but the values
        differ. Over gloo; every rank calls it with its own."""
        low = torch.tensor([0 if reason else 1, *values], dtype=torch.int64)
        high = low.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.cpu_group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.cpu_group)
        if torch.equal(low, high) and not reason:  # the same on every rank: all done alike
            return ""
        said = [self.broadcast_text(reason, src) for src in range(self.world)]
        return "; ".join(f"rank {r}: {text}" for r, text in enumerate(said) if text) or differ

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def take_cores(self) -> int:
        """Pin this rank to its share of the cores the process started with (torch and the decode
        threads then count only those); returns how many."""
        global _STARTING_CORES
        if not hasattr(os, "sched_setaffinity"):
            return 0
        if _STARTING_CORES is None:  # a second session in the same process splits the same cores
            _STARTING_CORES = sorted(os.sched_getaffinity(0))
        cores = _STARTING_CORES
        share = max(1, len(cores) // self.world)
        mine = cores[self.rank * share:(self.rank + 1) * share] or cores[-share:]
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
        return len(mine)

    def lines_from_main(self, read_line):
        """A line reader for every rank: rank 0 reads (the chat's input) and broadcasts."""
        if self.is_main:
            return lambda: self.broadcast_text(read_line())
        return lambda: self.broadcast_text("")


def start_tensor_parallel(size: int, device_type: str) -> TensorParallel | None:
    """Join the group torchrun set up, or refuse in one sentence what cannot work."""
    world = launched_world()
    if size == 1:
        if world > 1:
            raise ConfigError(f"{world} processes were started but tensor_parallel is 1; pass "
                              f"--tensor_parallel {world}, or run without torchrun.")
        return None
    if world != size:
        raise ConfigError(f"tensor_parallel is {size} but {world} process(es) were started; run "
                          f"`torchrun --nproc_per_node {size} ...` with --tensor_parallel {size}.")
    rank = launched_rank()
    if device_type == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < size:
            raise ConfigError(f"tensor_parallel {size} needs {size} GPUs but this machine has {gpus}; "
                              f"lower --tensor_parallel to {max(gpus, 1)} or use --device cpu.")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
        # left to the interpreter's exit, gloo's threads can outlive their group and abort the
        # process ("terminate called without an active exception"): the group goes first
        atexit.register(dist.destroy_process_group)
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else group
    return TensorParallel(rank, size, group, cpu_group)


def join_ranks(size: int, model_config, device: torch.device) -> tuple[TensorParallel | None, torch.device]:
    """The tensor_parallel option applied: None and the device as is for one process; else the
    model checked to split (before any weight is read), the group joined, this rank's GPU and
    cores taken."""
    from ktlong.parallel.shard import check_shardable

    if size == 1 and launched_world() == 1:
        return None, device
    check_shardable(model_config, size)
    tp = start_tensor_parallel(size, device.type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    tp.take_cores()
    return tp, device
