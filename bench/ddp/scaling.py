#!/usr/bin/env python3
"""Issue 32's scaling bars in one command: Ramus's data-parallel training
throughput on 1, 2 and 4 GPUs of one machine against one GPU, beside
PyTorch DDP's (the two scripts of this folder) in the same run.

Runs, for each GPU count of --gpus (counts above the machine's GPUs are
skipped with a notice):

* Tree-LSTM on SST: Ramus's batched and persistent engines at hidden 256
  and 512, per-GPU batch 64 and 256 (`ramus train --gpus G`, throughput of
  the epochs after the first, median), and the level-batched PyTorch
  Tree-LSTM under DDP (`ddp_treelstm.py`) at the same hidden sizes and
  batches;
* ResNet-50 at per-GPU batch 32, 224 x 224 (Ramus's bottleneck ResNet
  with ResNet-50's stages, 10 classes, on its synthetic images; torchvision
  ResNet-50 with --classes 10 under DDP).

Each run's figures go to --out as one JSON line (with the command); at the
end a table gives throughput, the ratio to the same configuration on one
GPU, and the time to the first training step (process start to the end of
the first step: rendezvous, communicator, set-up).

Ramus trains on --repeat copies of SST's train.txt (so that four GPUs at
batch 256 still take tens of steps an epoch); PyTorch on one copy (it is
slower, and its epochs are long enough).

Usage:
  bench/ddp/scaling.py --ramus target/release/ramus --sst DIR --anchor-dir DIR
      [--gpus 1,2,4] [--quick] [--only ramus|torch] [--out scaling.jsonl]
"""
import sys

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts in the checkout
import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EPOCH = re.compile(r"^epoch (\d+):.*\| ([0-9.]+) (sent|img)/s")
FIRST = re.compile(r"first step done ([0-9.]+) s after start")


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
        return len([l for l in out.stdout.splitlines() if l.startswith("GPU ")])
    except (OSError, subprocess.CalledProcessError):
        return 0


def run(cmd, env=None, timeout=1800):
    """Runs `cmd`, echoing its output; returns the output, or None when it
    failed (said on standard error)."""
    print("$ " + " ".join(cmd), flush=True)
    full = dict(os.environ, NCCL_NVLS_ENABLE="0", **(env or {}))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  timed out after {timeout} s", file=sys.stderr)
        return None
    text = p.stdout + p.stderr
    if p.returncode != 0:
        print(f"  failed ({p.returncode}):\n{text[-2000:]}", file=sys.stderr)
        return None
    return text


def ramus_figures(text):
    """Median throughput of the epochs after the first, and the first step's time."""
    rates = [float(m.group(2)) for m in map(EPOCH.match, text.splitlines()) if m and m.group(1) != "1"]
    first = FIRST.search(text)
    return (statistics.median(rates) if rates else None, float(first.group(1)) if first else None)


def torch_figures(text, key):
    lines = [json.loads(l) for l in text.splitlines() if l.startswith("{")]
    if not lines:
        return None, None
    if key == "sent_per_s":
        rates = [l[key] for l in lines if key in l][1:] or [l[key] for l in lines if key in l]
        rate = statistics.median(rates) if rates else None
    else:
        rate = lines[-1].get(key)
    first = next((l["first_step_seconds"] for l in lines if "first_step_seconds" in l), None)
    return rate, first


def configs(quick):
    hidden = [256] if quick else [256, 512]
    batches = [256] if quick else [64, 256]
    for h in hidden:
        for b in batches:
            for engine in ["batched", "persistent"]:
                yield ("treelstm", engine, h, b)
            yield ("treelstm", "torch", h, b)
    yield ("resnet50", "batched", 64, 32)
    yield ("resnet50", "torch", 64, 32)


