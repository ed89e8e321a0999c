//! `ramus train --log-dir DIR`: the run's configuration (`config.json`,
//! written whole) and one JSON object a line in `metrics.jsonl` for every
//! logged step (`--log-every N` batches), every epoch and the test
//! evaluation, so that runs can be plotted and compared. Each line is
//! written with one call and flushed, so a run killed at any point leaves
//! whole lines; a resumed run appends to the same file.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::result::AnyResult;

/// The open metrics file of a run.
pub(crate) struct RunLog {
    path: PathBuf,
    file: File,
    /// Log a step every this many batches (`--log-every`); `None`: epochs only.
    pub every: Option<usize>,
}

impl RunLog {
    /// Creates `dir` if needed, writes `config.json` there and opens
    /// `metrics.jsonl` for appending; errors name `--log-dir` and the file.
    pub fn open(dir: &Path, config: &Value, every: Option<usize>) -> AnyResult<Self> {
        let bad = |what: &Path, e: &dyn std::fmt::Display| {
            format!("--log-dir {}: {}: {e}", dir.display(), what.display())
        };
        std::fs::create_dir_all(dir).map_err(|e| bad(dir, &e))?;
        let config_path = dir.join("config.json");
        let text = serde_json::to_string_pretty(config).map_err(|e| bad(&config_path, &e))?;
        ramus_exec::atomic::write_atomic(&config_path, format!("{text}\n").as_bytes())
            .map_err(|e| bad(&config_path, &e))?;
        let path = dir.join("metrics.jsonl");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| bad(&path, &e))?;
        Ok(RunLog { path, file, every })
    }

    /// Appends `record` (an object) with its `kind` and the wall-clock
    /// time (`unix_s`) as one line.
    pub fn record(&mut self, kind: &str, mut record: Value) -> AnyResult {
        if let Some(fields) = record.as_object_mut() {
            fields.insert("kind".into(), json!(kind));
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            fields.insert("unix_s".into(), json!(now));
        }
        let line = format!("{record}\n");
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|e| format!("--log-dir: {}: {e}", self.path.display()).into())
    }

    /// Whether batch `batch` (counted from 1) is a logged step.
    pub fn logs_step(&self, batch: usize) -> bool {
        self.every.is_some_and(|n| batch.is_multiple_of(n))
    }
}

/// A number for JSON: `null` where it is not finite (JSON has no NaN).
pub(crate) fn finite(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}
