//! `ramus train --log-dir`: the configuration and the metrics lines a run
//! writes, a resumed run appending, and the flags' errors.

mod common;

use common::{error_line, fresh_dir, ramus, ramus_ok};
use serde_json::Value;

fn lines(dir: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

fn of_kind<'a>(records: &'a [Value], kind: &str) -> Vec<&'a Value> {
    records.iter().filter(|r| r["kind"] == kind).collect()
}

#[test]
fn a_run_writes_its_configuration_and_a_line_per_step_epoch_and_test() {
    let dir = fresh_dir("log-dir-run");
    let log = dir.join("log");
    let log_arg = log.to_str().unwrap();
    ramus_ok(&[
        "train",
        "--epochs",
        "2",
        "--quiet",
        "--log-dir",
        log_arg,
        "--log-every",
        "40",
    ]);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(log.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model"], "treelstm-nary");
    assert_eq!(config["engine"], "cpu-batched");
    assert_eq!(config["flags"]["epochs"], serde_json::json!(["2"]));
    assert!(config["parameters"].as_u64().unwrap() > 0, "{config}");
    let records = lines(&log);
    let epochs = of_kind(&records, "epoch");
    assert_eq!(epochs.len(), 2, "{records:?}");
    for (i, e) in epochs.iter().enumerate() {
        assert_eq!(e["epoch"], i + 1);
        assert!(e["train_loss"].as_f64().unwrap() > 0.0, "{e}");
        let acc = e["dev_root_accuracy"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc), "{e}");
        assert!(e["graphs_per_s"].as_f64().unwrap() > 0.0, "{e}");
        assert_eq!(e["lr"], 0.05);
    }
    // the built-in treebank has 120 batches of 25: steps 40, 80, 120 each epoch
    let steps = of_kind(&records, "step");
    let batches: Vec<u64> = steps.iter().map(|s| s["batch"].as_u64().unwrap()).collect();
    assert_eq!(batches, vec![40, 80, 120, 40, 80, 120], "{records:?}");
    assert!(steps.iter().all(|s| s["loss"].as_f64().is_some()));
    let tests = of_kind(&records, "test");
    assert_eq!(tests.len(), 1);
    assert_eq!(records.last().unwrap()["kind"], "test");
    assert!(records
        .windows(2)
        .all(|w| w[0]["unix_s"].as_f64() <= w[1]["unix_s"].as_f64()));
}

#[test]
fn a_resumed_run_appends_to_the_same_metrics() {
    let dir = fresh_dir("log-dir-resume");
    let (save, log) = (dir.join("m.safetensors"), dir.join("log"));
    let (save_arg, log_arg) = (save.to_str().unwrap(), log.to_str().unwrap());
    ramus_ok(&[
        "train",
        "--epochs",
        "1",
        "--quiet",
        "--save",
        save_arg,
        "--log-dir",
        log_arg,
    ]);
    let last = dir.join("m.last.safetensors");
    ramus_ok(&[
        "train",
        "--epochs",
        "2",
        "--quiet",
        "--resume",
        last.to_str().unwrap(),
    ]);
    let epochs: Vec<u64> = of_kind(&lines(&log), "epoch")
        .iter()
        .map(|e| e["epoch"].as_u64().unwrap())
        .collect();
    assert_eq!(epochs, vec![1, 2]);
}

#[test]
fn log_flags_no_one_can_mean_are_refused() {
    let dir = fresh_dir("log-dir-errors");
    let file = dir.join("file");
    std::fs::write(&file, "x").unwrap();
    let under_file = file.join("log");
    let cases: [(&[&str], &[&str]); 3] = [
        (
            &["--log-dir", dir.to_str().unwrap(), "--log-every", "0"],
            &["--log-every"],
        ),
        (&["--log-every", "5"], &["--log-every", "--log-dir"]),
        (
            &["--log-dir", under_file.to_str().unwrap()],
            &["--log-dir", "file/log"],
        ),
    ];
    for (flags, needles) in cases {
        let mut args = vec!["train", "--epochs", "1"];
        args.extend_from_slice(flags);
        error_line(&ramus(&args), needles);
    }
}

#[test]
fn patience_stops_a_run_that_no_longer_improves() {
    let dir = fresh_dir("patience");
    let log = dir.join("log");
    let log_arg = log.to_str().unwrap();
    let args = [
        "train",
        "--epochs",
        "30",
        "--quiet",
        "--patience",
        "2",
        "--log-dir",
        log_arg,
    ];
    let o = ramus_ok(&args);
    let out = common::stdout(&o);
    let records = lines(&log);
    let epochs = of_kind(&records, "epoch");
    let stop = of_kind(&records, "early_stop");
    assert_eq!(stop.len(), 1, "no early stop in 30 epochs: {out}");
    let (at, best) = (
        stop[0]["epoch"].as_u64().unwrap(),
        stop[0]["best_epoch"].as_u64().unwrap(),
    );
    assert_eq!(at, best + 2, "{out}");
    assert_eq!(epochs.len() as u64, at, "{out}");
    assert!(at < 30, "{out}");
    // no epoch after the best one improved on it
    let score = |e: &Value| e["dev_root_accuracy"].as_f64().unwrap();
    let best_score = score(epochs[best as usize - 1]);
    assert!(
        epochs[best as usize..]
            .iter()
            .all(|e| score(e) <= best_score),
        "{out}"
    );
    assert!(
        out.contains(&format!("early stop after epoch {at}")),
        "{out}"
    );
}

#[test]
fn a_patience_of_zero_is_refused() {
    error_line(
        &ramus(&["train", "--epochs", "1", "--patience", "0"]),
        &["--patience"],
    );
}
