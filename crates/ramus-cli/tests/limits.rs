//! Labels and sizes are checked before any work (issue 30, classes 2 and
//! 3): a label outside the class count is an error naming its file and
//! line, in every command; a model, an input or a batch that cannot fit
//! the host memory budget is refused quickly, naming `--hidden`, the
//! label, the input's `file:line` or `--batch-size`. `--host-memory-budget`
//! makes the memory checks independent of the machine.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::*;

/// Runs `ramus` and returns its output and how long it took.
fn run(args: &[&str]) -> (Output, Duration) {
    let t = Instant::now();
    let o = ramus(args);
    (o, t.elapsed())
}

/// Runs `ramus` with its address space bounded to `kib` KiB (`ulimit -v`,
/// where the shell can set it), so that a run building what it should
/// have refused aborts instead of filling the machine.
fn run_bounded(args: &[&str], kib: u64) -> (Output, Duration) {
    let t = Instant::now();
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {kib} 2>/dev/null; exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_ramus"))
        .args(args)
        .output()
        .expect("run ramus");
    (o, t.elapsed())
}

/// Runs `ramus`, which must fail at once (before any epoch) with one
/// `error:` line containing every needle; returns that line.
fn refused(args: &[&str], needles: &[&str]) -> String {
    let (o, took) = run(args);
    refusal(o, took, needles)
}

/// Checks that `o` is a refusal (see [`refused`]) and returns its line.
fn refusal(o: Output, took: Duration, needles: &[&str]) -> String {
    let line = error_line(&o, needles);
    assert!(!line.contains("allocation"), "{line}");
    let out = stdout(&o);
    assert!(
        !out.contains("epoch 1"),
        "refused only after training: {out}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}: {line}");
    line
}

fn succeeds(args: &[&str]) -> String {
    stdout(&ramus_ok(args))
}

/// Writes `train.txt`, `dev.txt` and `test.txt` into `d`.
fn splits(d: &Path, train: &str, dev: &str, test: &str) -> String {
    write_files(
        d,
        &[("train.txt", train), ("dev.txt", dev), ("test.txt", test)],
    );
    d.display().to_string()
}

const TREES: &str = "(1 (2 a) (3 b))\n(0 (1 a) (2 c))\n";

#[test]
fn a_dev_label_beyond_the_training_labels_is_counted_not_found_after_training() {
    let d = fresh_dir("dev-label");
    let data = splits(&d, TREES, "(1 (2 a) (3 b))\n(9 (2 a) (3 b))\n", TREES);
    // the class count comes from every split: training runs and evaluates dev
    let ckpt = d.join("m.safetensors");
    let ckpt = ckpt.to_str().unwrap();
    let args = [
        "train", "--data", &data, "--epochs", "1", "--hidden", "8", "--quiet",
    ];
    let out = succeeds(&[&args[..], &["--save", ckpt]].concat());
    assert!(out.contains("epoch 1:") && out.contains("test:"), "{out}");
    let dev = format!("{data}/dev.txt");
    succeeds(&["eval", "--data", &dev, "--checkpoint", ckpt]);
    // declared too few: the dev line is named before any model is built
    let e = refused(
        &[&args[..], &["--classes", "4"]].concat(),
        &[&format!("{dev}:2"), "label 9", "--classes 4"],
    );
    assert!(e.contains("outside the 4 classes"), "{e}");
}

#[test]
fn classes_smaller_than_a_training_label_are_refused_with_its_line() {
    let d = fresh_dir("classes");
    let data = splits(&d, TREES, TREES, TREES);
    let args = [
        "train", "--data", &data, "--epochs", "1", "--hidden", "8", "--quiet",
    ];
    refused(
        &[&args[..], &["--classes", "3"]].concat(),
        &[&format!("{data}/train.txt:1"), "label 3"],
    );
    // more classes than labels are fine
    succeeds(&[&args[..], &["--classes", "7"]].concat());
    refused(&[&args[..], &["--classes", "0"]].concat(), &["--classes"]);
    refused(
        &["train", "--model", "lstm-lm", "--classes", "5"],
        &["--classes applies to the tree models"],
    );
}

