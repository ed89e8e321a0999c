//! Numerical faults through the `ramus` binary: hyper-parameters no one
//! can mean are refused before any work, a diverging run stops naming the
//! epoch, batch and parameter, a non-finite model is never saved, and
//! checkpoints with non-finite values or unused tensors are refused unless
//! a flag accepts them.

use std::path::{Path, PathBuf};
use std::process::Output;

use ramus_core::model::{Init, ParamKind, ParamSpec};
use ramus_core::{Params, Tensor};
use ramus_graph::{ptb, Vocab, VocabMode};
use ramus_nn::{build_model, checkpoint, ModelConfig};

mod common;
use common::*;

#[test]
fn hyper_parameters_no_one_can_mean_are_refused_before_any_work() {
    // a data directory that does not exist: the flag is refused first
    let missing = tmp("no-such-data");
    let missing = missing.to_str().unwrap();
    for (flag, value) in [
        ("--lr", "-0.1"),
        ("--lr", "nan"),
        ("--lr", "inf"),
        ("--clip", "0"),
        ("--clip", "-1"),
        ("--clip", "nan"),
        ("--weight-decay", "-0.01"),
        ("--weight-decay", "inf"),
        ("--dropout", "1"),
        ("--dropout", "-0.5"),
        ("--dropout", "nan"),
    ] {
        let arg = format!("{flag}={value}");
        let o = ramus(&["train", "--data", missing, "--epochs", "1", &arg]);
        let err = error_line(&o, &[flag]);
        assert!(!err.contains("no-such-data"), "{arg}: {err}");
    }
    // the persistent engine cannot skip a batch: refused before the device is opened
    let o = ramus(&[
        "train",
        "--data",
        missing,
        "--device",
        "cuda",
        "--engine",
        "persistent",
        "--on-nonfinite",
        "skip-batch",
    ]);
    error_line(&o, &["--on-nonfinite skip-batch", "persistent"]);
    let o = ramus(&["train", "--on-nonfinite", "skip"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("stop or skip-batch"), "{}", stderr(&o));
}

#[test]
fn a_diverging_run_stops_naming_epoch_batch_graph_and_parameter() {
    let o = ramus(&["train", "--epochs", "2", "--lr", "1e30", "--quiet"]);
    let err = error_line(
        &o,
        &[
            "epoch 1: non-finite training step at batch ",
            " of 120 (first graph <built-in train>:",
            "first non-finite parameter `",
        ],
    );
    assert!(!stdout(&o).contains("epoch 1: train loss"), "{err}");
}

#[test]
fn skip_batch_counts_skipped_batches_in_the_epoch_line() {
    let out = stdout(&ramus_ok(&[
        "train",
        "--epochs",
        "1",
        "--hidden",
        "8",
        "--on-nonfinite",
        "skip-batch",
        "--quiet",
    ]));
    assert!(out.contains("| 0 non-finite batches skipped"), "{out}");
}

/// One update overflows the parameters (one batch per epoch): the model is
/// not kept as the best one, and not saved.
#[test]
fn a_non_finite_model_is_never_saved() {
    let ckpt = tmp("overflowed.safetensors");
    let path = ckpt.to_str().unwrap();
    let o = ramus(&[
        "train",
        "--optimizer",
        "sgd",
        "--lr",
        "1e38",
        "--batch-size",
        "5000",
        "--epochs",
        "1",
        "--hidden",
        "16",
        "--quiet",
        "--save",
        path,
    ]);
    error_line(&o, &["not saving", path, "not finite"]);
    assert!(
        stdout(&o).contains("epoch 1's model is not kept"),
        "{}",
        stdout(&o)
    );
    assert!(!ckpt.exists(), "a non-finite model was saved");
}

const TREES: &str = "(3 (2 good) (2 film))\n(1 (2 bad) (1 (2 dull) (2 plot)))\n";

/// A tree model, its vocabulary and data file; `tamper` edits the
/// parameters (and model) before the checkpoint is written.
fn checkpoint_with(
    name: &str,
    tamper: impl FnOnce(&mut ramus_core::Model, &mut Params<f32>),
) -> (PathBuf, PathBuf) {
    let data = tmp(&format!("{name}.txt"));
    std::fs::write(&data, TREES).unwrap();
    let mut vocab = Vocab::new();
    ptb::parse_trees(TREES, "trees", VocabMode::Grow(&mut vocab)).unwrap();
    let cfg = ModelConfig {
        vocab: vocab.len(),
        hidden: 4,
        classes: 5,
    };
    let mut model = build_model("treelstm-nary", &cfg).unwrap();
    let mut params = Params::<f32>::init(&model, 1);
    tamper(&mut model, &mut params);
    let ckpt = tmp(&format!("{name}.safetensors"));
    checkpoint::save(&ckpt, &model, &params, &vocab).unwrap();
    (ckpt, data)
}

/// `ramus eval` (or `infer`) of `ckpt` on `data`, with `flags`.
fn load(command: &str, ckpt: &Path, data: &Path, flags: &[&str]) -> Output {
    let data_flag = if command == "infer" {
        "--input"
    } else {
        "--data"
    };
    let mut args = vec![
        command,
        "--checkpoint",
        ckpt.to_str().unwrap(),
        data_flag,
        data.to_str().unwrap(),
    ];
    args.extend_from_slice(flags);
    ramus(&args)
}

#[test]
fn checkpoints_with_non_finite_values_are_refused_unless_allowed() {
    let (ckpt, data) = checkpoint_with("nan", |model, params| {
        let w = model.param_id("W_out").unwrap();
        params.values[w].data_mut()[3] = f32::NAN;
    });
    let o = load("eval", &ckpt, &data, &[]);
    error_line(
        &o,
        &[
            ckpt.to_str().unwrap(),
            "tensor `W_out`",
            "non-finite",
            "--allow-nonfinite-checkpoint",
        ],
    );
    let o = load("eval", &ckpt, &data, &["--allow-nonfinite-checkpoint"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = load("infer", &ckpt, &data, &[]);
    error_line(&o, &["tensor `W_out`"]);
    let o = load("infer", &ckpt, &data, &["--allow-nonfinite-checkpoint"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // a clean checkpoint loads without any flag
    let (clean, data) = checkpoint_with("clean", |_, _| {});
    assert!(load("eval", &clean, &data, &[]).status.success());
}

#[test]
fn checkpoints_with_tensors_the_model_does_not_use_are_refused_unless_allowed() {
    let (ckpt, data) = checkpoint_with("extra", |model, params| {
        for name in ["zz_stale", "W_old"] {
            model.params.push(ParamSpec {
                name: name.into(),
                shape: vec![2],
                init: Init::Zeros,
                kind: ParamKind::Trained,
            });
            params.values.push(Tensor::zeros(&[2]));
        }
    });
    let o = load("eval", &ckpt, &data, &[]);
    error_line(
        &o,
        &[
            ckpt.to_str().unwrap(),
            "`W_old`, `zz_stale`",
            "--allow-unused-tensors",
        ],
    );
    let o = load("eval", &ckpt, &data, &["--allow-unused-tensors"]);
    assert!(o.status.success(), "{}", stderr(&o));
}
