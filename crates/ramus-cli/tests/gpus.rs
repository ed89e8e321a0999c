//! `ramus train` on several GPUs, end to end (skipped without two GPUs and
//! NCCL): `--gpus 2` on one machine, the same run as two machines
//! (two launchers, `--nodes 2`, NCCL on its socket transport) and one GPU
//! at twice the batch train to the same parameters.

mod common;

use std::path::Path;
use std::process::Command;

use common::{fresh_dir, largest_difference, stderr};

/// A short SGD run on the built-in trees, saved to `save`, with `extra`
/// flags and `env`.
fn train(save: &Path, extra: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ramus"));
    cmd.args(["train", "--device", "cuda", "--quiet", "--epochs", "2"])
        .args(["--hidden", "16", "--optimizer", "sgd", "--seed", "5"])
        .arg("--save")
        .arg(save)
        .args(extra)
        .env("NCCL_NVLS_ENABLE", "0");
    common::outside_a_launcher(&mut cmd);
    cmd.envs(env.iter().copied());
    cmd
}

fn succeeds(mut cmd: Command) {
    let o = cmd.output().expect("run ramus");
    assert!(o.status.success(), "{}", stderr(&o));
}

fn two_gpus() -> bool {
    if let Err(e) = ramus_cuda::CudaDevice::probe(1) {
        eprintln!("skipping: two GPUs are needed ({e})");
        return false;
    }
    if let Err(e) = ramus_cuda::nccl::check_library() {
        eprintln!("skipping: {e}");
        return false;
    }
    true
}

#[test]
fn two_gpus_two_machines_and_one_gpu_at_twice_the_batch_agree() {
    if !two_gpus() {
        return;
    }
    let dir = fresh_dir("gpus-agree");
    let (one, two, nodes) = (
        dir.join("one.safetensors"),
        dir.join("two.safetensors"),
        dir.join("nodes.safetensors"),
    );
    succeeds(train(&one, &["--batch-size", "16"], &[]));
    succeeds(train(&two, &["--batch-size", "8", "--gpus", "2"], &[]));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
        .to_string();
    let master = format!("127.0.0.1:{port}");
    let sockets = [("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")];
    let machines: Vec<_> = (0..2)
        .map(|node| {
            let rank = node.to_string();
            let flags = [
                "--batch-size",
                "8",
                "--nodes",
                "2",
                "--node-rank",
                &rank,
                "--master",
                &master,
            ];
            // the second machine's one GPU is this host's second
            let gpu = [("CUDA_VISIBLE_DEVICES", if node == 0 { "0" } else { "1" })];
            train(&nodes, &flags, &[&sockets[..], &gpu[..]].concat())
                .spawn()
                .expect("start a launcher")
        })
        .collect();
    for m in machines {
        let o = m.wait_with_output().expect("wait for a launcher");
        assert!(o.status.success(), "{}", stderr(&o));
    }
    // the two-GPU runs sum the same two gradients: the same parameters
    let between_launches = largest_difference(&two, &nodes);
    assert!(between_launches < 1e-6, "{between_launches}");
    // one GPU sums the batch's gradients in another order: float rounding
    let against_one = largest_difference(&one, &two);
    assert!(against_one < 2e-4, "{against_one}");
}

#[test]
fn a_run_on_two_gpus_resumes_on_one() {
    if !two_gpus() {
        return;
    }
    let dir = fresh_dir("gpus-resume");
    let (save, last) = (dir.join("m.safetensors"), dir.join("ckpt"));
    let ckpt = last.to_str().unwrap();
    let mut first = train(&save, &["--batch-size", "8", "--gpus", "2"], &[]);
    first.args(["--checkpoint-dir", ckpt]);
    succeeds(first);
    let resume = last.join("last.safetensors");
    let o = Command::new(env!("CARGO_BIN_EXE_ramus"))
        .args(["train", "--epochs", "3", "--resume"])
        .arg(&resume)
        .args(["--gpus", "1"])
        .env("NCCL_NVLS_ENABLE", "0")
        .output()
        .expect("run ramus");
    let text = format!("{}{}", common::stdout(&o), stderr(&o));
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains("resuming on 1 GPU(s) a run saved on 2: 8 graphs a step instead of 16"),
        "{text}"
    );
    assert!(text.contains("test:"), "{text}");
}