def command(a, cfg, gpus, data):
    model, engine, hidden, batch = cfg
    if engine == "torch":
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc_per_node={gpus}"]
        if model == "treelstm":
            return launch + [os.path.join(HERE, "ddp_treelstm.py"), os.path.join(a.sst, "train.txt"),
                             "--anchor-dir", a.anchor_dir, "--hidden", str(hidden),
                             "--batch-size", str(batch), "--epochs", str(a.epochs)], "sent_per_s"
        return launch + [os.path.join(HERE, "ddp_resnet50.py"), "--batch-size", str(batch),
                         "--classes", "10", "--steps", "30", "--warmup", "5"], "images_per_s"
    base = [a.ramus, "train", "--device", "cuda", "--gpus", str(gpus), "--seed", "3",
            "--epochs", str(a.epochs), "--batch-size", str(batch)]
    if model == "treelstm":
        return base + ["--data", data, "--model", "treelstm", "--optimizer", "adam",
                       "--engine", engine, "--hidden", str(hidden)], None
    # the same steps an epoch on every GPU count
    return base + ["--model", "resnet", "--image", "3x224x224", "--blocks", "3,4,6,3",
                   "--hidden", "64", "--images", str(1024 * gpus), "--optimizer", "sgd",
                   "--lr", "0.1"], None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ramus", required=True, help="the ramus binary")
    ap.add_argument("--sst", required=True, help="folder of SST's train.txt, dev.txt, test.txt")
    ap.add_argument("--anchor-dir", default=os.environ.get("RAMUS_TORCH_ANCHOR"),
                    help="folder of torch_treelstm.py (for the PyTorch Tree-LSTM)")
    ap.add_argument("--gpus", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=8, help="copies of train.txt Ramus trains on")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="hidden 256 and batch 256 only")
    ap.add_argument("--only", choices=["ramus", "torch"])
    ap.add_argument("--out", default="scaling.jsonl")
    a = ap.parse_args()
    have = gpu_count()
    counts = [int(g) for g in a.gpus.split(",")]
    for g in [g for g in counts if g > have]:
        print(f"skipping {g} GPUs: this machine has {have}", file=sys.stderr)
    counts = [g for g in counts if g <= have]
    work = tempfile.mkdtemp(prefix="ramus-scaling-")
    data = os.path.join(work, "sst")
    os.makedirs(data)
    with open(os.path.join(data, "train.txt"), "w") as out:
        train = open(os.path.join(a.sst, "train.txt")).read()
        out.write(train * a.repeat)
    for f in ["dev.txt", "test.txt"]:
        shutil.copy(os.path.join(a.sst, f), data)
    results = []
    with open(a.out, "a") as log:
        for cfg in configs(a.quick):
            system = "torch" if cfg[1] == "torch" else "ramus"
            if a.only and a.only != system or (system == "torch" and cfg[0] == "treelstm"
                                               and not a.anchor_dir):
                continue
            for gpus in counts:
                cmd, key = command(a, cfg, gpus, data)
                text = run(cmd)
                if text is None:
                    continue
                rate, first = torch_figures(text, key) if key else ramus_figures(text)
                row = dict(zip(["model", "engine", "hidden", "batch_per_gpu"], cfg),
                           gpus=gpus, per_s=rate, first_step_s=first, command=" ".join(cmd))
                results.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
    shutil.rmtree(work, ignore_errors=True)
    print("\n| model | engine | hidden | batch/GPU | GPUs | per s | × one GPU | first step (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        one = next((o["per_s"] for o in results if o["gpus"] == 1 and all(
            o[k] == r[k] for k in ["model", "engine", "hidden", "batch_per_gpu"])), None)
        ratio = f"{r['per_s'] / one:.2f}" if one and r["per_s"] else "-"
        rate = f"{r['per_s']:,.0f}" if r["per_s"] else "-"
        first = f"{r['first_step_s']:.1f}" if r["first_step_s"] else "-"
        print(f"| {r['model']} | {r['engine']} | {r['hidden']} | {r['batch_per_gpu']} | "
              f"{r['gpus']} | {rate} | {ratio} | {first} |")


if __name__ == "__main__":
    main()
