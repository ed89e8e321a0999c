"""Helpers shared by the DistributedDataParallel benchmarks in this folder.

Import this module before torch: it fixes the NCCL environment first.
"""
import os
import sys
import time

# NVLink multicast (NCCL's NVLS / NVLink SHARP path, PyTorch's symmetric-memory
# multicast, NVSHMEM's NVLS) must not be used on the shared GPU machines: a
# program that creates multicast objects there can put the host's GPUs, which
# other users share, out of service for a long time. The variables are forced,
# not defaulted, so that an inherited setting cannot turn multicast back on,
# and they are set before torch is imported and long before
# init_process_group. (Export NCCL_NVLS_ENABLE=0 for `ramus train --gpus N`
# there as well; Ramus's own GPU tests do.)
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

_SCRIPT_START = time.time()


def process_start():
    """Wall-clock time (seconds since the epoch) at which this process
    started, from /proc on Linux (10 ms resolution); elsewhere the time this
    module was first imported, which misses the interpreter's own start-up."""
    try:
        with open("/proc/self/stat") as f:
            # the command name (field 2) may hold spaces: split after its ')'
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5): starttime
        with open("/proc/stat") as f:
            btime = next(int(l.split()[1]) for l in f if l.startswith("btime "))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _SCRIPT_START


def die(msg):
    print(f"{os.path.basename(sys.argv[0])}: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def launched_env():
    """(rank, world, local_rank) from the variables torchrun sets; a clear
    error when the script was started without a launcher."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        die("start this script with `torchrun --standalone --nproc_per_node N "
            f"{os.path.basename(sys.argv[0])} ...` (missing {', '.join(missing)})")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def setup(device_kind, timeout_s=600):
    """Joins the process group (NCCL on CUDA, gloo on CPU) and returns
    (torch, dist, device, rank, world, local_rank)."""
    rank, world, local_rank = launched_env()
    import datetime

    import torch
    import torch.distributed as dist

    if device_kind == "cuda":
        if not torch.cuda.is_available():
            die("--device cuda: no CUDA device visible to torch")
        if local_rank >= torch.cuda.device_count():
            die(f"local rank {local_rank} but only {torch.cuda.device_count()} GPU(s) visible")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    elif device_kind == "cpu":
        device = torch.device("cpu")
        backend = "gloo"
    else:
        die(f"--device {device_kind}: expected cuda or cpu")
    kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if backend == "nccl":
        kwargs["device_id"] = device  # binds the communicator eagerly to this GPU
    try:
        dist.init_process_group(**kwargs)
    except TypeError:  # torch without device_id
        kwargs.pop("device_id", None)
        dist.init_process_group(**kwargs)
    return torch, dist, device, rank, world, local_rank


def sync(torch, dist, device):
    """Every rank's queued GPU work done, then every rank here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def param_checksum(torch, params):
    """(exact integer checksum of the parameters' bits, float64 sum): equal
    bits on two ranks give equal integers. The 32-bit words are weighted by
    position and masked before the sum so it cannot overflow int64."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    bits = flat.view(torch.int32).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 1000003 + 1
    exact = ((bits * weights) & 0xFFFFFFFF).sum().item()
    return exact, flat.double().sum().item()


def check_sync(torch, dist, rank, world, params, where):
    """All-gathers every rank's checksum and fails unless they are equal;
    rank 0 prints one JSON line about it."""
    import json

    mine = param_checksum(torch, params)
    every = [None] * world
    dist.all_gather_object(every, mine)
    ok = all(c[0] == every[0][0] for c in every)
    if rank == 0:
        print(json.dumps({"check": "sync", "where": where, "ok": ok,
                          "checksums": [c[0] for c in every],
                          "param_sum": every[0][1]}), flush=True)
    if not ok:
        raise AssertionError(f"parameters differ across ranks at {where}: {every}")


def device_name(torch, device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
