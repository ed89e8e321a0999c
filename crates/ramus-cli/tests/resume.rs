//! `ramus train --resume`: a run killed at random moments (SIGKILL) and
//! resumed from its last checkpoint each time ends with the very bytes of
//! the run never interrupted; SIGTERM saves and says how to resume; flags
//! that contradict the checkpoint and other data are refused; resuming a
//! finished run finishes cleanly; a resumable checkpoint evaluates as a
//! plain one.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::*;

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ramus"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ramus")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The run every test interrupts: the built-in treebank, small, with
/// dropout (so the dropout stream must resume too), Adam (two moments).
const RUN: [&str; 12] = [
    "train",
    "--epochs",
    "4",
    "--hidden",
    "8",
    "--dropout",
    "0.2",
    "--optimizer",
    "adam",
    "--lr",
    "0.01",
    "--quiet",
];

/// Trains `RUN` uninterrupted, saving to `save`.
fn reference(save: &Path) -> Vec<u8> {
    let mut args = RUN.to_vec();
    args.extend(["--save", s(save)]);
    ramus_ok(&args);
    std::fs::read(save).unwrap()
}

/// A small random stream for kill times (seeded from the clock; printed).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

#[test]
fn killed_at_random_batches_and_resumed_ends_bit_identical() {
    let d = fresh_dir("kill");
    let expected = reference(&d.join("reference.safetensors"));
    let save = d.join("run.safetensors");
    let ckpts = d.join("ckpt");
    let last = ckpts.join("last.safetensors");
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("kill times seeded with {seed}");
    let mut rng = Lcg(seed);
    let (mut kills, mut landed, mut resumed) = (0, 0, 0);
    let mut args: Vec<String> = RUN.iter().map(|a| a.to_string()).collect();
    args.extend(
        [
            "--save",
            s(&save),
            "--checkpoint-dir",
            s(&ckpts),
            "--checkpoint-every",
            "7",
        ]
        .map(String::from),
    );
    loop {
        let argv: Vec<&str> = if last.exists() {
            resumed += 1;
            vec!["train", "--resume", s(&last)]
        } else {
            args.iter().map(String::as_str).collect()
        };
        let mut child = spawn(&argv);
        if kills == 6 {
            // the last one runs to the end
            let o = child.wait_with_output().unwrap();
            assert!(o.status.success(), "{}", stderr(&o));
            break;
        }
        std::thread::sleep(Duration::from_millis(20 + rng.below(300)));
        landed += usize::from(child.try_wait().unwrap().is_none());
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        kills += 1;
    }
    eprintln!("{kills} kills, {landed} while training, {resumed} resumed runs");
    assert!(landed > 0, "every run had finished before its kill");
    assert!(resumed > 1, "no kill came after a checkpoint");
    assert!(
        std::fs::read(&save).unwrap() == expected,
        "the resumed run's parameters differ from the uninterrupted run's"
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn sigterm_saves_says_how_to_resume_and_resumes_exactly() {
    let d = fresh_dir("term");
    let expected = reference(&d.join("reference.safetensors"));
    let save = d.join("run.safetensors");
    // checkpoints beside --save: run.last.safetensors, run.best.safetensors
    let last = d.join("run.last.safetensors");
    let mut args = RUN.to_vec();
    args.extend(["--save", s(&save), "--checkpoint-every", "5"]);
    let child = spawn(&args);
    let started = Instant::now();
    while !last.exists() && started.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(2));
    }
    let pid = child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("interrupted") && err.contains(&format!("--resume {}", last.display())),
        "{err}"
    );
    let o = ramus_ok(&["train", "--resume", s(&last)]);
    assert!(stdout(&o).contains("resuming"), "{}", stdout(&o));
    assert!(std::fs::read(&save).unwrap() == expected);
    // resuming the finished run finishes cleanly: nothing left to train,
    // the same model tested and saved again
    let o = ramus(&["train", "--resume", s(&last)]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains("epoch 5, batch 0") && !out.contains("epoch 4:"),
        "{out}"
    );
    assert!(std::fs::read(&save).unwrap() == expected);
    // a resumable checkpoint is a plain one too
    let trees = d.join("trees.txt");
    std::fs::write(&trees, "(3 (2 not) (1 bad))\n(1 (2 the) (4 wonderful))\n").unwrap();
    for ckpt in [&last, &d.join("run.best.safetensors")] {
        let o = ramus_ok(&["eval", "--data", s(&trees), "--checkpoint", s(ckpt)]);
        assert!(stdout(&o).contains("2 graphs"), "{}", stdout(&o));
    }
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn resuming_with_contradicting_flags_or_other_data_is_refused() {
    let d = fresh_dir("refuse");
    let save = d.join("run.safetensors");
    let mut args = RUN.to_vec();
    args.extend(["--epochs", "1", "--save", s(&save)]);
    let args: Vec<&str> = args
        .iter()
        .enumerate()
        .filter(|&(i, _)| !(1..=2).contains(&i)) // the first --epochs
        .map(|(_, a)| *a)
        .collect();
    ramus_ok(&args);
    let last = d.join("run.last.safetensors");
    let o = ramus(&[
        "train",
        "--resume",
        s(&last),
        "--hidden",
        "9",
        "--seed",
        "2",
        "--epochs",
        "2",
    ]);
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("--hidden 9") && err.contains("--seed 2") && !err.contains("--epochs"),
        "{err}"
    );
    // the same flags with the same values are fine (no training left)
    ramus_ok(&["train", "--resume", s(&last), "--hidden", "8"]);
    // more epochs may be asked for, and the next resume remembers them
    let o = ramus_ok(&["train", "--resume", s(&last), "--epochs", "2"]);
    assert!(stdout(&o).contains("epoch 2:"), "{}", stdout(&o));
    let o = ramus(&["train", "--resume", s(&last)]);
    let out = stdout(&o);
    assert!(
        out.contains("epoch 3, batch 0") && !out.contains("epoch 2:"),
        "{out}"
    );
    // other data: refused, naming it
    let data = d.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let tree = "(3 (2 not) (1 bad))\n";
    write_files(
        &data,
        &[("train.txt", tree), ("dev.txt", tree), ("test.txt", tree)],
    );
    let o = ramus(&["train", "--resume", s(&last), "--data", s(&data)]);
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("--resume") && err.contains("data differs"),
        "{err}"
    );
    // a plain checkpoint has no run state to resume
    let o = ramus(&["train", "--resume", s(&save)]);
    let err = stderr(&o);
    assert!(
        !o.status.success() && err.contains("not a resumable checkpoint"),
        "{err}"
    );
    // --checkpoint-every needs somewhere to write
    let o = ramus(&["train", "--checkpoint-every", "3"]);
    assert!(stderr(&o).contains("--checkpoint-dir or --save"));
    std::fs::remove_dir_all(&d).ok();
}