#[test]
fn inference_split_over_two_gpus_prints_what_one_gpu_prints() {
    if !two_gpus() {
        return;
    }
    let dir = fresh_dir("gpus-infer");
    let trees = "(3 (2 the) (3 cat))\n(1 (2 a) (1 dog))\n(2 (2 the) (2 (2 big) (2 dog)))\n";
    let many = trees.repeat(9);
    common::write_files(
        &dir,
        &[
            ("train.txt", trees),
            ("dev.txt", trees),
            ("test.txt", trees),
            ("input.txt", many.as_str()),
        ],
    );
    let save = dir.join("m.safetensors");
    let mut cmd = train(&save, &["--batch-size", "2"], &[]);
    cmd.arg("--data").arg(&dir);
    succeeds(cmd);
    let infer = |engine: &str, gpus: &str| {
        let o = common::ramus_ok(&[
            "infer",
            "--device",
            "cuda",
            "--engine",
            engine,
            "--batch-size",
            "4",
            "--gpus",
            gpus,
            "--checkpoint",
            save.to_str().unwrap(),
            "--input",
            dir.join("input.txt").to_str().unwrap(),
        ]);
        common::json_lines(&o)
    };
    for engine in ["compiled", "batched"] {
        let (one, two) = (infer(engine, "1"), infer(engine, "2"));
        assert_eq!(one.len(), 27, "{engine}");
        assert_eq!(two.len(), one.len(), "{engine}");
        for (a, b) in one.iter().zip(&two) {
            assert_eq!(a["tree"], b["tree"], "{engine}");
            assert_eq!(a["prediction"], b["prediction"], "{engine}: {a} {b}");
            let scores = |v: &serde_json::Value| -> Vec<f64> {
                v["scores"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect()
            };
            for (x, y) in scores(a).iter().zip(scores(b)) {
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                    "{engine}: {a} {b}"
                );
            }
        }
    }
}

/// A ResNet (batch norm) on two GPUs, with checkpoints within the epochs:
/// every rank averages its running statistics at each checkpoint and each
/// evaluation (a rank missing one would leave the others waiting until the
/// timeout), and the run trains.
#[test]
fn a_resnet_trains_on_two_gpus_with_checkpoints() {
    if !two_gpus() {
        return;
    }
    let dir = fresh_dir("gpus-resnet");
    let ckpt = dir.join("ckpt");
    let o = Command::new(env!("CARGO_BIN_EXE_ramus"))
        .args([
            "train", "--device", "cuda", "--model", "resnet", "--epochs", "2",
        ])
        .args(["--batch-size", "16", "--gpus", "2", "--dist-timeout", "60"])
        .args(["--checkpoint-every", "5", "--checkpoint-dir"])
        .arg(&ckpt)
        .env("NCCL_NVLS_ENABLE", "0")
        .output()
        .expect("run ramus");
    let text = format!("{}{}", common::stdout(&o), stderr(&o));
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains("epoch 2:") && text.contains("test:"),
        "{text}"
    );
    assert!(ckpt.join("last.safetensors").exists(), "{text}");
}

/// The swap path on two GPUs: its op-by-op steps, summed over the ranks,
/// train as the plain engine on one GPU at twice the batch.
#[test]
fn the_swap_path_on_two_gpus_trains_as_one_gpu() {
    if !two_gpus() {
        return;
    }
    let dir = fresh_dir("gpus-swap");
    let (one, two) = (dir.join("one.safetensors"), dir.join("two.safetensors"));
    succeeds(train(&one, &["--batch-size", "16"], &[]));
    let swapping = ["--batch-size", "8", "--gpus", "2", "--swap", "naive"];
    succeeds(train(&two, &swapping, &[]));
    let d = largest_difference(&one, &two);
    assert!(d < 2e-4, "{d}");
}

/// `--sync-bn`: two GPUs at B images normalise with the statistics of all
/// 2·B, so they train as one GPU at 2·B (running statistics included),
/// with the swap path too.
#[test]
fn synchronized_batch_norm_on_two_gpus_trains_as_one_gpu() {
    if !two_gpus() {
        return;
    }
    let dir = fresh_dir("gpus-sync-bn");
    let resnet = ["--model", "resnet", "--images", "200"];
    let run = |save: &Path, extra: &[&str]| {
        let mut cmd = train(save, &resnet, &[]);
        cmd.args(extra);
        succeeds(cmd);
    };
    let one = dir.join("one.safetensors");
    run(&one, &["--batch-size", "16"]);
    for (name, extra) in [("two", &[][..]), ("swap", &["--swap", "naive"][..])] {
        let two = dir.join(format!("{name}.safetensors"));
        let flags = [
            &["--batch-size", "8", "--gpus", "2", "--sync-bn"][..],
            extra,
        ]
        .concat();
        run(&two, &flags);
        let d = largest_difference(&one, &two);
        assert!(d < 2e-4, "{name}: {d}");
    }
}
