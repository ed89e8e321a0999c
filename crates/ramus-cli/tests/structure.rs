//! Trees a model cannot read are refused before any work, naming the file,
//! line and vertex, by every command that reads them (train, eval, infer,
//! bench); `--binarize left|right` rewrites them instead.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn ramus(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ramus"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ramus");
    let input = child.stdin.take().expect("stdin");
    if let Some(text) = stdin {
        std::io::Write::write_all(&mut { input }, text.as_bytes()).expect("write stdin");
    }
    child.wait_with_output().expect("ramus output")
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// Fails unless `o` succeeded.
fn ok(o: Output) -> Output {
    assert!(o.status.success(), "{}", err(&o));
    o
}

/// Fails unless `o` failed with one `error:` line that contains `needle`.
fn refused(o: &Output, needle: &str) {
    assert!(!o.status.success(), "expected failure: {}", out(o));
    let e = err(o);
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.starts_with("error: ") && e.contains(needle), "{e}");
}

/// A data directory whose dev.txt has a ternary vertex on line 2.
fn data_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ramus-structure-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let binary = "(3 (2 a) (4 (2 b) (1 c)))\n(1 (2 a) (3 c))\n";
    std::fs::write(dir.join("train.txt"), binary).unwrap();
    std::fs::write(
        dir.join("dev.txt"),
        "(3 (2 a) (4 b))\n(2 (1 a) (2 b) (3 c))\n",
    )
    .unwrap();
    std::fs::write(dir.join("test.txt"), "(3 (2 a) (4 b))\n").unwrap();
    dir
}

const TRAIN: [&str; 6] = ["train", "--epochs", "1", "--hidden", "4", "--quiet"];

#[test]
fn train_refuses_a_ternary_dev_tree_before_training() {
    let dir = data_dir();
    let save = dir.join("never.safetensors");
    let data = dir.to_str().unwrap();
    for model in ["treefc", "treelstm-nary", "mvrnn", "rvnn"] {
        let mut args = TRAIN.to_vec();
        args.extend(["--data", data, "--model", model, "--save"]);
        args.push(save.to_str().unwrap());
        let o = ramus(&args, None);
        refused(
            &o,
            &format!("dev.txt:2: vertex 3 has 3 children, but vertex function `internal` of model `{model}` reads exactly 2"),
        );
        assert!(err(&o).contains("--binarize"), "{}", err(&o));
        assert!(!out(&o).contains("epoch"), "{model} trained: {}", out(&o));
        assert!(!save.exists());
    }
    // child-sum models read any number of children
    let mut args = TRAIN.to_vec();
    args.extend(["--data", data, "--model", "treelstm"]);
    assert!(out(&ok(ramus(&args, None))).contains("epoch 1:"));
}

#[test]
fn binarized_trees_train_evaluate_infer_and_bench() {
    let dir = data_dir();
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
    assert!(out(&ok(ramus(&args, None))).contains("epoch 1:"));
    let dev = dir.join("dev.txt");
    let dev = dev.to_str().unwrap();
    let eval = ["eval", "--data", dev, "--checkpoint", ckpt];
    refused(&ramus(&eval, None), "dev.txt:2: vertex 3 has 3 children");
    let mut args = eval.to_vec();
    args.extend(["--binarize", "right"]);
    assert!(out(&ok(ramus(&args, None))).contains("2 graphs"));

    // a one-child root: refused by both engines, then collapsed
    let trees = "(1 (2 a) (3 b))\n(1 (2 (3 a) (1 b)))\n";
    for engine in ["compiled", "batched"] {
        let args = ["infer", "--checkpoint", ckpt, "--engine", engine];
        refused(
            &ramus(&args, Some(trees)),
            "<stdin>:2: vertex 3 has 1 child",
        );
        let mut args = args.to_vec();
        args.extend(["--binarize", "left"]);
        assert_eq!(out(&ok(ramus(&args, Some(trees)))).lines().count(), 2);
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
    refused(&ramus(&args, None), "dev.txt:2: vertex 3");
    args.extend(["--binarize", "left"]);
    assert!(out(&ok(ramus(&args, None))).contains("\"model\":\"treefc\""));
}

#[test]
fn binarize_is_for_trees_and_names_a_side() {
    refused(
        &ramus(&["train", "--model", "lstm-lm", "--binarize", "left"], None),
        "--binarize rewrites trees; `lstm-lm`",
    );
    let o = ramus(&["train", "--binarize", "up"], None);
    assert!(!o.status.success());
    assert!(
        err(&o).contains("unknown side `up` (known: left, right)"),
        "{}",
        err(&o)
    );
}
