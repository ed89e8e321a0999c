//! `ramus train` on several GPUs, what can be checked without one: the
//! launcher's and the launch variables' errors, each one line naming the
//! flag or variable.

mod common;

use std::process::Command;

use common::{error_line, stderr};

fn train_with_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ramus"));
    cmd.arg("train").args(args);
    common::outside_a_launcher(&mut cmd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run ramus")
}

#[test]
fn gpus_need_the_cuda_device() {
    let o = train_with_env(&["--gpus", "2", "--epochs", "1"], &[]);
    error_line(&o, &["--gpus 2", "--device cuda"]);
}

/// Launch variables, and what the error must name.
type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);

#[test]
fn launch_variables_are_checked_by_name() {
    let cases: &[Case] = &[
        (&[("RANK", "1"), ("WORLD_SIZE", "2")], &["LOCAL_RANK"]),
        (&[("RANK", "two"), ("WORLD_SIZE", "2")], &["RANK=two"]),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
            &["MASTER_ADDR is not set"],
        ),
    ];
    for (env, needles) in cases {
        let o = train_with_env(&["--epochs", "1"], env);
        error_line(&o, needles);
    }
}

#[test]
fn gpus_that_contradict_the_launcher_are_refused() {
    let env = [
        ("RANK", "0"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let o = train_with_env(&["--gpus", "2", "--epochs", "1"], &env);
    let line = error_line(&o, &["--gpus 2", "2 ranks", "started 4"]);
    assert!(!stderr(&o).contains("panicked"), "{line}");
}

/// `--sync-bn` needs a model with batch norm; on one GPU (a run of
/// several resumed on one, say) it says there is nothing to synchronize.
#[test]
fn synchronized_batch_norm_is_refused_where_it_cannot_apply() {
    let o = train_with_env(&["--sync-bn", "--epochs", "1"], &[]);
    error_line(&o, &["--sync-bn", "has no batch norm"]);
    let resnet = [
        "--model",
        "resnet",
        "--images",
        "40",
        "--sync-bn",
        "--epochs",
        "1",
    ];
    let o = train_with_env(&resnet, &[]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("--sync-bn: one rank") && err.contains("nothing to"),
        "{err}"
    );
}

#[test]
fn a_timeout_no_one_can_mean_is_refused() {
    let o = train_with_env(
        &["--gpus", "2", "--dist-timeout", "0", "--epochs", "1"],
        &[],
    );
    error_line(&o, &["--dist-timeout", "at least 1 second"]);
}

#[test]
fn a_bucket_no_one_can_mean_is_refused() {
    for mib in ["0", "-1", "NaN"] {
        let flag = format!("--bucket-mb={mib}");
        let o = train_with_env(&["--gpus", "2", &flag, "--epochs", "1"], &[]);
        error_line(&o, &["--bucket-mb", "more than 0", mib]);
    }
}

#[test]
fn several_machines_need_consistent_flags() {
    let cases: &[(&[&str], &[&str])] = &[
        (&["--nodes", "2"], &["--nodes 2", "--master ADDRESS:PORT"]),
        (
            &["--nodes", "2", "--node-rank", "2", "--master", "h:1"],
            &["--node-rank 2", "below --nodes 2"],
        ),
        (
            &["--nodes", "2", "--master", "10.0.0.1"],
            &["--master 10.0.0.1", "ADDRESS:PORT"],
        ),
        (
            &["--nodes", "2", "--master", "10.0.0.1:http"],
            &["--master 10.0.0.1:http"],
        ),
        (&["--master", "10.0.0.1:29500"], &["--master", "--nodes"]),
        (&["--gpus", "0"], &["--gpus and --nodes", "at least 1"]),
        (
            &["--nodes", "2", "--master", "127.0.0.1:29500"],
            &["--gpus 1", "--device cuda"],
        ),
    ];
    for (args, needles) in cases {
        let mut args = args.to_vec();
        args.extend(["--epochs", "1"]);
        let o = train_with_env(&args, &[]);
        error_line(&o, needles);
    }
}

#[test]
fn inference_on_several_gpus_needs_the_cuda_device() {
    let o = common::ramus(&[
        "infer",
        "--gpus",
        "2",
        "--checkpoint",
        "nowhere.safetensors",
    ]);
    // the checkpoint is read first: make one that exists
    assert!(!o.status.success());
    let dir = common::fresh_dir("infer-gpus");
    let save = dir.join("m.safetensors");
    common::ramus_ok(&[
        "train",
        "--epochs",
        "1",
        "--quiet",
        "--save",
        save.to_str().unwrap(),
    ]);
    let input = dir.join("in.txt");
    std::fs::write(&input, "(2 (2 a) (2 b))\n").unwrap();
    let (save, input) = (save.to_str().unwrap(), input.to_str().unwrap());
    for (gpus, needles) in [
        ("2", &["--gpus 2", "--device cuda"][..]),
        ("0", &["--gpus", "at least 1"][..]),
    ] {
        let o = common::ramus(&[
            "infer",
            "--gpus",
            gpus,
            "--checkpoint",
            save,
            "--input",
            input,
        ]);
        error_line(&o, needles);
    }
}
