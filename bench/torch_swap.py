#!/usr/bin/env python3
"""PyTorch anchor for `ramus bench-swap` (thesis Table 6.2, column d).

The networks are the ones `ramus-nn/src/vision.rs` declares (no dropout,
as `ramus bench-swap` builds them), for 10 classes:

  vgg11 ... vgg19  torchvision's configurations A/B/D/E with batch norm,
                   widths h, 2h, 4h, 8h; 3x3 convolutions without bias, BN,
                   ReLU; 2x2 max pool after each block (skipped once the map
                   is a single row or column); flatten -> linear 8h -> ReLU
                   -> linear 8h -> ReLU -> linear 10.
  resnet           bottleneck ResNet: stem 7x7/2 conv + BN + ReLU + 3x3/2 max
                   pool for images of 96 pixels or more (else 3x3 conv + BN +
                   ReLU); stage s has width h*2^s and 4*h*2^s outputs; block
                   1x1 -> BN -> ReLU -> 3x3 (stride 2 in the first block of
                   every stage but the first) -> BN -> ReLU -> 1x1 -> BN, plus
                   the identity or a strided 1x1 + BN projection, then ReLU;
                   global average pool -> linear 10.
  alexnet          five convolutions with bias and ReLU of h, 3h, 6h, 4h, 4h
                   channels (5x5, 5x5, 3x3, 3x3, 3x3, stride 1), 3x3/2 max
                   pools (padding 1) after 1, 2 and 5; flatten -> linear 16h
                   -> ReLU -> linear 16h -> ReLU -> linear 10.

Loss: mean softmax cross-entropy. A step is forward, backward and one
optimizer step (sgd, adagrad or adam at --lr), on random images and labels
of the given batch size (the same every run).

Arithmetic is full FP32 (no TF32 in convolutions or matrix products), as
Ramus computes.

Runs, each printed as one JSON line:
  in-memory     no offloading, no cap
  save_on_cpu   every tensor autograd saves for backward goes to pinned host
                memory (torch.autograd.graph.save_on_cpu(pin_memory=True)),
                with the caching allocator capped at each --budgets value
                (torch.cuda.set_per_process_memory_fraction on the current
                device); a budget the run does not fit in reports the error
                instead of a time. With --ratios (one per budget: Nm = peak /
                budget, as `ramus bench-swap` computed them) each line also
                carries its "nm".

Usage:
  torch_swap.py --model vgg19 --image 3x224x224 --batch-size 32 --hidden 64
                [--blocks 3,4,6,3] [--steps 5] [--warmup 2] [--optimizer sgd]
                [--lr 0.01] [--budgets B1,B2,...] [--ratios N1,N2,...]
"""
import argparse
import json
import time

import torch
import torch.nn as nn

VGG = {
    11: [1, 0, 2, 0, 4, 4, 0, 8, 8, 0, 8, 8, 0],
    13: [1, 1, 0, 2, 2, 0, 4, 4, 0, 8, 8, 0, 8, 8, 0],
    16: [1, 1, 0, 2, 2, 0, 4, 4, 4, 0, 8, 8, 8, 0, 8, 8, 8, 0],
    19: [1, 1, 0, 2, 2, 0, 4, 4, 4, 4, 0, 8, 8, 8, 8, 0, 8, 8, 8, 8, 0],
}


def vgg(depth, h, c, height, width, classes):
    layers = []
    for mult in VGG[depth]:
        if mult == 0:
            if height >= 2 and width >= 2:
                layers.append(nn.MaxPool2d(2, 2))
                height, width = height // 2, width // 2
            continue
        layers += [nn.Conv2d(c, mult * h, 3, 1, 1, bias=False),
                   nn.BatchNorm2d(mult * h), nn.ReLU(inplace=False)]
        c = mult * h
    n = c * height * width
    layers += [nn.Flatten(), nn.Linear(n, 8 * h), nn.ReLU(),
               nn.Linear(8 * h, 8 * h), nn.ReLU(), nn.Linear(8 * h, classes)]
    return nn.Sequential(*layers)


class Bottleneck(nn.Module):
    def __init__(self, c, mid, out, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, mid, 1, 1, 0, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, out, 1, 1, 0, bias=False), nn.BatchNorm2d(out))
        if stride == 1 and c == out:
            self.shortcut = nn.Identity()
        else:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c, out, 1, stride, 0, bias=False), nn.BatchNorm2d(out))
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


