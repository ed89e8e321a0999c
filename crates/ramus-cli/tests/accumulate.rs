//! `ramus train --accumulate K`: K batches a step train as one batch of
//! them all, on the CPU engine and (with a GPU) the CUDA batched and
//! persistent engines and the swap path; flags it cannot honour are
//! refused by name.

mod common;

use std::path::Path;

use common::{error_line, fresh_dir, largest_difference, ramus, ramus_ok, stdout};

/// An epoch of Adam on the built-in trees, saved to `save`, with `extra`
/// (a small rate: at the default one, float rounding grows over the
/// epoch's 250 steps into visible differences between any two orders of
/// summing).
fn train(save: &Path, extra: &[&str]) -> String {
    train_at("0.001", save, extra)
}

/// [`train`] at the rate `lr`.
fn train_at(lr: &str, save: &Path, extra: &[&str]) -> String {
    let mut args = vec!["train", "--epochs", "1", "--hidden", "16", "--seed", "5"];
    args.extend(["--optimizer", "adam", "--lr", lr]);
    let save = save.to_str().expect("a UTF-8 path");
    args.extend(["--save", save]);
    args.extend_from_slice(extra);
    stdout(&ramus_ok(&args))
}

/// One batch of 12 against 3 batches of 4 a step, with `device` flags.
fn check(name: &str, device: &[&str], engine: &[&str]) {
    let dir = fresh_dir(name);
    let (big, small) = (dir.join("big.safetensors"), dir.join("small.safetensors"));
    train(&big, &[device, &["--batch-size", "12"]].concat());
    let log = train(
        &small,
        &[device, engine, &["--batch-size", "4", "--accumulate", "3"]].concat(),
    );
    let d = largest_difference(&big, &small);
    // the same steps, their sums in another order
    assert!(
        d < 2e-4,
        "{name}: parameters differ by {d} (relative)\n{log}"
    );
}

#[test]
fn three_batches_a_step_train_as_one_batch_of_them_all() {
    check("accumulate-cpu", &[], &[]);
}

#[test]
fn on_a_gpu_batched_persistent_and_swapping() {
    if let Err(e) = ramus_cuda::CudaDevice::probe(0) {
        eprintln!("skipping: no GPU ({e})");
        return;
    }
    check(
        "accumulate-cuda",
        &["--device", "cuda"],
        &["--engine", "batched"],
    );
    check(
        "accumulate-persistent",
        &["--device", "cuda"],
        &["--engine", "persistent"],
    );
    check(
        "accumulate-swap",
        &["--device", "cuda"],
        &["--swap", "naive"],
    );
}

#[test]
fn flags_it_cannot_honour_are_refused() {
    error_line(
        &ramus(&["train", "--accumulate", "0"]),
        &["--accumulate", "at least 1"],
    );
    let dir = fresh_dir("accumulate-flags");
    let save = dir.join("m.safetensors");
    let save = save.to_str().expect("a UTF-8 path");
    error_line(
        &ramus(&[
            "train",
            "--accumulate",
            "3",
            "--checkpoint-every",
            "4",
            "--save",
            save,
        ]),
        &["--checkpoint-every 4", "--accumulate 3", "multiple of 3"],
    );
}

/// Per-parameter rates on the persistent engine: its updates leave the
/// kernel (as for accumulation), so a frozen word table stays as it
/// started while the other parameters train.
#[test]
fn the_persistent_engine_freezes_embeddings_with_split_updates() {
    if let Err(e) = ramus_cuda::CudaDevice::probe(0) {
        eprintln!("skipping: no GPU ({e})");
        return;
    }
    let dir = fresh_dir("accumulate-freeze");
    let gpu = [
        "--device",
        "cuda",
        "--engine",
        "persistent",
        "--batch-size",
        "8",
    ];
    let (start, frozen) = (
        dir.join("start.safetensors"),
        dir.join("frozen.safetensors"),
    );
    train_at("0", &start, &gpu);
    let log = train(&frozen, &[&gpu[..], &["--freeze-embeddings"]].concat());
    assert!(log.contains("cuda-persistent"), "{log}");
    let (a, b) = (
        common::saved_tensors(&start),
        common::saved_tensors(&frozen),
    );
    assert_eq!(a["emb"], b["emb"], "the frozen table moved");
    assert_ne!(a["W_out"], b["W_out"], "the classifier did not train");
}
