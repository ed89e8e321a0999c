//! Reading the run directories `ramus train --log-dir` writes (see
//! `metrics.rs`): the curves of `metrics.jsonl` and, from `config.json`,
//! the model (which accuracies it reports) and the training split's size
//! (where within its epoch a logged step falls).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ramus_nn::DataKind;
use serde_json::Value;

use crate::result::AnyResult;

/// Points of a curve: (epoch, value), the epoch fractional for steps.
pub(super) type Curve = Vec<(f64, f64)>;

/// Which dev accuracies a run's model reports (as `ramus train` logs them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Accuracies {
    pub root: bool,
    pub node: bool,
}

/// One run's curves.
#[derive(Debug)]
pub(super) struct Run {
    /// The legend's name: the directory's name (its path where two runs'
    /// names are the same).
    pub name: String,
    pub train_loss: Curve,
    pub dev_loss: Curve,
    /// The loss of every `--log-every` step, at its place in its epoch.
    pub step_loss: Curve,
    /// Dev accuracies in percent.
    pub root_accuracy: Curve,
    pub node_accuracy: Curve,
    pub accuracies: Accuracies,
}

/// An epoch record's values.
#[derive(Default)]
struct Epoch {
    train_loss: Option<f64>,
    dev_loss: Option<f64>,
    root: Option<f64>,
    node: Option<f64>,
}

/// The value of `key` in `record`: `None` where it is missing or `null`
/// (a loss that was not finite); an error naming `at` where it is not a
/// number.
fn number(record: &Value, key: &str, at: &str) -> AnyResult<Option<f64>> {
    match record.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("{at}: `{key}` is {v}, not a number").into()),
    }
}

/// The whole number `key` (at least 1) a record cannot do without.
fn counter(record: &Value, kind: &str, key: &str, at: &str) -> AnyResult<u64> {
    match record.get(key).and_then(Value::as_u64) {
        Some(n) if n >= 1 => Ok(n),
        _ => Err(format!("{at}: {kind} record without a whole `{key}` of at least 1").into()),
    }
}

/// What `config.json` tells the plot: the model's accuracies and the
/// training split's size. Both sides' accuracies and no size where the file
/// is missing (a run directory from elsewhere); a malformed one is an error.
fn read_config(dir: &Path) -> AnyResult<(Accuracies, Option<f64>)> {
    let path = dir.join("config.json");
    let both = Accuracies {
        root: true,
        node: true,
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((both, None)),
        Err(e) => return Err(format!("{}: {e}", path.display()).into()),
    };
    let config: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let kind = config["model"].as_str().and_then(ramus_nn::data_kind);
    let accuracies = match kind {
        Some(DataKind::Images) => Accuracies {
            root: true,
            node: false,
        },
        Some(DataKind::Tagged { .. }) => Accuracies {
            root: false,
            node: true,
        },
        _ => both,
    };
    let train = config["graphs"]["train"].as_f64().filter(|&n| n > 0.0);
    Ok((accuracies, train))
}

/// Reads the run in `dir`: its `metrics.jsonl`, whose malformed lines are
/// errors naming the file and line (an epoch or step logged twice, as a
/// resumed run may, keeps its last record), and its `config.json`.
pub(super) fn read_run(dir: &Path) -> AnyResult<Run> {
    if !dir.is_dir() {
        return Err(format!(
            "{}: no such directory (expected a `ramus train --log-dir` directory)",
            dir.display()
        )
        .into());
    }
    let path = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "{}: {e} (expected the metrics of `ramus train --log-dir {}`)",
            path.display(),
            dir.display()
        )
    })?;
    let (accuracies, train_graphs) = read_config(dir)?;
    let mut epochs: BTreeMap<u64, Epoch> = BTreeMap::new();
    // (epoch, batch) -> (graphs seen in the epoch, loss)
    let mut steps: BTreeMap<(u64, u64), (Option<f64>, Option<f64>)> = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), i + 1);
        let record: Value = serde_json::from_str(line).map_err(|e| format!("{at}: {e}"))?;
        let kind = record
            .get("kind")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{at}: a record without a `kind`"))?;
        match kind {
            "epoch" => {
                let epoch = counter(&record, kind, "epoch", &at)?;
                let percent = |key| {
                    Ok::<_, Box<dyn std::error::Error>>(
                        number(&record, key, &at)?.map(|a| 100.0 * a),
                    )
                };
                let e = Epoch {
                    train_loss: number(&record, "train_loss", &at)?,
                    dev_loss: number(&record, "dev_loss", &at)?,
                    root: percent("dev_root_accuracy")?,
                    node: percent("dev_node_accuracy")?,
                };
                epochs.insert(epoch, e);
            }
            "step" => {
                let epoch = counter(&record, kind, "epoch", &at)?;
                let batch = counter(&record, kind, "batch", &at)?;
                let graphs = number(&record, "graphs", &at)?;
                steps.insert((epoch, batch), (graphs, number(&record, "loss", &at)?));
            }
            // the test evaluation, an early stop, kinds of later versions
            _ => {}
        }
    }
    if epochs.is_empty() && steps.is_empty() {
        return Err(format!("{}: no epoch or step records to plot", path.display()).into());
    }
    let curve = |of: fn(&Epoch) -> Option<f64>| -> Curve {
        epochs
            .iter()
            .filter_map(|(&n, e)| of(e).map(|v| (n as f64, v)))
            .collect()
    };
    // a step's place in its epoch: graphs seen of the training split, or
    // (no config) its batch of the most batches logged in an epoch
    let most = steps.keys().map(|&(_, b)| b).max().unwrap_or(1) as f64;
    let step_loss = steps
        .iter()
        .filter_map(|(&(epoch, batch), &(graphs, loss))| {
            let within = match (graphs, train_graphs) {
                (Some(g), Some(n)) => g / n,
                _ => batch as f64 / most,
            };
            Some((epoch as f64 - 1.0 + within.clamp(0.0, 1.0), loss?))
        })
        .collect();
    Ok(Run {
        name: String::new(),
        train_loss: curve(|e| e.train_loss),
        dev_loss: curve(|e| e.dev_loss),
        step_loss,
        root_accuracy: curve(|e| e.root),
        node_accuracy: curve(|e| e.node),
        accuracies,
    })
}

