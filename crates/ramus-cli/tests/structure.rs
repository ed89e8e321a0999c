//! Trees a model cannot read are refused before any work, naming the file,
//! line and vertex, by every command that reads them (train, eval, infer,
//! bench); `--binarize left|right` rewrites them instead.

use std::path::PathBuf;
use std::process::Output;

mod common;
use common::*;

/// Runs `ramus`, with `input` as its standard input.
fn with_stdin(args: &[&str], input: &str) -> Output {
    spawn_with_stdin(args, input.as_bytes())
        .wait_with_output()
        .expect("ramus output")
}

/// A new data directory `name` whose dev.txt has a ternary vertex on line 2.
fn data_dir(name: &str) -> PathBuf {
    let dir = fresh_dir(name);
    let binary = "(3 (2 a) (4 (2 b) (1 c)))\n(1 (2 a) (3 c))\n";
    write_files(
        &dir,
        &[
            ("train.txt", binary),
            ("dev.txt", "(3 (2 a) (4 b))\n(2 (1 a) (2 b) (3 c))\n"),
            ("test.txt", "(3 (2 a) (4 b))\n"),
        ],
    );
    dir
}

const TRAIN: [&str; 6] = ["train", "--epochs", "1", "--hidden", "4", "--quiet"];

#[test]
fn train_refuses_a_ternary_dev_tree_before_training() {
    let dir = data_dir("ternary-dev");
    let save = dir.join("never.safetensors");
    let data = dir.to_str().unwrap();
    for model in ["treefc", "treelstm-nary", "mvrnn", "rvnn"] {
        let mut args = TRAIN.to_vec();
        args.extend(["--data", data, "--model", model, "--save"]);
        args.push(save.to_str().unwrap());
        let o = ramus(&args);
        assert_one_line_error(
            &o,
            &format!("dev.txt:2: vertex 3 has 3 children, but vertex function `internal` of model `{model}` reads exactly 2"),
        );
        assert!(stderr(&o).contains("--binarize"), "{}", stderr(&o));
        assert!(
            !stdout(&o).contains("epoch"),
            "{model} trained: {}",
            stdout(&o)
        );
        assert!(!save.exists());
    }
    // child-sum models read any number of children
    let mut args = TRAIN.to_vec();
    args.extend(["--data", data, "--model", "treelstm"]);
    assert!(stdout(&ramus_ok(&args)).contains("epoch 1:"));
}

#[test]
fn binarized_trees_train_evaluate_infer_and_bench() {
    let dir = data_dir("binarized");
    let (data, ckpt) = (dir.to_str().unwrap(), dir.join("fc.safetensors"));
    let ckpt = ckpt.to_str().unwrap();
    let mut args = TRAIN.to_vec();
    args.extend([
        "--data",
        data,
        "--model",
        "treefc",
        "--binarize",
        "left",
        "--save",
        ckpt,
    ]);
    assert!(stdout(&ramus_ok(&args)).contains("epoch 1:"));
    let dev = dir.join("dev.txt");
    let dev = dev.to_str().unwrap();
    let eval = ["eval", "--data", dev, "--checkpoint", ckpt];
    assert_one_line_error(&ramus(&eval), "dev.txt:2: vertex 3 has 3 children");
    let mut args = eval.to_vec();
    args.extend(["--binarize", "right"]);
    assert!(stdout(&ramus_ok(&args)).contains("2 graphs"));

    // a one-child root: refused by both engines, then collapsed
    let trees = "(1 (2 a) (3 b))\n(1 (2 (3 a) (1 b)))\n";
    for engine in ["compiled", "batched"] {
        let args = ["infer", "--checkpoint", ckpt, "--engine", engine];
        assert_one_line_error(&with_stdin(&args, trees), "<stdin>:2: vertex 3 has 1 child");
        let mut args = args.to_vec();
        args.extend(["--binarize", "left"]);
        let o = with_stdin(&args, trees);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(stdout(&o).lines().count(), 2);
    }

    let bench = [
        "bench",
        dev,
        "--model",
        "treefc",
        "--hidden",
        "4",
        "--batch-sizes",
        "2",
    ];
    let mut args = bench.to_vec();
    args.extend(["--reps", "1", "--infer-only"]);
    assert_one_line_error(&ramus(&args), "dev.txt:2: vertex 3");
    args.extend(["--binarize", "left"]);
    assert!(stdout(&ramus_ok(&args)).contains("\"model\":\"treefc\""));
}

#[test]
fn binarize_is_for_trees_and_names_a_side() {
    assert_one_line_error(
        &ramus(&["train", "--model", "lstm-lm", "--binarize", "left"]),
        "--binarize rewrites trees; `lstm-lm`",
    );
    let o = ramus(&["train", "--binarize", "up"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("unknown side `up` (known: left, right)"),
        "{}",
        stderr(&o)
    );
}
