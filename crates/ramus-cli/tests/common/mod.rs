//! Running the `ramus` binary in tests: its output, temporary files, and
//! the one-line errors it must give.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

pub fn ramus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ramus"))
        .args(args)
        .output()
        .expect("run ramus")
}

/// Runs `ramus` and fails, showing its stderr, unless it succeeded.
pub fn ramus_ok(args: &[&str]) -> Output {
    let o = ramus(args);
    assert!(o.status.success(), "{}", stderr(&o));
    o
}

/// Each line of the command's standard output as JSON.
pub fn json_lines(o: &std::process::Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ramus-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// Fails unless the command failed with exactly one `error:` line naming `needle`.
pub fn assert_one_line_error(o: &Output, needle: &str) {
    assert!(!o.status.success(), "expected failure");
    let err = stderr(o);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}
