#!/usr/bin/env python3
"""PyTorch DistributedDataParallel baseline for `ramus train --gpus N` on the
reference Tree-LSTM (issue 32).

The model, the PTB-bracket tree parser and the level-batched plan are the
PyTorch anchor's (`torch_treelstm.py`, found through --anchor-dir or the
RAMUS_TORCH_ANCHOR environment variable; it is not part of this repository).
This script adds only the data-parallel training loop around them:

  * one process per GPU, started by torchrun; NCCL on CUDA, gloo on CPU;
  * every epoch, every rank shuffles the trees with the same seeded
    generator, so all ranks see the same order; the order is cut into
    global steps of N x --batch-size trees and each rank takes its
    contiguous block of each step (rank r: trees r*B .. r*B+B-1). A short
    last step is split as `ramus train` splits it: len/N each, the first
    len%N ranks one more;
  * the rank builds the level-batched plan of its block (timed: plan
    building is part of the step, as it is for Ramus), runs the forward
    pass, the cross-entropy at the root, backward (DDP all-reduces the
    gradients, overlapped with the backward pass) and the optimizer step;
  * the loss is the mean root cross-entropy over the *global* step: each
    rank back-propagates sum(CE of its trees) * N / (trees in the step), so
    DDP's average over N ranks gives exactly the gradient of the global
    mean, uneven last steps included. A rank without trees in a short last
    step runs one tree with weight 0 so that it still joins the all-reduce.
    Hence N ranks at batch B take the same steps as 1 rank at batch N*B
    (up to the order of float sums).

The embedding stays dense, as the anchor has it (nn.Embedding without
sparse=True): DDP all-reduces the whole V x H table every step, whereas
Ramus exchanges only the rows a step touched.

Prints, on rank 0, one JSON line per epoch:
  {"system": "torch-ddp", "model": "treelstm", "hidden": H, "gpus": N,
   "batch_per_gpu": B, "epoch": e, "seconds": s, "sent_per_s": x,
   "loss": mean root cross-entropy of the epoch's trees,
   "first_step_seconds": process start -> end of the first optimizer step, ...}

Usage:
  torchrun --standalone --nproc_per_node N ddp_treelstm.py TREES.txt \\
      --anchor-dir DIR [--device cuda|cpu] [--hidden 256] [--batch-size 25]
      [--epochs 5] [--optimizer adam|sgd] [--lr LR] [--seed 1]
      [--limit K] [--no-shuffle] [--log-steps] [--check-sync]
"""
import sys

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts in the checkout
import _common  # noqa: E402  (before torch: sets the NCCL environment first)

import argparse
import importlib.util
import json
import os
import time


def load_anchor(anchor_dir):
    """The anchor module `torch_treelstm` from `anchor_dir`; exits with a
    clear message when it is not given or not there."""
    if not anchor_dir:
        _common.die("the PyTorch anchor is needed: pass --anchor-dir DIR or set "
                    "RAMUS_TORCH_ANCHOR=DIR, where DIR holds torch_treelstm.py")
    path = os.path.join(anchor_dir, "torch_treelstm.py")
    if not os.path.isfile(path):
        _common.die(f"no torch_treelstm.py in {anchor_dir!r} (from --anchor-dir or "
                    "RAMUS_TORCH_ANCHOR)")
    spec = importlib.util.spec_from_file_location("torch_treelstm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("TreeLSTM", "parse_tree", "make_plan"):
        if not hasattr(mod, name):
            _common.die(f"{path} has no {name}: not the Tree-LSTM anchor this script expects")
    return mod


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", help="PTB-bracket tree file, one tree a line (e.g. SST train.txt)")
    ap.add_argument("--anchor-dir", default=os.environ.get("RAMUS_TORCH_ANCHOR"),
                    help="folder of torch_treelstm.py [default: $RAMUS_TORCH_ANCHOR]")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=25, help="trees per GPU per step")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    ap.add_argument("--lr", type=float, default=None,
                    help="learning rate [default: 1e-3 for adam, 0.05 for sgd]")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="use only the first K trees")
    ap.add_argument("--no-shuffle", action="store_true",
                    help="trees in file order every epoch (the anchor's batches)")
    ap.add_argument("--log-steps", action="store_true",
                    help="print every step's global mean loss (an all-reduce a step: "
                         "for checks, not for timing)")
    ap.add_argument("--check-sync", action="store_true",
                    help="after the first step and after every epoch, all-gather a checksum "
                         "of the parameters' bits and fail unless every rank has the same")
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds a collective waits for the other ranks")
    args = ap.parse_args()
    if args.batch_size < 1 or args.epochs < 1 or args.hidden < 1:
        _common.die("--batch-size, --epochs and --hidden must be at least 1")
    if args.lr is None:
        args.lr = 1e-3 if args.optimizer == "adam" else 0.05
    return args


