//! `ramus-shape [--json] [WORKSPACE]`: prints the workspace's shape report (text, or JSON
//! with `--json`). WORKSPACE defaults to the one this crate was built in.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: ramus-shape [--json] [WORKSPACE]";

fn main() -> ExitCode {
    let mut json = false;
    let mut root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--json" => json = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            flag if flag.starts_with('-') => {
                eprintln!("ramus-shape: unknown flag {flag} ({USAGE})");
                return ExitCode::from(2);
            }
            path => root = PathBuf::from(path),
        }
    }
    let report = match ramus_shape::measure_workspace(&root) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("ramus-shape: {e}");
            return ExitCode::FAILURE;
        }
    };
    let text = if json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => text + "\n",
            Err(e) => {
                eprintln!("ramus-shape: the report as JSON: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        report.render_text()
    };
    // A closed pipe (`| head`) is no error of the measurement.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    ExitCode::SUCCESS
}
