#!/usr/bin/env python3
"""PyTorch DistributedDataParallel baseline for data-parallel ResNet-50
training throughput (issue 32).

torchvision's ResNet-50 (weights=None, --classes outputs) on synthetic data:
every rank draws one batch of random N(0,1) images of 3 x S x S and random
labels on its device, from a generator seeded with --seed + rank, and trains
on that same batch every step (no input pipeline is timed). A step is
forward, mean cross-entropy, backward (DDP all-reduces the gradients in
buckets, overlapped with the backward pass) and the optimizer step (SGD with
momentum 0.9 and lr 0.1 by default).

Arithmetic is FP32: TF32 is off in cuDNN convolutions and in matrix
products unless --tf32 (PyTorch leaves it on in cuDNN by default; Ramus
computes in full FP32). cuDNN's autotuner (cudnn.benchmark) is on unless
--no-cudnn-benchmark. Batch-norm running statistics stay per rank
(broadcast_buffers=False, as Ramus keeps them between evaluations) unless
--broadcast-buffers (DDP's own default, one broadcast from rank 0 per
forward).

--warmup steps (the first includes cuDNN autotuning) are followed by --steps
timed steps, with torch.cuda.synchronize and a barrier at both ends of the
timed span. Prints, on rank 0, one JSON line:
  {"system": "torch-ddp", "model": "resnet50", "gpus": N, "batch_per_gpu": B,
   "images_per_s": x, "step_ms": ..., "first_step_seconds": process start ->
   end of the first optimizer step (init_process_group included), "tf32": ...}

Usage:
  torchrun --standalone --nproc_per_node N ddp_resnet50.py [--device cuda|cpu]
      [--batch-size 32] [--steps 50] [--warmup 10] [--image-size 224]
      [--classes 1000] [--optimizer sgd|adam] [--lr LR] [--momentum 0.9]
      [--channels-last] [--tf32] [--no-cudnn-benchmark] [--broadcast-buffers]
      [--bucket-mb 25] [--seed 1] [--check-sync]
"""
import sys

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts in the checkout
import _common  # noqa: E402  (before torch: sets the NCCL environment first)

import argparse
import inspect
import json
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batch-size", type=int, default=32, help="images per GPU per step")
    ap.add_argument("--steps", type=int, default=50, help="timed steps")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (at least 1)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    ap.add_argument("--lr", type=float, default=None,
                    help="learning rate [default: 0.1 for sgd, 1e-3 for adam]")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0: plain SGD)")
    ap.add_argument("--channels-last", action="store_true",
                    help="NHWC memory format for the model and the images")
    ap.add_argument("--tf32", action="store_true",
                    help="allow TF32 in cuDNN convolutions and matrix products")
    ap.add_argument("--no-cudnn-benchmark", action="store_true",
                    help="cuDNN's heuristics instead of its autotuner")
    ap.add_argument("--broadcast-buffers", action="store_true",
                    help="DDP broadcasts rank 0's batch-norm buffers every forward")
    ap.add_argument("--bucket-mb", type=float, default=25, help="DDP gradient bucket size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--check-sync", action="store_true",
                    help="after the first step and after the timed steps, all-gather a "
                         "checksum of the parameters' bits and fail unless every rank has "
                         "the same")
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds a collective waits for the other ranks")
    args = ap.parse_args()
    if min(args.batch_size, args.steps, args.warmup, args.image_size, args.classes) < 1:
        _common.die("--batch-size, --steps, --warmup, --image-size and --classes must be "
                    "at least 1")
    if args.lr is None:
        args.lr = 0.1 if args.optimizer == "sgd" else 1e-3
    return args


def main():
    args = parse_args()
    t_start = _common.process_start()
    torch, dist, dev, rank, world, _ = _common.setup(args.device, args.timeout)
    import torch.nn.functional as F
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format

    torch.manual_seed(args.seed)  # DDP broadcasts rank 0's parameters anyway
    model = torchvision.models.resnet50(weights=None, num_classes=args.classes)
    model = model.to(dev, memory_format=fmt)
    # newer PyTorch renames broadcast_buffers to forward_sync_buffers (which
    # still syncs the buffers once at construction: they are equal anyway)
    buffers_kw = ("forward_sync_buffers"
                  if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                  else "broadcast_buffers")
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
              bucket_cap_mb=args.bucket_mb, **{buffers_kw: args.broadcast_buffers})
    params = list(ddp.parameters())
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    else:
        opt = torch.optim.Adam(params, lr=args.lr)

    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed * 1_000_003 + rank)
    S = args.image_size
    images = torch.randn(args.batch_size, 3, S, S, device=dev, generator=gen)
    images = images.contiguous(memory_format=fmt)
    labels = torch.randint(0, args.classes, (args.batch_size,), device=dev, generator=gen)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(images), labels)
        loss.backward()
        opt.step()
        return loss

    step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    first_step_seconds = time.time() - t_start
    if args.check_sync:
        _common.check_sync(torch, dist, rank, world, params, "after step 1")
    for _ in range(args.warmup - 1):
        step()

    _common.sync(torch, dist, dev)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    _common.sync(torch, dist, dev)
    seconds = time.perf_counter() - t0

    loss = loss.detach().double().reshape(1)
    dist.all_reduce(loss)
    fs = torch.tensor([first_step_seconds], dtype=torch.float64, device=dev)
    dist.all_reduce(fs, op=dist.ReduceOp.MAX)
    peak = torch.tensor([torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0],
                        dtype=torch.float64, device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if args.check_sync:
        _common.check_sync(torch, dist, rank, world, params, f"after {args.warmup + args.steps} steps")
    if rank == 0:
        print(json.dumps(dict(
            system="torch-ddp", model="resnet50", gpus=world, batch_per_gpu=args.batch_size,
            global_batch=world * args.batch_size, image_size=S, classes=args.classes,
            steps=args.steps, warmup=args.warmup, seconds=round(seconds, 4),
            images_per_s=round(world * args.batch_size * args.steps / seconds, 2),
            step_ms=round(seconds / args.steps * 1e3, 3),
            first_step_seconds=round(fs.item(), 3),
            loss_last=loss.item() / world,
            optimizer=args.optimizer, lr=args.lr,
            momentum=args.momentum if args.optimizer == "sgd" else None,
            precision="fp32", tf32=args.tf32,
            channels_last=args.channels_last,
            cudnn_benchmark=not args.no_cudnn_benchmark,
            broadcast_buffers=args.broadcast_buffers, bucket_mb=args.bucket_mb,
            peak_mem_mib=round(peak.item() / 2**20, 1) if dev.type == "cuda" else None,
            device=dev.type, gpu=_common.device_name(torch, dev),
            backend=dist.get_backend(), torch=torch.__version__,
            torchvision=torchvision.__version__)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
