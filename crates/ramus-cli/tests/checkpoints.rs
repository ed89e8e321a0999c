//! `ramus train`'s checkpoints: destinations checked before training,
//! identical runs writing identical files.

use std::path::PathBuf;

mod common;
use common::*;

/// A short run on the built-in treebank.
const SMALL: [&str; 7] = [
    "train", "--epochs", "1", "--hidden", "8", "--quiet", "--save",
];

#[test]
fn save_destinations_are_checked_before_training() {
    let missing = tmp("no/such/dir/m.safetensors");
    let dir = tmp("a-directory");
    std::fs::create_dir_all(&dir).unwrap();
    for (path, why) in [(&missing, "does not exist"), (&dir, "is a directory")] {
        let mut args = SMALL.to_vec();
        args.push(path.to_str().unwrap());
        let o = ramus(&args);
        let err = stderr(&o);
        assert!(!o.status.success(), "{err}");
        assert!(err.contains("--save") && err.contains(why), "{err}");
        // refused before any epoch ran
        assert!(!stdout(&o).contains("epoch 1"), "{}", stdout(&o));
    }
}

#[test]
fn two_runs_with_the_same_seed_save_identical_files() {
    // several runs: a hash map's order changes from one process to the
    // next, but two processes may happen to agree
    let paths: Vec<PathBuf> = (0..6)
        .map(|i| tmp(&format!("same-{i}.safetensors")))
        .collect();
    for path in &paths {
        let mut args = SMALL.to_vec();
        args.push(path.to_str().unwrap());
        ramus_ok(&args);
    }
    let first = std::fs::read(&paths[0]).unwrap();
    for path in &paths[1..] {
        assert!(
            std::fs::read(path).unwrap() == first,
            "{} differs",
            path.display()
        );
    }
}

#[test]
fn bench_swap_json_destination_is_checked_first() {
    let missing = tmp("no/such/dir/swap.json");
    let o = ramus(&["bench-swap", "--json", missing.to_str().unwrap()]);
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("--json") && err.contains("does not exist"),
        "{err}"
    );
}