/// Reads every run, named by its directory (by the path as given where
/// two directories have the same name).
pub(super) fn read_runs(dirs: &[PathBuf]) -> AnyResult<Vec<Run>> {
    let short = |d: &Path| {
        d.file_name().map_or_else(
            || d.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    };
    let names: Vec<String> = dirs.iter().map(|d| short(d)).collect();
    dirs.iter()
        .zip(&names)
        .map(|(dir, name)| {
            let mut run = read_run(dir)?;
            let clash = names.iter().filter(|n| *n == name).count() > 1;
            run.name = if clash {
                dir.display().to_string()
            } else {
                name.clone()
            };
            Ok(run)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_dir(name: &str, metrics: &str, config: Option<&str>) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ramus-plot-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("metrics.jsonl"), metrics).unwrap();
        if let Some(c) = config {
            std::fs::write(d.join("config.json"), c).unwrap();
        }
        d
    }

    #[test]
    fn curves_come_from_epoch_and_step_records() {
        let metrics = r#"{"kind":"step","epoch":1,"batch":2,"graphs":50,"loss":1.5}
{"kind":"epoch","epoch":1,"train_loss":1.2,"dev_loss":1.1,"dev_root_accuracy":0.5,"dev_node_accuracy":0.25}
{"kind":"step","epoch":2,"batch":4,"graphs":100,"loss":null}
{"kind":"epoch","epoch":2,"train_loss":0.9,"dev_loss":null,"dev_root_accuracy":0.75,"dev_node_accuracy":0.5}

{"kind":"epoch","epoch":2,"train_loss":0.8,"dev_loss":0.7,"dev_root_accuracy":0.75,"dev_node_accuracy":0.5}
{"kind":"test","test_loss":0.7}
{"kind":"early_stop","epoch":2,"best_epoch":1}
"#;
        let config = r#"{"model":"bilstm-tagger","graphs":{"train":100}}"#;
        let run = read_run(&run_dir("curves", metrics, Some(config))).unwrap();
        assert_eq!(run.train_loss, vec![(1.0, 1.2), (2.0, 0.8)]);
        assert_eq!(run.dev_loss, vec![(1.0, 1.1), (2.0, 0.7)]);
        assert_eq!(run.root_accuracy, vec![(1.0, 50.0), (2.0, 75.0)]);
        // the null loss is left out; the step is half way through epoch 1
        assert_eq!(run.step_loss, vec![(0.5, 1.5)]);
        assert_eq!(
            run.accuracies,
            Accuracies {
                root: false,
                node: true
            }
        );
        // no config: both accuracies, steps placed by their batch
        let run = read_run(&run_dir("no-config", metrics, None)).unwrap();
        assert_eq!(run.step_loss, vec![(0.5, 1.5)]);
        assert!(run.accuracies.root && run.accuracies.node);
    }

    #[test]
    fn malformed_records_are_located() {
        let cases = [
            ("{\"kind\":\"epoch\",\"epoch\":1}\n{oops\n", ":2: "),
            ("{\"epoch\":1}\n", ":1: a record without a `kind`"),
            (
                "{\"kind\":\"epoch\",\"epoch\":0}\n",
                ":1: epoch record without",
            ),
            (
                "{\"kind\":\"step\",\"epoch\":1,\"batch\":1,\"loss\":\"x\"}\n",
                ":1: `loss` is \"x\", not a number",
            ),
            ("{\"kind\":\"test\"}\n", "no epoch or step records"),
        ];
        for (i, (text, needle)) in cases.iter().enumerate() {
            let e = read_run(&run_dir(&format!("bad{i}"), text, None))
                .unwrap_err()
                .to_string();
            assert!(e.contains("metrics.jsonl") && e.contains(needle), "{e}");
        }
        let d = run_dir(
            "bad-config",
            "{\"kind\":\"epoch\",\"epoch\":1}\n",
            Some("{"),
        );
        let e = read_run(&d).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
    }
}
