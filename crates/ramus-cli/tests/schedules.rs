//! `ramus train --lr-schedule` and `--warmup`: the rate every epoch and
//! step logs in `--log-dir` follows the schedule's formula, the plateau
//! schedule decays after its patience, and a resumed run continues the
//! same schedule (the very bytes of the run never interrupted);
//! `--freeze-embeddings` and `--embedding-lr`: the word table stays as it
//! started (read back from the saved checkpoint) while the rest trains.

mod common;

use std::path::{Path, PathBuf};

use common::{error_line, fresh_dir, ramus, ramus_ok, stdout, write_files};
use serde_json::Value;

const TREES: &str = "(3 (2 the) (3 cat))\n(1 (2 a) (1 dog))\n(2 (2 the) (2 dog))\n";

/// Three trees for each split (so batches of 1 make 3 steps an epoch) and
/// a vector file for `the` and `cat`.
fn data(name: &str) -> PathBuf {
    let dir = fresh_dir(name);
    let vectors = "the 0.5 -0.25 1 2\ncat 0.125 0 -1 3\n";
    write_files(
        &dir,
        &[
            ("train.txt", TREES),
            ("dev.txt", TREES),
            ("test.txt", TREES),
            ("vectors.txt", vectors),
        ],
    );
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `ramus train` on `dir`'s data: treelstm, hidden 4, SGD at 0.4 (unless
/// `extra` gives `--lr`), batches of 1, logging every step into `dir/log`;
/// then `extra`.
fn train(dir: &Path, extra: &[&str]) -> std::process::Output {
    let log = dir.join("log");
    let mut args = vec![
        "train",
        "--data",
        s(dir),
        "--model",
        "treelstm",
        "--hidden",
        "4",
        "--optimizer",
        "sgd",
        "--batch-size",
        "1",
        "--quiet",
        "--log-dir",
        s(&log),
        "--log-every",
        "1",
    ];
    if !extra.contains(&"--lr") {
        args.extend(["--lr", "0.4"]);
    }
    args.extend_from_slice(extra);
    ramus_ok(&args)
}

fn records(dir: &Path, kind: &str) -> Vec<Value> {
    std::fs::read_to_string(dir.join("log").join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["kind"] == kind)
        .collect()
}

fn lrs(records: &[Value]) -> Vec<f64> {
    records.iter().map(|r| r["lr"].as_f64().unwrap()).collect()
}

fn close(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= 1e-12 * w.abs().max(1.0),
            "{got:?} vs {want:?}"
        );
    }
}

#[test]
fn the_step_schedule_logs_its_rate_every_epoch() {
    let dir = data("sched-step");
    let o = train(
        &dir,
        &[
            "--epochs",
            "5",
            "--lr-schedule",
            "step",
            "--lr-step-epochs",
            "2",
            "--lr-gamma",
            "0.5",
        ],
    );
    close(&lrs(&records(&dir, "epoch")), &[0.4, 0.4, 0.2, 0.2, 0.1]);
    // every step of epoch 3 at the epoch's rate
    let steps = records(&dir, "step");
    assert_eq!(steps.len(), 15);
    close(&lrs(&steps[6..9]), &[0.2; 3]);
    assert!(stdout(&o).contains("lr 0.4 (step)"), "{}", stdout(&o));
    assert!(stdout(&o).contains("| lr 1.0000e-1 |"), "{}", stdout(&o));
}

#[test]
fn the_cosine_schedule_with_warmup_follows_its_formula() {
    let dir = data("sched-cosine");
    train(
        &dir,
        &[
            "--epochs",
            "4",
            "--lr-schedule",
            "cosine",
            "--lr-min",
            "0.04",
            "--warmup",
            "2",
        ],
    );
    // 3 steps an epoch, 12 in all: 2 of warm-up, then the cosine over 10
    let rate = |step: usize| {
        if step < 2 {
            return 0.4 * (step + 1) as f64 / 2.0;
        }
        let progress = (step - 2) as f64 / 10.0;
        0.04 + 0.36 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    };
    let steps = records(&dir, "step");
    close(&lrs(&steps), &(0..12).map(rate).collect::<Vec<_>>());
    // an epoch logs its last step's rate
    close(
        &lrs(&records(&dir, "epoch")),
        &[rate(2), rate(5), rate(8), rate(11)],
    );
    assert_eq!(steps[0]["lr"].as_f64(), Some(0.2));
}

/// The plateau schedule: every epoch without a better dev accuracy than
/// the best so far (patience 1) halves the rate from the next epoch on.
#[test]
fn the_plateau_schedule_decays_after_its_patience() {
    let dir = data("sched-plateau");
    let args = [
        "--epochs",
        "8",
        "--lr-schedule",
        "plateau",
        "--lr-plateau-patience",
        "1",
        "--lr-gamma",
        "0.5",
    ];
    train(&dir, &args);
    let epochs = records(&dir, "epoch");
    let decays: Vec<u64> = records(&dir, "lr_decay")
        .iter()
        .map(|d| d["epoch"].as_u64().unwrap())
        .collect();
    let mut best = f64::NEG_INFINITY;
    let mut want = Vec::new();
    let mut lr = 0.4;
    for e in &epochs {
        want.push(lr);
        let acc = e["dev_root_accuracy"].as_f64().unwrap();
        let epoch = e["epoch"].as_u64().unwrap();
        if acc > best {
            best = acc;
            assert!(
                !decays.contains(&epoch),
                "epoch {epoch} improved: {decays:?}"
            );
        } else {
            lr *= 0.5;
            assert!(decays.contains(&epoch), "epoch {epoch} did not: {decays:?}");
        }
    }
    close(&lrs(&epochs), &want);
    // three sentences: the dev accuracy cannot climb for 8 epochs
    assert!(!decays.is_empty());
}