#[test]
fn a_huge_label_is_refused_with_its_line_and_size() {
    let d = fresh_dir("huge-label");
    let data = splits(
        &d,
        "(2000000000 (2 a) (3 b))\n(0 (1 a) (2 c))\n",
        TREES,
        TREES,
    );
    let e = refused(
        &[
            "train",
            "--data",
            &data,
            "--hidden",
            "8",
            "--quiet",
            "--host-memory-budget",
            "8000000000",
        ],
        &[
            &format!("label 2000000000 at {data}/train.txt:1"),
            "2000000001 classes",
            "W_out",
            "GiB",
        ],
    );
    assert!(e.contains("the model needs"), "{e}");
}

#[test]
fn a_huge_hidden_size_is_refused_naming_hidden_without_allocating() {
    let budget = ["--host-memory-budget", "16000000000"];
    for args in [
        &["train", "--hidden", "100000", "--quiet"][..],
        &[
            "train",
            "--hidden",
            "100000",
            "--model",
            "treelstm",
            "--optimizer",
            "sgd",
        ][..],
    ] {
        refused(
            &[args, &budget[..]].concat(),
            &["--hidden", "host memory", "the model needs"],
        );
    }
    // the same check covers `bench`, whose model is built from its flags
    let d = fresh_dir("bench-hidden");
    let trees = d.join("trees.txt");
    std::fs::write(&trees, TREES).unwrap();
    let trees = trees.to_str().unwrap();
    let bench = [
        "bench",
        trees,
        "--hidden",
        "100000",
        "--batch-sizes",
        "1",
        "--reps",
        "1",
    ];
    refused(&[&bench[..], &budget[..]].concat(), &["--hidden"]);
}

