//! The `ramus` binary end to end: a short training run with a checkpoint,
//! evaluation of it, predictions from it (compiled and batched engines), a
//! benchmark line, and one-line errors for bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

mod common;
use common::*;

#[test]
fn train_save_eval_on_built_in_data() {
    let ckpt = tmp("m.safetensors");
    let o = ramus_ok(&[
        "train",
        "--epochs",
        "1",
        "--hidden",
        "16",
        "--quiet",
        "--save",
        ckpt.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("built-in synthetic treebank")
            && out.contains("epoch 1:")
            && out.contains("test:"),
        "{out}"
    );
    // evaluate the checkpoint on a tree file written by hand
    let trees = tmp("trees.txt");
    std::fs::write(&trees, "(3 (2 not) (1 bad))\n(1 (2 the) (4 wonderful))\n").unwrap();
    let o = ramus_ok(&[
        "eval",
        "--data",
        trees.to_str().unwrap(),
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["graphs"], 2);
    assert!(v["root_accuracy"].as_f64().unwrap() >= 0.0 && v["loss"].as_f64().unwrap() > 0.0);
    // benchmark prints one JSON object per batch size
    let o = ramus_ok(&[
        "bench",
        trees.to_str().unwrap(),
        "--hidden",
        "8",
        "--batch-sizes",
        "1,2",
        "--reps",
        "2",
    ]);
    let lines: Vec<serde_json::Value> = json_lines(&o);
    assert_eq!(lines.len(), 2);
    for key in [
        "system",
        "engine",
        "device",
        "hidden",
        "batch",
        "nodes",
        "infer_ms",
        "train_sent_per_s",
    ] {
        assert!(lines[1].get(key).is_some(), "missing {key}");
    }
    assert_eq!(lines[1]["nodes"], 6);
    // the compiled engine's latency percentiles on the CPU
    let o = ramus_ok(&[
        "bench",
        trees.to_str().unwrap(),
        "--engine",
        "compiled",
        "--hidden",
        "8",
        "--batch-sizes",
        "2",
        "--reps",
        "3",
        "--compare-batched",
    ]);
    let lines: Vec<serde_json::Value> = json_lines(&o);
    let line = &lines[0];
    assert_eq!(line["engine"], "compiled");
    assert!(line["infer_p99_ms"].as_f64().unwrap() >= line["infer_ms"].as_f64().unwrap());
    assert_eq!(lines[1]["ratio"], "compiled_vs_batched");
    assert!(lines[1]["speedup"].as_f64().unwrap() > 0.0);
    // Cortex's TreeFC input: perfect binary trees of a given height
    let o = ramus_ok(&[
        "bench",
        trees.to_str().unwrap(),
        "--engine",
        "compiled",
        "--model",
        "treefc",
        "--hidden",
        "8",
        "--perfect-tree",
        "3",
        "--batch-sizes",
        "1,2",
        "--reps",
        "1",
    ]);
    let nodes: Vec<u64> = json_lines(&o)
        .iter()
        .map(|l| l["nodes"].as_u64().unwrap())
        .collect();
    assert_eq!(nodes, [15, 30]);
    // the ablation on DAGs leaves out unrolling (trees and sequences only)
    let o = ramus_ok(&[
        "bench",
        trees.to_str().unwrap(),
        "--engine",
        "compiled",
        "--model",
        "dagrnn",
        "--hidden",
        "8",
        "--grid",
        "3x3",
        "--ablation",
        "--batch-sizes",
        "1",
        "--reps",
        "1",
    ]);
    let schedules: Vec<String> = json_lines(&o)
        .iter()
        .map(|l| l["schedule"].to_string())
        .collect();
    assert!(schedules.len() >= 2, "{schedules:?}");
    assert!(
        schedules.iter().all(|s| !s.contains("unrolling")),
        "{schedules:?}"
    );
    // predictions: the compiled engine from a file, the batched one from standard input
    let predict = |engine: &str, from_stdin: bool| -> Vec<serde_json::Value> {
        let mut args = vec![
            "infer",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--engine",
            engine,
        ];
        if !from_stdin {
            args.extend(["--input", trees.to_str().unwrap()]);
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_ramus"))
            .args(&args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run ramus infer");
        {
            use std::io::Write;
            let mut stdin = child.stdin.take().expect("stdin");
            if from_stdin {
                stdin
                    .write_all(&std::fs::read(&trees).unwrap())
                    .expect("write trees");
            }
        }
        let o = child.wait_with_output().expect("ramus infer");
        assert!(o.status.success(), "{}", stderr(&o));
        json_lines(&o)
    };
    let (compiled, batched) = (predict("compiled", false), predict("batched", true));
    assert_eq!(batched.len(), 2);
    // the schedule without per-token tables predicts the same
    let o = ramus_ok(&[
        "infer",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--input",
        trees.to_str().unwrap(),
        "--no-tables",
    ]);
    let untabled: Vec<serde_json::Value> = json_lines(&o);
    assert_eq!(
        untabled
            .iter()
            .map(|v| &v["prediction"])
            .collect::<Vec<_>>(),
        compiled
            .iter()
            .map(|v| &v["prediction"])
            .collect::<Vec<_>>()
    );
    // the binary Tree-LSTM has nothing to refactor; unrolled, the same predictions
    assert_one_line_error(
        &ramus(&[
            "infer",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--input",
            trees.to_str().unwrap(),
            "--refactor",
        ]),
        "nothing to refactor",
    );
    let o = ramus_ok(&[
        "infer",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--input",
        trees.to_str().unwrap(),
        "--unroll",
    ]);
    let recursed: Vec<serde_json::Value> = json_lines(&o);
    assert_eq!(recursed.len(), compiled.len());
    for (r, c) in recursed.iter().zip(&compiled) {
        assert_eq!(r["prediction"], c["prediction"]);
        for (x, y) in r["scores"]
            .as_array()
            .unwrap()
            .iter()
            .zip(c["scores"].as_array().unwrap())
        {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "recursed {x} vs {y}"
            );
        }
    }
    assert_eq!(compiled.len(), 2);
    for (c, b) in compiled.iter().zip(&batched) {
        assert_eq!(c["tree"], b["tree"]);
        assert_eq!(c["prediction"], b["prediction"]);
        let (cs, bs) = (
            c["scores"].as_array().unwrap(),
            b["scores"].as_array().unwrap(),
        );
        for (x, y) in cs.iter().zip(bs) {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "compiled {x} vs batched {y}"
            );
        }
    }
    // auto: the same lines as the engine it measured fastest, its choice
    // and the timings behind it on standard error; unknown engines named
    let o = ramus_ok(&[
        "infer",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--input",
        trees.to_str().unwrap(),
        "--engine",
        "auto",
    ]);
    let auto = json_lines(&o);
    let err = stderr(&o);
    let choice = err
        .lines()
        .find(|l| l.starts_with("auto: batches of 2 graphs"))
        .unwrap_or_else(|| panic!("no choice noticed: {err}"));
    assert!(
        choice.contains("cpu-compiled") && choice.contains("cpu-batched") && choice.contains(" ms"),
        "{choice}"
    );
    let chosen = if choice.ends_with(": cpu-compiled") {
        &compiled
    } else {
        assert!(choice.ends_with(": cpu-batched"), "{choice}");
        &batched
    };
    assert_eq!(auto.len(), chosen.len());
    for (a, c) in auto.iter().zip(chosen) {
        assert_eq!(
            (&a["tree"], &a["prediction"]),
            (&c["tree"], &c["prediction"])
        );
        let (xs, ys) = (
            a["scores"].as_array().unwrap(),
            c["scores"].as_array().unwrap(),
        );
        for (x, y) in xs.iter().zip(ys) {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "auto {x} vs {y}");
        }
    }
    assert_one_line_error(
        &ramus(&[
            "infer",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--engine",
            "fast",
        ]),
        "unknown engine `fast` (expected compiled, batched or auto)",
    );
}

#[test]
fn profiled_bench_passes_check_their_inputs_and_device() {
    let trees = tmp("profile-trees.txt");
    std::fs::write(&trees, "(3 (2 not) (1 bad))\n(1 (2 the) (4 film))\n").unwrap();
    let profile = |inputs: &str, device: &str| {
        let t = trees.to_str().unwrap();
        let args = ["bench", t, "--engine", "persistent", "--batch-sizes", "1"];
        ramus(&[&args[..], &["--profile-inputs", inputs, "--device", device]].concat())
    };
    assert_one_line_error(
        &profile("3", "cuda"),
        "--profile-inputs 3: expected 1 to the 2 trees",
    );
    assert_one_line_error(&profile("0", "cpu"), "--profile-inputs 0");
    assert_one_line_error(
        &profile("2", "cpu"),
        "--profile-inputs runs on --device cuda",
    );
}

#[test]
fn compiled_bench_takes_the_recursion_flags_and_ablation_steps() {
    let trees = tmp("recursion-trees.txt");
    std::fs::write(
        &trees,
        "(3 (2 not) (1 (2 very) (1 bad)))\n(1 (2 the) (4 wonderful))\n",
    )
    .unwrap();
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            trees.to_str().unwrap(),
            "--engine",
            "compiled",
            "--hidden",
            "8",
            "--batch-sizes",
            "2",
            "--reps",
            "2",
        ];
        args.extend_from_slice(extra);
        ramus(&args)
    };
    let lines = |o: &Output| -> Vec<serde_json::Value> {
        assert!(o.status.success(), "{}", stderr(o));
        json_lines(o)
    };
    // the ablation: Fig. 11(a) steps, then refactoring and unrolling
    let steps = lines(&bench(&["--model", "treegru", "--ablation"]));
    let got: Vec<(String, bool, bool)> = steps
        .iter()
        .map(|l| {
            (
                l["schedule"].as_str().unwrap().to_string(),
                l["refactor"].as_bool().unwrap(),
                l["unroll"].as_bool().unwrap(),
            )
        })
        .collect();
    let want = [
        ("fusion", false, false),
        ("fusion+specialization", false, false),
        ("fusion+specialization+refactoring", true, false),
        ("fusion+specialization+unrolling", false, true),
        ("fusion+specialization+refactoring+unrolling", true, true),
    ];
    assert_eq!(
        got,
        want.iter()
            .map(|&(n, r, u)| (n.to_string(), r, u))
            .collect::<Vec<_>>()
    );
    // the default refactors a child-sum model on the CPU; the flags override
    let default = lines(&bench(&["--model", "treegru"]));
    assert_eq!(default[0]["refactor"], true);
    assert_eq!(default[0]["unroll"], false);
    let forced = lines(&bench(&["--model", "treegru", "--no-refactor", "--unroll"]));
    assert_eq!(forced[0]["refactor"], false);
    assert_eq!(forced[0]["unroll"], true);
    // nothing to refactor in a Tree-FC: one line naming the model
    assert_one_line_error(
        &bench(&["--model", "treefc", "--refactor"]),
        "nothing to refactor",
    );
    // a flag and its negation conflict
    let o = bench(&["--refactor", "--no-refactor"]);
    assert!(
        !o.status.success() && stderr(&o).contains("--no-refactor"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn bad_input_gives_one_line_errors() {
    assert_one_line_error(
        &ramus(&["train", "--model", "nope", "--epochs", "1"]),
        "unknown model `nope`",
    );
    assert_one_line_error(
        &ramus(&["train", "--data", "/nonexistent/dir", "--epochs", "1"]),
        "/nonexistent/dir",
    );
    let bad = tmp("bad.txt");
    std::fs::write(&bad, "(3 (2 fine) (1 bad)\n").unwrap();
    assert_one_line_error(
        &ramus(&["bench", bad.to_str().unwrap(), "--hidden", "4"]),
        "bad.txt:1:",
    );
    let missing = tmp("missing.safetensors");
    assert_one_line_error(
        &ramus(&[
            "eval",
            "--data",
            bad.to_str().unwrap(),
            "--checkpoint",
            missing.to_str().unwrap(),
        ]),
        "missing.safetensors",
    );
    let garbage = tmp("garbage.safetensors");
    std::fs::write(&garbage, b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ").unwrap();
    assert_one_line_error(
        &ramus(&[
            "eval",
            "--data",
            bad.to_str().unwrap(),
            "--checkpoint",
            garbage.to_str().unwrap(),
        ]),
        "garbage.safetensors",
    );
    assert_one_line_error(
        &ramus(&["train", "--optimizer", "rmsprop", "--epochs", "1"]),
        "rmsprop",
    );
}

#[test]
fn inspect_prints_graphs_and_fusion_plans() {
    let o = ramus_ok(&["inspect", "--model", "treelstm"]);
    let graphs = String::from_utf8_lossy(&o.stdout);
    assert!(graphs.contains("sum_children"), "{graphs}");
    let o = ramus_ok(&["inspect", "--model", "treelstm", "--fusion"]);
    let plans = String::from_utf8_lossy(&o.stdout);
    assert!(plans.contains("== F `internal` per-task"), "{plans}");
    assert!(plans.contains("fused vertex"), "{plans}");
    assert!(plans.contains("in place"), "{plans}");
}

#[test]
fn cuda_without_a_driver_is_a_one_line_error() {
    if ramus_cuda::CudaDevice::available().is_ok() {
        // written to stderr directly: the test harness does not capture it, so CI logs show the skip
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("skipping: a CUDA driver is present\n"),
        );
        return;
    }
    let o = ramus(&["train", "--device", "cuda", "--epochs", "1"]);
    assert_one_line_error(&o, "--device cuda");
    let o = ramus(&[
        "train",
        "--device-memory-budget",
        "1000000",
        "--epochs",
        "1",
    ]);
    assert_one_line_error(&o, "applies to --device cuda");
    // refused before any engine is made, so with or without a GPU
    let o = ramus(&[
        "train",
        "--device",
        "cuda",
        "--engine",
        "persistent",
        "--swap",
        "naive",
    ]);
    assert_one_line_error(&o, "--swap naive: the swap path runs on the batched engine");
    let o = ramus(&["train", "--device", "tpu"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("unknown device `tpu`"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn plan_memory_fits_the_budget_and_explains_a_hopeless_one() {
    let o = ramus_ok(&[
        "plan-memory",
        "--batch-size",
        "200",
        "--hidden",
        "128",
        "--budget-ratio",
        "1.5",
        "--json",
    ]);
    let plan: serde_json::Value =
        serde_json::from_slice(&o.stdout).expect("plan-memory --json prints JSON");
    let budget = plan["budget_bytes"].as_u64().expect("budget");
    let peak = plan["predicted"]["peak_bytes"].as_u64().expect("peak");
    let unplanned = plan["unplanned_peak_bytes"]
        .as_u64()
        .expect("unplanned peak");
    assert!(peak <= budget, "predicted peak {peak} over budget {budget}");
    assert!(unplanned > budget, "the budget should need swapping");
    assert!(plan["actions"].as_array().is_some_and(|a| !a.is_empty()));
    let o = ramus(&[
        "plan-memory",
        "--batch-size",
        "4",
        "--device-memory-budget",
        "1000",
    ]);
    assert_one_line_error(&o, "budget");
}

#[test]
fn train_a_cnn_on_built_in_images_and_inspect_it() {
    let ckpt = tmp("resnet.safetensors");
    let o = ramus_ok(&[
        "train",
        "--model",
        "resnet",
        "--epochs",
        "1",
        "--quiet",
        "--image",
        "3x12x12",
        "--images",
        "160",
        "--hidden",
        "4",
        "--blocks",
        "1,1",
        "--save",
        ckpt.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("built-in synthetic images")
            && out.contains("3x12x12 images, 10 classes")
            && out.contains("optimizer adam lr 0.001")
            && out.contains("epoch 1:")
            && out.contains("img/s"),
        "{out}"
    );
    let test = out
        .lines()
        .find(|l| l.starts_with("test: loss"))
        .unwrap_or_else(|| panic!("no test line: {out}"));
    assert!(
        test.contains(" acc ") && test.contains("(40 images)"),
        "{test}"
    );
    // the checkpoint records the architecture and the class names
    let (info, _) = ramus_nn::checkpoint::read_info(&ckpt).unwrap();
    assert_eq!(info.settings["image"], "3x12x12");
    assert_eq!(info.settings["blocks"], "1,1");
    assert!(info.settings["class_names"].contains("square frame"));
    for model in ["resnet", "alexnet", "vgg19"] {
        let o = ramus(&["inspect", "--model", model]);
        assert!(o.status.success(), "{model}: {}", stderr(&o));
        let listing = String::from_utf8_lossy(&o.stdout);
        assert!(
            listing.contains("conv2d") && listing.contains("W_out"),
            "{model}: {listing}"
        );
    }
    let o = ramus(&["inspect", "--model", "resnet"]);
    let listing = String::from_utf8_lossy(&o.stdout);
    assert!(listing.contains("batch_norm") && listing.contains("s3.b1.proj.W"));
}

#[test]
fn bad_cnn_options_give_one_line_errors() {
    let o = ramus(&["train", "--model", "vgg", "--depth", "12", "--epochs", "1"]);
    assert_one_line_error(&o, "11, 13, 16, 19");
    let o = ramus(&["train", "--model", "resnet", "--depth", "12"]);
    assert_one_line_error(&o, "9n + 2");
    let o = ramus(&["train", "--model", "resnet", "--blocks", "2,x"]);
    assert_one_line_error(&o, "2,x");
    let o = ramus(&["train", "--model", "treefc", "--blocks", "2,2"]);
    assert_one_line_error(&o, "--blocks applies to the CNN models");
    let o = ramus(&["train", "--model", "alexnet", "--depth", "5"]);
    assert_one_line_error(&o, "not `alexnet`");
    let o = ramus(&["train", "--model", "resnet", "--images", "3"]);
    assert_one_line_error(&o, "--images must be at least 4");
    let o = ramus(&["train", "--model", "resnet", "--image", "3x2x2"]);
    assert_one_line_error(&o, "at least 4x4");
    let o = ramus(&["train", "--model", "resnet", "--data", "/nonexistent"]);
    assert_one_line_error(&o, "no train folder");
}

/// Writes `n` images per class of `classes` under `dir/<class>/`: class 0
/// horizontal stripes, 1 vertical stripes, 2 a bright square; `png` or `jpg`.
fn write_images(dir: &std::path::Path, classes: &[&str], n: usize, ext: &str) {
    for (c, name) in classes.iter().enumerate() {
        let sub = dir.join(name);
        std::fs::create_dir_all(&sub).unwrap();
        for i in 0..n {
            let img = image::RgbImage::from_fn(12, 12, |x, y| {
                let phase = i as u32 % 3;
                let on = match c {
                    0 => (y + phase) % 4 < 2,
                    1 => (x + phase) % 4 < 2,
                    _ => (3..9).contains(&(x + phase)) && (3..9).contains(&y),
                };
                let v = if on { 200 + 10 * (i as u8 % 5) } else { 30 };
                image::Rgb([v, v / 2 + 40 * c as u8, 255 - v])
            });
            img.save(sub.join(format!("{i}.{ext}"))).unwrap();
        }
    }
}

#[test]
fn train_and_eval_a_cnn_on_a_directory_of_images() {
    let dir = tmp("images");
    let classes = ["horizontal", "vertical", "square"];
    write_images(&dir.join("train"), &classes, 10, "png");
    write_images(&dir.join("valid"), &classes, 3, "jpg");
    write_images(&dir.join("test"), &classes, 3, "png");
    std::fs::write(dir.join("train/horizontal/notes.txt"), "skipped").unwrap();
    let ckpt = tmp("images.safetensors");
    let o = ramus_ok(&[
        "train",
        "--model",
        "alexnet",
        "--data",
        dir.to_str().unwrap(),
        "--image",
        "3x8x8",
        "--hidden",
        "4",
        "--epochs",
        "2",
        "--batch-size",
        "10",
        "--quiet",
        "--save",
        ckpt.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("(30 train / 9 dev / 9 test, 3x8x8 images, 3 classes)")
            && out.contains("test: loss")
            && out.contains("(9 images)"),
        "{out}"
    );
    let o = ramus_ok(&[
        "eval",
        "--data",
        dir.join("test").to_str().unwrap(),
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["graphs"], 9);
    // a class the model was not trained on, and a file that is no image
    write_images(&dir.join("other"), &["circle"], 1, "png");
    let o = ramus(&[
        "eval",
        "--data",
        dir.join("other").to_str().unwrap(),
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    assert_one_line_error(&o, "class `circle` is not one of the training classes");
    std::fs::write(dir.join("test/square/broken.png"), "not a png").unwrap();
    let o = ramus(&[
        "eval",
        "--data",
        dir.join("test").to_str().unwrap(),
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    assert_one_line_error(&o, "broken.png");
}

#[test]
fn the_checkpoint_records_where_the_loss_was_taken() {
    let ckpt = tmp("loss-at.safetensors");
    ramus_ok(&[
        "train",
        "--model",
        "treelstm",
        "--epochs",
        "1",
        "--hidden",
        "8",
        "--quiet",
        "--loss-at",
        "all",
        "--save",
        ckpt.to_str().unwrap(),
    ]);
    let (info, _) = ramus_nn::checkpoint::read_info(&ckpt).expect("checkpoint");
    assert_eq!(
        info.settings.get("loss_at").map(String::as_str),
        Some("all")
    );
    let trees = tmp("loss-at-trees.txt");
    std::fs::write(&trees, "(3 (2 not) (1 bad))\n").unwrap();
    ramus_ok(&[
        "eval",
        "--data",
        trees.to_str().unwrap(),
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--json",
    ]);
    let o = ramus(&["train", "--loss-at", "leaves", "--epochs", "1"]);
    assert_one_line_error(&o, "--loss-at must be root or all");
}

/// `n` tagged sentences: `w<k>` tagged `C<k % 3>`, or `LATE` before the
/// word `mark`; every 7th word a unique rare word tagged by its case.
fn tagged_text(n: usize) -> String {
    (0..n)
        .map(|s| {
            let len = 3 + s % 5;
            let mark = (s % 2 == 0).then_some(1 + s % (len - 1));
            (0..len)
                .map(|i| match mark {
                    Some(m) if i == m => "mark|MARK".to_string(),
                    Some(m) if i < m => format!("w{}|LATE", (s + i) % 9),
                    _ if (s + i) % 7 == 0 => {
                        let up = s % 3 == 0;
                        format!(
                            "{}x{s}|{}",
                            if up { 'Q' } else { 'q' },
                            if up { "UP" } else { "LOW" }
                        )
                    }
                    _ => format!("w{}|C{}", (s + i) % 9, (s + i) % 9 % 3),
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn train_save_and_eval_the_taggers_on_a_tagged_file() {
    let data = tmp("tagged.txt");
    std::fs::write(&data, tagged_text(120)).unwrap();
    for model in ["bilstm-tagger", "bilstm-char-tagger"] {
        let ckpt = tmp(&format!("{model}.safetensors"));
        let o = ramus_ok(&[
            "train",
            "--model",
            model,
            "--data",
            data.to_str().unwrap(),
            "--epochs",
            "2",
            "--hidden",
            "8",
            "--mlp",
            "8",
            "--char-embed",
            "4",
            "--batch-size",
            "10",
            "--quiet",
            "--save",
            ckpt.to_str().unwrap(),
        ]);
        let out = String::from_utf8_lossy(&o.stdout);
        // 120 sentences split by position: 12 test, 12 dev
        assert!(
            out.contains("(96 train / 12 dev / 12 test, vocabulary"),
            "{out}"
        );
        assert!(out.contains("tag acc") && out.contains("test:"), "{out}");
        let o = ramus_ok(&[
            "eval",
            "--data",
            data.to_str().unwrap(),
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--json",
        ]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["graphs"], 120, "{model}");
        let acc = v["node_accuracy"].as_f64().unwrap();
        assert!(acc > 0.0 && acc <= 1.0, "{model}: {acc}");
        // a tag the model never saw is named with its place
        let bad = tmp("bad-tags.txt");
        std::fs::write(&bad, "w1|C1 w2|NOPE\n").unwrap();
        let o = ramus(&[
            "eval",
            "--data",
            bad.to_str().unwrap(),
            "--checkpoint",
            ckpt.to_str().unwrap(),
        ]);
        assert_one_line_error(&o, "bad-tags.txt:1:7: token w2|NOPE");
    }
    let broken = tmp("broken-tagged.txt");
    std::fs::write(&broken, "a|O b|O\nc|O d\n").unwrap();
    let o = ramus(&[
        "train",
        "--model",
        "bilstm-tagger",
        "--data",
        broken.to_str().unwrap(),
    ]);
    assert_one_line_error(&o, "broken-tagged.txt:2:5: token \"d\" has no `|TAG`");
    let o = ramus(&["train", "--model", "treefc", "--mlp", "8"]);
    assert_one_line_error(&o, "--mlp applies to the sequence models");
    let o = ramus(&[
        "train",
        "--model",
        "bilstm-char-tagger",
        "--hidden",
        "7",
        "--data",
        data.to_str().unwrap(),
    ]);
    assert_one_line_error(&o, "must be even");
}

#[test]
fn bench_the_taggers_and_the_time_delay_networks() {
    let tagged = tmp("bench-tagged.txt");
    std::fs::write(&tagged, tagged_text(40)).unwrap();
    let trees = tmp("bench-trees.txt");
    std::fs::write(
        &trees,
        "(3 (2 a) (4 (2 very) (4 good)))\n(1 (2 not) (3 good))\n",
    )
    .unwrap();
    let bench = |file: &PathBuf, model: &str| -> Vec<serde_json::Value> {
        json_lines(&ramus_ok(&[
            "bench",
            file.to_str().unwrap(),
            "--model",
            model,
            "--hidden",
            "8",
            "--mlp",
            "8",
            "--batch-sizes",
            "1,2",
            "--reps",
            "1",
        ]))
    };
    for model in ["bilstm-tagger", "bilstm-char-tagger"] {
        let lines = bench(&tagged, model);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines.iter().all(|l| l["model"] == model), "{lines:?}");
        // the first training sentences (sentence 0 has 3 words, 1 has 4):
        // a tagger's graph has more vertices than words, and two sentences
        // more than one
        let nodes: Vec<u64> = lines.iter().map(|l| l["nodes"].as_u64().unwrap()).collect();
        assert!(
            nodes[0] > 3 && nodes[1] > nodes[0] + 4,
            "{model}: {nodes:?}"
        );
        assert!(lines[1]["train_sent_per_s"].as_f64().unwrap() > 0.0);
    }
    // time-delay pyramids over 3 and 2 leaves: 3 + 2 + 1 and 2 + 1 vertices
    for model in ["td-rnn", "td-lstm"] {
        let nodes: Vec<u64> = bench(&trees, model)
            .iter()
            .map(|l| l["nodes"].as_u64().unwrap())
            .collect();
        assert_eq!(nodes, [6, 9], "{model}");
    }
    let o = ramus(&[
        "bench",
        tagged.to_str().unwrap(),
        "--model",
        "bilstm-tagger",
        "--grid",
        "3x3",
    ]);
    assert_one_line_error(&o, "`bilstm-tagger` does not read them");
    let o = ramus(&[
        "bench",
        trees.to_str().unwrap(),
        "--model",
        "td-rnn",
        "--anchor",
        "a.py",
    ]);
    assert_one_line_error(&o, "--anchor times the reference treelstm, not `td-rnn`");
    let o = ramus(&["bench", trees.to_str().unwrap(), "--mlp", "8"]);
    assert_one_line_error(&o, "--mlp applies to the sequence models");
    let o = ramus(&["bench", trees.to_str().unwrap(), "--model", "vgg11"]);
    assert_one_line_error(&o, "`vgg11` is a CNN");
}

#[test]
fn train_the_time_delay_networks_and_rvnn_on_tree_files() {
    let dir = tmp("sst-like");
    std::fs::create_dir_all(&dir).unwrap();
    let trees =
        "(3 (2 a) (4 (2 very) (4 good)))\n(1 (2 not) (3 good))\n(0 (1 bad) (2 film))\n(4 good)\n";
    for split in ["train", "dev", "test"] {
        std::fs::write(dir.join(format!("{split}.txt")), trees).unwrap();
    }
    for model in ["td-rnn", "td-lstm", "rvnn"] {
        let o = ramus_ok(&[
            "train",
            "--model",
            model,
            "--data",
            dir.to_str().unwrap(),
            "--epochs",
            "2",
            "--hidden",
            "6",
            "--mlp",
            "5",
            "--quiet",
        ]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains("(4 train / 4 dev / 4 test") && out.contains("root acc"),
            "{out}"
        );
        assert_eq!(out.contains("pyramids"), model != "rvnn", "{out}");
    }
    // without --data and without the shared data the error says where it looked
    let o = Command::new(env!("CARGO_BIN_EXE_ramus"))
        .args(["train", "--model", "td-rnn", "--epochs", "1"])
        .env("RAMUS_DATA", "/nonexistent/data")
        .output()
        .expect("run ramus");
    assert_one_line_error(&o, "/nonexistent/data/sst");
}

#[test]
fn train_the_bilstm_tagger_on_the_shared_wikiner() {
    let root = match std::env::var_os("RAMUS_DATA") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
    };
    if !root.join("wikiner/dev.txt").is_file() {
        eprintln!("skipping: WikiNER not found under {}", root.display());
        return;
    }
    let o = Command::new(env!("CARGO_BIN_EXE_ramus"))
        .args([
            "train",
            "--model",
            "bilstm-tagger",
            "--epochs",
            "1",
            "--hidden",
            "16",
            "--mlp",
            "16",
            "--quiet",
        ])
        .env("RAMUS_DATA", &root)
        .output()
        .expect("run ramus");
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("(1358 train / 169 dev / 169 test, vocabulary"),
        "{out}"
    );
    assert!(out.contains("5 tags") && out.contains("tag acc"), "{out}");
}

#[test]
fn the_persistent_engine_needs_cuda_and_auto_falls_back() {
    let o = ramus(&["train", "--engine", "persistent", "--epochs", "1"]);
    assert_one_line_error(&o, "--engine persistent runs on --device cuda");
    let o = ramus(&["train", "--engine", "warp", "--epochs", "1"]);
    assert!(!o.status.success() && stderr(&o).contains("unknown engine `warp`"));
    // auto on the CPU trains with the batched engine
    let o = ramus_ok(&["train", "--engine", "auto", "--epochs", "1", "--quiet"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("engine cpu-batched"), "{out}");
}