def main():
    args = parse_args()
    anchor = load_anchor(args.anchor_dir)
    if not os.path.isfile(args.trees):
        _common.die(f"no tree file {args.trees!r}")
    t_start = _common.process_start()
    torch, dist, dev, rank, world, _ = _common.setup(args.device, args.timeout)
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    class LevelBatched(nn.Module):
        """DDP calls forward(): the anchor's model has level_batched(plan)."""

        def __init__(self, tree):
            super().__init__()
            self.tree = tree

        def forward(self, plan):
            return self.tree.level_batched(plan)

    # data and vocabulary, as the anchor builds them (every rank the same)
    with open(args.trees) as f:
        lines = [l for l in f if l.strip()]
    if args.limit is not None:
        lines = lines[: args.limit]
    trees = [anchor.parse_tree(l) for l in lines]
    if not trees:
        _common.die(f"{args.trees}: no trees")
    vocab_ids = {}
    for nodes in trees:
        for _, w, _ in nodes:
            if w is not None and w not in vocab_ids:
                vocab_ids[w] = len(vocab_ids) + 1
    labels_all = [nodes[-1][2] for nodes in trees]

    torch.manual_seed(args.seed)  # DDP broadcasts rank 0's parameters anyway
    model = LevelBatched(anchor.TreeLSTM(len(vocab_ids) + 1, args.hidden)).to(dev)
    # a shard of one-word trees only would leave U_iou, U_f and b_f without
    # gradients, which DDP refuses unless it searches for unused parameters
    # every step; SST has no one-word trees, so the search is off there
    lone_leaves = any(len(nodes) == 1 for nodes in trees)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
              find_unused_parameters=lone_leaves)
    params = list(ddp.parameters())
    if args.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=args.lr)
    else:
        opt = torch.optim.SGD(params, lr=args.lr)

    n = len(trees)
    global_batch = world * args.batch_size
    common = dict(system="torch-ddp", model="treelstm", hidden=args.hidden, gpus=world,
                  batch_per_gpu=args.batch_size, global_batch=global_batch, trees=n,
                  vocab=len(vocab_ids) + 1, optimizer=args.optimizer, lr=args.lr,
                  device=str(dev.type), gpu=_common.device_name(torch, dev),
                  backend=dist.get_backend(), torch=torch.__version__,
                  embedding="dense", shuffle=not args.no_shuffle,
                  find_unused_parameters=lone_leaves)

    def my_part(step_len):
        base, extra = divmod(step_len, world)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)

    first_step_seconds = None
    step_no = 0
    for epoch in range(1, args.epochs + 1):
        if args.no_shuffle:
            order = list(range(n))
        else:
            g = torch.Generator()
            g.manual_seed(args.seed * 1_000_003 + epoch)
            order = torch.randperm(n, generator=g).tolist()
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        _common.sync(torch, dist, dev)
        t0 = time.perf_counter()
        for s in range(0, n, global_batch):
            step = order[s:s + global_batch]
            a, b = my_part(len(step))
            mine = step[a:b]
            weight = world / len(step)
            if not mine:  # a short last step with fewer trees than ranks
                mine, weight = step[:1], 0.0
            batch = [trees[i] for i in mine]
            plan = anchor.make_plan(batch, vocab_ids, dev)
            labels = torch.tensor([labels_all[i] for i in mine], device=dev)
            opt.zero_grad(set_to_none=True)
            ce = F.cross_entropy(ddp(plan), labels, reduction="sum")
            (ce * weight).backward()
            opt.step()
            step_no += 1
            if weight:
                loss_sum += ce.detach().double()
            if first_step_seconds is None:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                first_step_seconds = time.time() - t_start
                if args.check_sync:
                    _common.check_sync(torch, dist, rank, world, params, "after step 1")
            if args.log_steps:
                t = torch.tensor([ce.item() if weight else 0.0], dtype=torch.float64, device=dev)
                dist.all_reduce(t)
                if rank == 0:
                    print(json.dumps({"epoch": epoch, "step": step_no,
                                      "loss": t.item() / len(step)}), flush=True)
        _common.sync(torch, dist, dev)
        seconds = time.perf_counter() - t0

        # outside the timed span: the epoch's mean loss and the slowest
        # rank's first step
        dist.all_reduce(loss_sum)
        fs = torch.tensor([first_step_seconds], dtype=torch.float64, device=dev)
        dist.all_reduce(fs, op=dist.ReduceOp.MAX)
        if args.check_sync:
            _common.check_sync(torch, dist, rank, world, params, f"end of epoch {epoch}")
        if rank == 0:
            print(json.dumps(dict(common, epoch=epoch, seconds=round(seconds, 4),
                                  sent_per_s=round(n / seconds, 2),
                                  loss=loss_sum.item() / n,
                                  first_step_seconds=round(fs.item(), 3),
                                  timing_perturbed=args.log_steps
                                  or (args.check_sync and epoch == 1))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
