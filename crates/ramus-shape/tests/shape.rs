//! The shape ratchet of issue 31: measures the workspace, prints the report, and fails
//! when a count rose or a new offender appeared against `baseline.json`.
//!
//! `cargo test --release -p ramus-shape --test shape -- --nocapture` shows the report;
//! `RAMUS_SHAPE_UPDATE=1` rewrites the baseline from the current sources (after an
//! improvement, or a move of an offender that the review accepts).

use std::path::PathBuf;
use std::time::Instant;

use ramus_shape::{measure_workspace, Baseline, BASELINE_PATH, UPDATE_COMMAND};

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn shape_does_not_regress_against_the_baseline() {
    let root = workspace_root();
    let started = Instant::now();
    let report =
        measure_workspace(&root).unwrap_or_else(|e| panic!("measuring the workspace: {e}"));
    let elapsed = started.elapsed();
    println!("{}", report.render_text());
    println!("measured in {:.2} s", elapsed.as_secs_f64());

    let path = root.join(BASELINE_PATH);
    let baseline = Baseline::read(&path).unwrap_or_else(|e| panic!("{e}"));
    let current = Baseline::from_report(&report);
    let ratchet = baseline.compare(&current);

    if std::env::var("RAMUS_SHAPE_UPDATE").is_ok_and(|v| v == "1") {
        std::fs::write(&path, current.to_json())
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        println!("\nrewrote {BASELINE_PATH}:");
        for line in ratchet
            .regressions
            .iter()
            .map(|l| format!("  now higher: {l}"))
        {
            println!("{line}");
        }
        for line in ratchet
            .improvements
            .iter()
            .map(|l| format!("  now lower: {l}"))
        {
            println!("{line}");
        }
        return;
    }

    // The file must be in the form the update writes (sorted, one offender a line), so
    // that two branches' baselines merge, or conflict, line by line.
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        text,
        baseline.to_json(),
        "{BASELINE_PATH} is not in its generated form: rewrite it with `{UPDATE_COMMAND}`"
    );

    if !ratchet.improvements.is_empty() {
        println!("\nBetter than {BASELINE_PATH}; lower the baseline with `{UPDATE_COMMAND}`:");
        for line in &ratchet.improvements {
            println!("  {line}");
        }
    }
    assert!(
        ratchet.regressions.is_empty(),
        "the workspace's shape got worse than {BASELINE_PATH} (issue 31: sizes and cycles only \
         go down):\n  {}\nFix the code; if an offender only moved (same size, new file or name), \
         rewrite the baseline with `{UPDATE_COMMAND}` and say so in the commit.",
        ratchet.regressions.join("\n  ")
    );
}