/// A run stopped after its first decay and resumed with more epochs ends
/// with the very bytes of the run never stopped: the plateau state (best,
/// stale epochs, decays) came back with the checkpoint.
#[test]
fn a_resumed_plateau_run_continues_the_schedule() {
    let dir = data("sched-resume");
    let plateau = [
        "--lr-schedule",
        "plateau",
        "--lr-plateau-patience",
        "1",
        "--lr-gamma",
        "0.5",
        "--warmup",
        "2",
    ];
    let whole = dir.join("whole.safetensors");
    let mut args = vec!["--epochs", "8", "--save", s(&whole)];
    args.extend(plateau);
    train(&dir, &args);
    let first = records(&dir, "lr_decay")[0]["epoch"].as_u64().unwrap();
    assert!(first < 8);
    let split = first.to_string();
    let (part, ckpt) = (dir.join("part.safetensors"), dir.join("ckpt"));
    let mut args = vec![
        "--epochs",
        &split,
        "--save",
        s(&part),
        "--checkpoint-dir",
        s(&ckpt),
    ];
    args.extend(plateau);
    train(&dir, &args);
    let resumed = dir.join("resumed.safetensors");
    let last = ckpt.join("last.safetensors");
    let o = ramus_ok(&[
        "train",
        "--resume",
        s(&last),
        "--epochs",
        "8",
        "--save",
        s(&resumed),
    ]);
    assert!(stdout(&o).contains("resuming"), "{}", stdout(&o));
    assert!(std::fs::read(&resumed).unwrap() == std::fs::read(&whole).unwrap());
}

/// The safetensors tensor `name` of the checkpoint at `path`.
fn tensor(path: &Path, name: &str) -> Vec<f32> {
    common::saved_tensors(path)
        .remove(name)
        .unwrap_or_else(|| panic!("no tensor `{name}` in {}", path.display()))
}

/// Frozen, the word table saved after training is the one it started as
/// (the file's vectors and the random rows of a run at rate 0), while the
/// other parameters train; `--embedding-lr 0` is the same run, and a slower
/// table trains less far than at the full rate.
#[test]
fn frozen_embeddings_stay_as_they_started() {
    let dir = data("freeze");
    let vectors = dir.join("vectors.txt");
    let run = |name: &str, extra: &[&str]| {
        let save = dir.join(name);
        let mut args = vec![
            "--epochs",
            "3",
            "--embeddings",
            s(&vectors),
            "--save",
            s(&save),
        ];
        args.extend_from_slice(extra);
        let o = train(&dir, &args);
        (save, stdout(&o))
    };
    let (start, _) = run("start.safetensors", &["--lr", "0"]);
    let (frozen, out) = run("frozen.safetensors", &["--freeze-embeddings"]);
    assert!(out.contains("word embeddings frozen"), "{out}");
    let (zero, _) = run("zero.safetensors", &["--embedding-lr", "0"]);
    let (slow, _) = run("slow.safetensors", &["--embedding-lr", "0.04"]);
    let (trained, _) = run("trained.safetensors", &[]);
    assert_eq!(tensor(&frozen, "emb"), tensor(&start, "emb"));
    assert_ne!(tensor(&trained, "emb"), tensor(&start, "emb"));
    for name in ["emb", "W_iou", "U_iou", "W_out", "b_out"] {
        assert_eq!(tensor(&zero, name), tensor(&frozen, name), "{name}");
    }
    for name in ["W_iou", "W_out", "b_out"] {
        assert_ne!(tensor(&frozen, name), tensor(&start, name), "{name} trains");
    }
    // the slower table moved, less far than at the full rate
    let distance = |path: &Path| -> f32 {
        let (a, b) = (tensor(path, "emb"), tensor(&start, "emb"));
        a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum()
    };
    let (slow_d, full_d) = (distance(&slow), distance(&trained));
    assert!(slow_d > 0.0 && slow_d < full_d, "{slow_d} vs {full_d}");
}

#[test]
fn learning_rate_flags_no_one_can_mean_are_refused() {
    let dir = data("sched-errors");
    let base = [
        "train",
        "--data",
        s(&dir),
        "--model",
        "treelstm",
        "--epochs",
        "1",
    ];
    let cases: [(&[&str], &[&str]); 5] = [
        (&["--lr-schedule", "linear"], &["--lr-schedule linear"]),
        (&["--lr-schedule", "step"], &["--lr-step-epochs"]),
        (
            &["--lr-schedule", "cosine", "--lr-gamma", "0.5"],
            &["--lr-gamma", "step or plateau"],
        ),
        (
            &["--lr-schedule", "cosine", "--lr-min", "1"],
            &["--lr-min 1"],
        ),
        (&["--embedding-lr=-1"], &["--embedding-lr -1"]),
    ];
    for (flags, needles) in cases {
        let mut args = base.to_vec();
        args.extend_from_slice(flags);
        error_line(&ramus(&args), needles);
    }
    let cnn = [
        "train",
        "--model",
        "alexnet",
        "--images",
        "8",
        "--epochs",
        "1",
        "--freeze-embeddings",
    ];
    error_line(&ramus(&cnn), &["--freeze-embeddings", "alexnet"]);
}