def resnet(blocks, h, c, height, width, classes):
    layers = []
    if min(height, width) >= 96:
        layers += [nn.Conv2d(c, h, 7, 2, 3, bias=False), nn.BatchNorm2d(h), nn.ReLU(),
                   nn.MaxPool2d(3, 2, 1)]
        height, width = (height + 6 - 7) // 2 + 1, (width + 6 - 7) // 2 + 1
        height, width = (height + 2 - 3) // 2 + 1, (width + 2 - 3) // 2 + 1
    else:
        layers += [nn.Conv2d(c, h, 3, 1, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU()]
    c = h
    for s, count in enumerate(blocks):
        mid = h << s
        out = 4 * mid
        for b in range(count):
            stride = 2 if b == 0 and s > 0 and height >= 2 and width >= 2 else 1
            layers.append(Bottleneck(c, mid, out, stride))
            if stride == 2:
                height, width = (height - 1) // 2 + 1, (width - 1) // 2 + 1
            c = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


def alexnet(h, c, height, width, classes):
    layers = []
    for out, k, pool in [(h, 5, True), (3 * h, 5, True), (6 * h, 3, False),
                         (4 * h, 3, False), (4 * h, 3, True)]:
        layers += [nn.Conv2d(c, out, k, 1, k // 2), nn.ReLU()]
        c = out
        if pool:
            layers.append(nn.MaxPool2d(3, 2, 1))
            height, width = (height - 1) // 2 + 1, (width - 1) // 2 + 1
    n = c * height * width
    layers += [nn.Flatten(), nn.Linear(n, 16 * h), nn.ReLU(),
               nn.Linear(16 * h, 16 * h), nn.ReLU(), nn.Linear(16 * h, classes)]
    return nn.Sequential(*layers)


def build(args):
    c, height, width = (int(x) for x in args.image.split("x"))
    if args.model.startswith("vgg"):
        depth = int(args.model[3:] or 19)
        return vgg(depth, args.hidden, c, height, width, 10), (c, height, width)
    if args.model == "resnet":
        blocks = [int(b) for b in args.blocks.split(",")]
        return resnet(blocks, args.hidden, c, height, width, 10), (c, height, width)
    if args.model == "alexnet":
        return alexnet(args.hidden, c, height, width, 10), (c, height, width)
    raise SystemExit(f"unknown model {args.model}")


def optimizer(args, params):
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr)
    if args.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=args.lr)
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr)
    raise SystemExit(f"unknown optimizer {args.optimizer}")


def run(args, mode, budget, nm=None):
    # the memory cap takes a device index: `torch.device("cuda")` has none
    index = torch.cuda.current_device()
    dev = torch.device("cuda", index)
    torch.manual_seed(1)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(index)
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = 1.0 if budget is None else min(1.0, budget / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    result = {"framework": "pytorch", "model": args.model, "mode": mode,
              "budget": budget, "nm": nm, "batch_size": args.batch_size,
              "image": args.image, "hidden": args.hidden,
              "device": torch.cuda.get_device_name(index)}
    try:
        model, (c, height, width) = build(args)
        model = model.to(dev)
        opt = optimizer(args, model.parameters())
        loss_fn = nn.CrossEntropyLoss()
        g = torch.Generator(device="cpu").manual_seed(2)
        x = torch.randn(args.batch_size, c, height, width, generator=g).to(dev)
        y = torch.randint(0, 10, (args.batch_size,), generator=g).to(dev)

        def step():
            opt.zero_grad(set_to_none=True)
            if mode == "save_on_cpu":
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    loss = loss_fn(model(x), y)
            else:
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return loss

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        torch.cuda.synchronize()
        result["step_s"] = (time.perf_counter() - t0) / args.steps
        result["loss"] = float(loss)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(index)
    except torch.cuda.OutOfMemoryError as e:
        result["error"] = "out of memory: " + str(e).split("\n")[0]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        torch.cuda.empty_cache()
    print(json.dumps(result), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vgg19")
    p.add_argument("--image", default="3x224x224")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--blocks", default="3,4,6,3")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--budgets", default="")
    p.add_argument("--ratios", default="",
                   help="Nm of each budget (peak / budget), reported with it")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch_swap.py needs a CUDA device")
    budgets = [int(b) for b in args.budgets.split(",") if b]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    if ratios and len(ratios) != len(budgets):
        raise SystemExit(f"{len(ratios)} ratios for {len(budgets)} budgets")
    torch.backends.cudnn.benchmark = True
    # full FP32, as Ramus computes (PyTorch allows TF32 in cuDNN by default)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    run(args, "in-memory", None)
    run(args, "save_on_cpu", None)
    for i, b in enumerate(budgets):
        run(args, "save_on_cpu", b, ratios[i] if ratios else None)


if __name__ == "__main__":
    main()
