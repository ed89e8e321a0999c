//! Running the `ramus` binary in tests: its output, temporary files, and
//! the one-line errors it must give.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

pub fn ramus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ramus"))
        .args(args)
        .output()
        .expect("run ramus")
}

/// Starts `ramus` with every stream piped, writes `input` to its standard
/// input and closes it.
pub fn spawn_with_stdin(args: &[&str], input: &[u8]) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ramus"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ramus");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input).expect("write stdin");
    child
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

/// `name` in this test process's temporary directory.
pub fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ramus-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A new, empty directory `name` in this test process's temporary directory.
pub fn fresh_dir(name: &str) -> PathBuf {
    let d = tmp(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `files` (name, contents) into the directory `dir`.
pub fn write_files(dir: &Path, files: &[(&str, &str)]) {
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// Fails unless the command failed with exactly one `error:` line
/// containing every needle; returns that line.
pub fn error_line(o: &Output, needles: &[&str]) -> String {
    let err = stderr(o);
    assert!(
        !o.status.success(),
        "expected failure; stdout:\n{}",
        stdout(o)
    );
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    for needle in needles {
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains(needle),
            "no `{needle}` in: {err}"
        );
    }
    assert!(!err.contains("panicked"), "{err}");
    lines[0].to_string()
}

/// Fails unless the command failed with exactly one `error:` line naming `needle`.
pub fn assert_one_line_error(o: &Output, needle: &str) {
    error_line(o, &[needle]);
}

/// Every f32 tensor of a saved safetensors model, by name.
pub fn saved_tensors(path: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, v)| v["dtype"] == "F32")
        .map(|(name, v)| {
            let at = |i: usize| v["data_offsets"][i].as_u64().unwrap() as usize;
            let values = data[at(0)..at(1)]
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name.clone(), values)
        })
        .collect()
}

/// `cmd` without the variables a launcher (torchrun, the `--gpus` launcher)
/// sets, as if started by hand.
pub fn outside_a_launcher(cmd: &mut Command) {
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        cmd.env_remove(var);
    }
}

/// The largest difference between two saved models' parameters, relative
/// to each tensor's largest value.
pub fn largest_difference(a: &Path, b: &Path) -> f32 {
    let (a, b) = (saved_tensors(a), saved_tensors(b));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .map(|(name, x)| {
            let y = &b[name];
            let scale = x.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            let d = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            d / scale
        })
        .fold(0.0, f32::max)
}
