#!/usr/bin/env python3
"""Writes the PyTorch golden fixture for Ramus' reference Tree-LSTM.

The model is the PyTorch anchor's own `TreeLSTM` (imported by path from
`shared/bench/torch_treelstm.py`), in float64, hidden size 4, 5 classes.
For each case the script records the parameter values, the mean root
cross-entropy loss of one batch (all trees of the case) and the gradients of
that loss, computed with the anchor's `level_batched` (and checked against
`eager_tree`). `crates/ramus-nn/tests/torch_fixture.rs` replays the same
batch through Ramus' `treelstm` model and compares.

Cases:
  synthetic  three made-up trees written below (stored in the fixture);
  sst        the first three lines of <data>/sst/train.txt, <data> being
             $RAMUS_DATA or ../shared/data relative to the repository root.
             Only the source and line count are stored, never the text.

Usage:
  python3 scripts/make_torch_fixture.py [ANCHOR.py] [--data DIR] [--out FILE]
"""
import argparse
import importlib.util
import json
import os
import sys

import torch
import torch.nn as nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ANCHOR = os.path.join(REPO, "..", "shared", "bench", "torch_treelstm.py")
DEFAULT_OUT = os.path.join(REPO, "crates", "ramus-nn", "tests", "fixtures", "torch_treelstm.json")

HIDDEN = 4
CLASSES = 5
SEED = 1234
SST_LINES = 3

# Made-up binary trees in SST bracket format (labels 0-4 on every node).
SYNTHETIC = [
    "(3 (2 (2 a) (3 good)) (1 (2 not) (3 fun)))",
    "(1 (2 (2 the) (0 plot)) (2 (1 (2 not) (2 a)) (2 (3 quite) (1 mess))))",
    "(4 great)",
]

PARAM_NAMES = ["emb", "W_iou", "U_iou", "b_iou", "U_f", "b_f", "W_out", "b_out"]


def load_anchor(path):
    spec = importlib.util.spec_from_file_location("torch_treelstm_anchor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def named_params(model):
    """The anchor's tensors under Ramus' parameter names, in Ramus' order."""
    return {
        "emb": model.emb.weight,
        "W_iou": model.W_iou.weight,
        "U_iou": model.U_iou.weight,
        "b_iou": model.b_iou,
        "U_f": model.U_f.weight,
        "b_f": model.b_f,
        "W_out": model.out.weight,
        "b_out": model.out.bias,
    }


def run_case(anchor, lines):
    trees = [anchor.parse_tree(l) for l in lines if l.strip()]
    # The anchor's vocabulary: first appearance, ids from 1, 0 = <unk>.
    vocab_ids = {}
    for nodes in trees:
        for _, w, _ in nodes:
            if w is not None and w not in vocab_ids:
                vocab_ids[w] = len(vocab_ids) + 1
    vocab = len(vocab_ids) + 1

    # Default init in float32 (PyTorch's default dtype), then float64.
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(SEED)
    model = anchor.TreeLSTM(vocab, HIDDEN).double()
    # The anchor allocates its h/c buffers with torch.zeros (default dtype);
    # float64 throughout needs the default dtype set to float64 as well.
    torch.set_default_dtype(torch.float64)
    with torch.no_grad():
        # Deterministic non-zero biases (the anchor initialises them to zero).
        k3 = torch.arange(3 * HIDDEN, dtype=torch.float64)
        k1 = torch.arange(HIDDEN, dtype=torch.float64)
        model.b_iou.add_(0.3 * torch.sin(1.7 * k3 + 0.5))
        model.b_f.add_(0.5 + 0.2 * torch.cos(2.3 * k1))

    dev = torch.device("cpu")
    labels = torch.tensor([nodes[-1][2] for nodes in trees], device=dev)
    words = [[vocab_ids.get(w, 0) if w is not None else -1 for _, w, _ in nodes] for nodes in trees]

    params = named_params(model)

    model.zero_grad()
    logits = model.level_batched(anchor.make_plan(trees, vocab_ids, dev))
    loss = nn.functional.cross_entropy(logits, labels)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in params.items()}

    # Cross-check with the anchor's eager (one node at a time) implementation.
    model.zero_grad()
    logits_e = torch.cat([model.eager_tree(n, w).unsqueeze(0) for n, w in zip(trees, words)])
    loss_e = nn.functional.cross_entropy(logits_e, labels)
    loss_e.backward()
    assert logits.dtype == torch.float64 and loss.dtype == torch.float64
    assert abs(loss.item() - loss_e.item()) <= 1e-12, (loss.item(), loss_e.item())
    for n, p in params.items():
        d = (grads[n] - p.grad).abs().max().item()
        assert d <= 1e-12, (n, d)

    out_params = []
    for n in PARAM_NAMES:
        p = params[n]
        out_params.append({
            "name": n,
            "shape": list(p.shape),
            "values": [float(x) for x in p.detach().reshape(-1).tolist()],
            "grad": [float(x) for x in grads[n].reshape(-1).tolist()],
        })
    case = {
        "H": HIDDEN,
        "classes": CLASSES,
        "vocab": vocab,
        "trees": len(trees),
        "nodes": sum(len(t) for t in trees),
        "loss": loss.item(),
        "logits": [float(x) for x in logits.detach().reshape(-1).tolist()],
        "params": out_params,
    }
    return case, loss_e.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("anchor", nargs="?", default=DEFAULT_ANCHOR, help="path of torch_treelstm.py")
    ap.add_argument("--data", default=os.environ.get("RAMUS_DATA") or os.path.join(REPO, "..", "shared", "data"))
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()

    anchor = load_anchor(os.path.abspath(args.anchor))

    fixture = {
        "anchor": "shared/bench/torch_treelstm.py",
        "torch": torch.__version__,
        "seed": SEED,
        "note": "generated by scripts/make_torch_fixture.py; torch.manual_seed(seed) default init "
                "in float32 then .double(), plus b_iou += 0.3*sin(1.7k+0.5), b_f += 0.5+0.2*cos(2.3k); "
                "loss = mean root cross-entropy over all trees of the case as one batch",
        "cases": {},
    }

    case, loss_e = run_case(anchor, SYNTHETIC)
    case = {"lines": SYNTHETIC, **case}
    fixture["cases"]["synthetic"] = case
    print(f"synthetic: {case['trees']} trees, {case['nodes']} nodes, vocab {case['vocab']}, "
          f"loss {case['loss']!r} (eager {loss_e!r})")

    sst_path = os.path.join(args.data, "sst", "train.txt")
    if os.path.exists(sst_path):
        with open(sst_path, encoding="utf-8") as f:
            lines = [f.readline() for _ in range(SST_LINES)]
        case, loss_e = run_case(anchor, lines)
        # The tree text itself is never stored (data stays out of the repo).
        case = {"source": "sst/train.txt", "lines": SST_LINES, **case}
        fixture["cases"]["sst"] = case
        print(f"sst: {case['trees']} trees, {case['nodes']} nodes, vocab {case['vocab']}, "
              f"loss {case['loss']!r} (eager {loss_e!r})")
    else:
        print(f"sst: {sst_path} not found; case not written", file=sys.stderr)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    for name, c in fixture["cases"].items():
        for p in c["params"]:
            g = max(abs(x) for x in p["grad"])
            print(f"  {name:9s} {p['name']:6s} shape {p['shape']} max|grad| {g:.3e}")


if __name__ == "__main__":
    main()
