//! Numerical faults through the `ramus` binary: hyper-parameters no one
//! can mean are refused before any work, a diverging run stops naming the
//! epoch, batch and parameter, a non-finite model is never saved, and
//! checkpoints with non-finite values or unused tensors are refused unless
//! a flag accepts them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ramus_core::model::{Init, ParamKind, ParamSpec};
use ramus_core::{Params, Tensor};
use ramus_graph::{ptb, Vocab, VocabMode};
use ramus_nn::{build_model, checkpoint, ModelConfig};

fn ramus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ramus"))
        .args(args)
        .output()
        .expect("run ramus")
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ramus-cli-nonfinite-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

/// The command failed with one `error:` line containing every `needle`.
fn fails_with(o: &Output, needles: &[&str]) -> String {
    let (out, err) = text(o);
    assert!(!o.status.success(), "expected a failure; stdout:\n{out}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    for needle in needles {
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains(needle),
            "{needle}: {err}"
        );
    }
    err
}

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
        let err = fails_with(&o, &[flag]);
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
    fails_with(&o, &["--on-nonfinite skip-batch", "persistent"]);
    let o = ramus(&["train", "--on-nonfinite", "skip"]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("stop or skip-batch"), "{}", text(&o).1);
}

#[test]
fn a_diverging_run_stops_naming_epoch_batch_graph_and_parameter() {
    let o = ramus(&["train", "--epochs", "2", "--lr", "1e30", "--quiet"]);
    let err = fails_with(
        &o,
        &[
            "epoch 1: non-finite training step at batch ",
            " of 120 (first graph <built-in train>:",
            "first non-finite parameter `",
        ],
    );
    assert!(!text(&o).0.contains("epoch 1: train loss"), "{err}");
}

#[test]
fn skip_batch_counts_skipped_batches_in_the_epoch_line() {
    let o = ramus(&[
        "train",
        "--epochs",
        "1",
        "--hidden",
        "8",
        "--on-nonfinite",
        "skip-batch",
        "--quiet",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
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
    fails_with(&o, &["not saving", path, "not finite"]);
    assert!(
        text(&o).0.contains("epoch 1's model is not kept"),
        "{}",
        text(&o).0
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

fn eval(ckpt: &Path, data: &Path, flags: &[&str]) -> Output {
    let mut args = vec![
        "eval",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--data",
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
    let o = eval(&ckpt, &data, &[]);
    fails_with(
        &o,
        &[
            ckpt.to_str().unwrap(),
            "tensor `W_out`",
            "non-finite",
            "--allow-nonfinite-checkpoint",
        ],
    );
    let o = eval(&ckpt, &data, &["--allow-nonfinite-checkpoint"]);
    assert!(o.status.success(), "{}", text(&o).1);
    let o = ramus(&[
        "infer",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--input",
        data.to_str().unwrap(),
    ]);
    fails_with(&o, &["tensor `W_out`"]);
    let o = ramus(&[
        "infer",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--input",
        data.to_str().unwrap(),
        "--allow-nonfinite-checkpoint",
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    // a clean checkpoint loads without any flag
    let (clean, data) = checkpoint_with("clean", |_, _| {});
    assert!(eval(&clean, &data, &[]).status.success());
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
    let o = eval(&ckpt, &data, &[]);
    fails_with(
        &o,
        &[
            ckpt.to_str().unwrap(),
            "`W_old`, `zz_stale`",
            "--allow-unused-tensors",
        ],
    );
    let o = eval(&ckpt, &data, &["--allow-unused-tensors"]);
    assert!(o.status.success(), "{}", text(&o).1);
}