/// `n` words from a vocabulary of `vocab`, as one line.
fn words(n: usize, vocab: usize, seed: usize) -> String {
    (0..n)
        .map(|i| format!("w{}", (i * 7919 + seed * 104729) % vocab))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn one_very_long_sentence_for_the_language_model_is_refused_with_its_line() {
    let data = long_line_text("lm");
    let args = ["train", "--model", "lstm-lm", "--data", &data, "--quiet"];
    // about 950 MiB of activations for that line alone at hidden 64
    refused(
        &[&args[..], &["--host-memory-budget", "400000000"]].concat(),
        &[
            &format!("{data}/train.txt:7"),
            "20000 vertices",
            "alone needs",
        ],
    );
    // lines of 300 words each fit alone, but not 25 of them together
    let medium_text: String = (0..30).map(|k| words(300, 2000, k) + "\n").collect();
    let medium = splits(
        &fresh_dir("lm-medium"),
        &medium_text,
        &short(20),
        &short(30),
    );
    let args = ["train", "--model", "lstm-lm", "--data", &medium];
    let args = [
        &args[..],
        &["--host-memory-budget", "60000000", "--epochs", "1"],
    ]
    .concat();
    let e = refused(&args, &["--batch-size 25", "input(s) a batch fit"]);
    // and the batch size it says fits does
    let fit = e.split("at most ").nth(1).and_then(|t| t.split(' ').next());
    let fit = fit.expect("a batch size that fits");
    assert!(
        fit.parse::<usize>().is_ok_and(|n| (1..25).contains(&n)),
        "{e}"
    );
    succeeds(&[&args[..], &["--batch-size", fit]].concat());
    // the same lines as dev, which training evaluates 64 at a time
    let dev = splits(&fresh_dir("lm-dev"), &short(0), &medium_text, &short(30));
    refused(
        &[
            "train",
            "--model",
            "lstm-lm",
            "--data",
            &dev,
            "--host-memory-budget",
            "60000000",
        ],
        &[
            "dev batches training evaluates (64 at a time)",
            &format!("{dev}/dev.txt:"),
        ],
    );
}

/// Six lines of 12 words from a vocabulary of 2000, starting at `seed`.
fn short(seed: usize) -> String {
    (0..6).map(|k| words(12, 2000, seed + k) + "\n").collect()
}

/// Sentences in a new directory `name`, line 7 of train.txt 20000 words long.
fn long_line_text(name: &str) -> String {
    let train = format!("{}{}\n{}", short(0), words(20000, 2000, 99), short(10));
    splits(&fresh_dir(name), &train, &short(20), &short(30))
}

/// A balanced binary SST tree over `n` leaves.
fn binary_tree(leaves: &[String]) -> String {
    match leaves {
        [one] => format!("(2 {one})"),
        _ => {
            let (l, r) = leaves.split_at(leaves.len() / 2);
            format!("(2 {} {})", binary_tree(l), binary_tree(r))
        }
    }
}

/// A balanced binary SST tree over `n` words (which ones: `seed`).
fn sentence_tree(n: usize, seed: usize) -> String {
    let w: Vec<String> = words(n, 500, seed).split(' ').map(String::from).collect();
    binary_tree(&w)
}

/// Splits for a time-delay network whose `train.txt` line 6 is a
/// sentence of `long` words (the other sentences have eight).
fn td_splits(name: &str, long: usize) -> String {
    let tree = |n, seed| sentence_tree(n, seed) + "\n";
    let few = |seed: usize| (0..5).map(|k| tree(8, seed + k)).collect::<String>();
    let train = format!("{}{}{}", few(0), tree(long, 1), few(10));
    splits(&fresh_dir(name), &train, &few(20), &few(30))
}

#[test]
fn one_very_long_sentence_for_a_time_delay_network_is_refused_with_its_line() {
    let data = td_splits("td", 5000);
    // its pyramid has 12.5 million vertices: tens of GiB of activations
    refused(
        &[
            "train",
            "--model",
            "td-rnn",
            "--data",
            &data,
            "--quiet",
            "--host-memory-budget",
            "1000000000",
        ],
        &[
            &format!("{data}/train.txt:6"),
            "12502500 vertices",
            "alone needs",
        ],
    );
}

#[test]
fn a_pyramid_that_cannot_fit_is_refused_before_it_is_built() {
    // 30000 words: a pyramid of 450 million vertices, 9 GiB for its graph
    // alone. Building it takes seconds and GiBs (in 1 GiB of address
    // space, it aborts); counting it takes neither
    let data = td_splits("td-30000", 30_000);
    let at = format!("{data}/train.txt:6");
    let budget = ["--host-memory-budget", "64000000"];
    let needles = [
        &at[..],
        "a sentence of 30000 words",
        "450015000 vertices and 899970000 edges",
        "split the line into sentences of at most",
        "raise --host-memory-budget",
    ];
    let quick = |args: &[&str]| {
        let (o, took) = run_bounded(args, 1 << 20);
        refusal(o, took, &needles);
        assert!(took < Duration::from_secs(2), "took {took:?}");
    };
    for model in ["td-rnn", "td-lstm"] {
        let train = ["train", "--model", model, "--data", &data, "--quiet"];
        quick(&[&train[..], &budget[..]].concat());
    }
    let file = format!("{data}/train.txt");
    let bench = ["bench", &file, "--model", "td-rnn", "--reps", "1"];
    quick(&[&bench[..], &budget[..]].concat());
    let plan = ["plan-memory", "--model", "td-rnn", "--data", &data];
    quick(&[&plan[..], &budget[..]].concat());
    // eval reads its file the same way
    let small = td_splits("td-8", 8);
    let ckpt = format!("{small}/m.safetensors");
    let train = ["train", "--model", "td-rnn", "--data", &small, "--quiet"];
    succeeds(
        &[
            &train[..],
            &["--epochs", "1", "--hidden", "8", "--save", &ckpt],
        ]
        .concat(),
    );
    quick(
        &[
            &["eval", "--checkpoint", &ckpt, "--data", &file][..],
            &budget[..],
        ]
        .concat(),
    );
    // sentences that fit alone but not together: 300 of 200 words, 20100
    // vertices and 430 KiB a pyramid, refused at the 146th
    let many: Vec<String> = (0..300).map(|k| sentence_tree(200, k)).collect();
    let data = splits(&fresh_dir("td-many"), &many.join("\n"), &many[0], &many[1]);
    let train = ["train", "--model", "td-rnn", "--data", &data, "--quiet"];
    let (o, took) = run_bounded(&[&train[..], &budget[..]].concat(), 1 << 20);
    let at = format!("{data}/train.txt:146: ");
    let held = "the time-delay pyramids of the 146 sentences read up to this line";
    refusal(o, took, &[&at, held, "use shorter or fewer sentences"]);
}

#[test]
fn benchs_synthetic_graphs_that_cannot_fit_are_refused_before_they_are_built() {
    let data = td_splits("bench-synthetic", 8);
    let file = format!("{data}/train.txt");
    let bench = [
        "bench",
        &file,
        "--reps",
        "1",
        "--host-memory-budget",
        "64000000",
    ];
    // 10^10 vertices, 9 million times 64, 2 million times 2000: each
    // aborted in 1 GiB of address space while being built
    for (flag, value, sizes, needles) in [
        (
            "--grid",
            "100000x100000",
            "1",
            "1 graph(s) of 10000000000 vertices",
        ),
        (
            "--grid",
            "3000x3000",
            "64",
            "64 graph(s) of 9000000 vertices",
        ),
        (
            "--perfect-tree",
            "20",
            "2000",
            "2000 graph(s) of 2097151 vertices",
        ),
    ] {
        let args = [flag, value, "--batch-sizes", sizes];
        let (o, took) = run_bounded(&[&bench[..], &args[..]].concat(), 1 << 20);
        let at = format!("{flag} {value}: ");
        let change = "lower it or the largest of --batch-sizes";
        refusal(o, took, &[&at, needles, change]);
        assert!(took < Duration::from_secs(2), "took {took:?}");
    }
}

#[test]
fn eval_infer_and_bench_name_a_label_beyond_the_models_classes() {
    let d = fresh_dir("eval");
    let ckpt = d.join("m.safetensors");
    let ckpt = ckpt.to_str().unwrap();
    // the built-in treebank has five classes
    succeeds(&[
        "train", "--epochs", "1", "--hidden", "8", "--quiet", "--save", ckpt,
    ]);
    let file = d.join("trees.txt");
    let mut text = "(1 (2 the) (3 good))\n".repeat(300);
    text += "(9 (2 the) (3 good))\n";
    std::fs::write(&file, text).unwrap();
    let file = file.to_str().unwrap();
    let at = format!("{file}:301");
    let whose = format!("of the checkpoint {ckpt}");
    refused(
        &["eval", "--data", file, "--checkpoint", ckpt],
        &[&at, "label 9", &whose],
    );
    refused(
        &["infer", "--checkpoint", ckpt, "--input", file],
        &[&at, "label 9"],
    );
    let bench = [
        "bench",
        file,
        "--hidden",
        "8",
        "--batch-sizes",
        "1",
        "--reps",
        "1",
    ];
    refused(&bench, &[&at, "label 9", "outside the 5 classes"]);
    // and a budget too small for a batch of 64 names eval's batch size
    let good = d.join("good.txt");
    std::fs::write(&good, "(1 (2 the) (3 good))\n".repeat(300)).unwrap();
    let good = good.to_str().unwrap();
    let args = ["eval", "--data", good, "--checkpoint", ckpt];
    refused(
        &[&args[..], &["--host-memory-budget", "40000"]].concat(),
        &["host memory", "--batch-size 64"],
    );
}

#[test]
fn runs_at_the_default_sizes_fit_a_modest_budget() {
    // the built-in treebank at the defaults needs a few tens of MiB
    let out = succeeds(&[
        "train",
        "--epochs",
        "1",
        "--quiet",
        "--host-memory-budget",
        "100000000",
    ]);
    assert!(out.contains("test:"), "{out}");
    let Some(data) = std::env::var_os("RAMUS_DATA").map(PathBuf::from) else {
        eprintln!("skipped SST: RAMUS_DATA is not set");
        return;
    };
    let sst = data.join("sst");
    if !sst.join("train.txt").is_file() {
        eprintln!("skipped SST: no {}", sst.display());
        return;
    }
    let sst = sst.to_str().unwrap();
    // SST's reference Tree-LSTM and its time-delay LSTM (the largest
    // pyramids of 25 sentences: about 0.6 GiB) at their defaults
    for args in [
        &[
            "--model",
            "treelstm",
            "--data",
            sst,
            "--host-memory-budget",
            "200000000",
        ][..],
        &[
            "--model",
            "td-lstm",
            "--data",
            sst,
            "--host-memory-budget",
            "1000000000",
        ][..],
    ] {
        let out = succeeds(&[&["train", "--epochs", "0", "--quiet"][..], args].concat());
        assert!(out.contains("test:"), "{out}");
    }
}

#[test]
fn what_cannot_fit_the_device_is_refused_before_training() {
    if let Err(e) = ramus_cuda::CudaDevice::available() {
        eprintln!("skipping: CUDA is not available ({e})");
        return;
    }
    let cuda = ["train", "--device", "cuda", "--quiet"];
    // parameters, gradients and Adagrad state of about 600 MB on a 100 MB budget
    let budget = ["--device-memory-budget", "100000000"];
    refused(
        &[&cuda[..], &budget[..], &["--hidden", "2000"]].concat(),
        &[
            "device memory: the model needs",
            "--device-memory-budget",
            "--hidden",
        ],
    );
    // the host holds only the schedule; the line's activations go to the device
    let data = long_line_text("lm-cuda");
    let lm = ["--model", "lstm-lm", "--data", &data, "--epochs", "1"];
    refused(
        &[&cuda[..], &budget[..], &lm[..]].concat(),
        &[
            "device memory",
            &format!("{data}/train.txt:7"),
            "alone needs",
        ],
    );
    let out = succeeds(&[&cuda[..], &["--epochs", "1", "--hidden", "16"]].concat());
    assert!(out.contains("test:"), "{out}");
}

#[test]
fn the_persistent_and_compiled_engines_are_refused_before_they_allocate() {
    if let Err(e) = ramus_cuda::CudaDevice::available() {
        eprintln!("skipping: CUDA is not available ({e})");
        return;
    }
    let budget = ["--device-memory-budget", "100000000"];
    let persistent = [
        "train",
        "--device",
        "cuda",
        "--engine",
        "persistent",
        "--quiet",
    ];
    // about 200 MB of parameters alone on a 100 MB budget
    refused(
        &[&persistent[..], &budget[..], &["--hidden", "2000"]].concat(),
        &[
            "--engine persistent: device memory: the model needs",
            "--device-memory-budget",
            "--hidden",
        ],
    );
    // a pyramid of 12.5 million vertices: its line, before anything compiles
    let data = td_splits("td-cuda", 5000);
    let d = PathBuf::from(&data);
    refused(
        &[
            &persistent[..],
            &["--model", "td-rnn", "--data", &data],
            &["--device-memory-budget", "1000000000"],
        ]
        .concat(),
        &[
            &format!("{data}/train.txt:6"),
            "alone needs",
            "device memory",
        ],
    );
    // the same checks in `bench`, for either engine
    let file = d.join("trees.txt");
    std::fs::write(&file, TREES).unwrap();
    let file = file.to_str().unwrap();
    for engine in ["persistent", "compiled"] {
        let bench = [
            "bench",
            file,
            "--device",
            "cuda",
            "--engine",
            engine,
            "--hidden",
            "2000",
            "--batch-sizes",
            "1",
            "--reps",
            "1",
        ];
        refused(
            &[&bench[..], &budget[..]].concat(),
            &["device memory: the model needs", "--hidden"],
        );
    }
}

#[test]
fn plan_memory_plans_absurd_sizes_without_allocating() {
    // a trace of 100000-wide tensors is planned, not allocated
    let (o, took) = run(&["plan-memory", "--hidden", "100000", "--batch-size", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(took < Duration::from_secs(20), "took {took:?}");
    // sizes that do not even add up are one line, not a panic
    refused(
        &["plan-memory", "--hidden", "1000000000000"],
        &["too large"],
    );
}
