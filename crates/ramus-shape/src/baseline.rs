//! The ratchet: a committed baseline of today's offenders, which counts may only lower.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Result, ShapeError};
use crate::report::Report;

/// The command that rewrites the baseline from the current sources.
pub const UPDATE_COMMAND: &str =
    "RAMUS_SHAPE_UPDATE=1 cargo test --release -p ramus-shape --test shape";

/// Today's offenders, each with its size. Paths are relative to the workspace.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Baseline {
    /// How to read and update this file.
    #[serde(default)]
    pub about: String,
    /// File → non-test lines, for files over 1,000.
    pub files_over_1000: BTreeMap<String, usize>,
    /// `file::fn` → lines, for functions over 100 lines.
    pub fns_over_100: BTreeMap<String, usize>,
    /// File → `#[allow(clippy::too_many_arguments)]` attributes.
    pub too_many_arguments: BTreeMap<String, usize>,
    /// File → `op_as` / `downcast_ref` calls.
    pub op_dispatch: BTreeMap<String, usize>,
    /// Crate → its import cycles, each the sorted module files (relative to `src/`).
    pub import_cycles: BTreeMap<String, Vec<Vec<String>>>,
    /// `engine -> crate` dependencies that break the layering.
    pub forbidden_crate_deps: BTreeSet<String>,
}

/// What changed against the baseline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ratchet {
    /// Counts that rose and new offenders: each fails the check.
    pub regressions: Vec<String>,
    /// Counts that fell and offenders gone: the baseline can be lowered.
    pub improvements: Vec<String>,
}

impl Baseline {
    /// The offenders of a report.
    pub fn from_report(report: &Report) -> Baseline {
        let mut b = Baseline {
            about: format!(
                "Shape ratchet of issue 31 (docs/shape.md): today's offenders with their sizes. \
                 `cargo test -p ramus-shape` fails when a count rises or an offender appears. \
                 After an improvement, lower it with `{UPDATE_COMMAND}`."
            ),
            forbidden_crate_deps: report.forbidden_deps.iter().cloned().collect(),
            ..Baseline::default()
        };
        for c in &report.crates {
            for f in &c.long_files {
                b.files_over_1000.insert(f.file.clone(), f.non_test_lines);
            }
            for f in &c.long_fns {
                let mut key = f.key();
                // Two functions of one name in a file (impls of a trait for two types
                // in different scopes): number the later ones.
                let mut n = 2;
                while b.fns_over_100.contains_key(&key) {
                    key = format!("{} #{n}", f.key());
                    n += 1;
                }
                b.fns_over_100.insert(key, f.lines);
            }
            for f in &c.too_many_arguments {
                b.too_many_arguments.insert(f.file.clone(), f.count);
            }
            for f in &c.op_dispatch {
                b.op_dispatch.insert(f.file.clone(), f.count);
            }
            if !c.cycles.is_empty() {
                let cycles = c.cycles.iter().map(|cy| cy.files.clone()).collect();
                b.import_cycles.insert(c.name.clone(), cycles);
            }
        }
        b
    }

    /// Reads a baseline file; a missing file is an empty baseline.
    pub fn read(path: &std::path::Path) -> Result<Baseline> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Baseline::default()),
            Err(source) => {
                return Err(ShapeError::Io {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        serde_json::from_str(&text).map_err(|e| ShapeError::Baseline {
            file: path.display().to_string(),
            message: e.to_string(),
        })
    }

    /// The baseline as the JSON text it is committed as (one offender a line).
    pub fn to_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(self).unwrap_or_default();
        text.push('\n');
        text
    }

    /// Compares `current` against this baseline.
    pub fn compare(&self, current: &Baseline) -> Ratchet {
        let mut r = Ratchet::default();
        let sized = [
            (
                "file",
                "non-test lines",
                &self.files_over_1000,
                &current.files_over_1000,
            ),
            ("fn", "lines", &self.fns_over_100, &current.fns_over_100),
            (
                "too_many_arguments in",
                "allows",
                &self.too_many_arguments,
                &current.too_many_arguments,
            ),
            (
                "op dispatch in",
                "calls",
                &self.op_dispatch,
                &current.op_dispatch,
            ),
        ];
        for (what, unit, base, now) in sized {
            compare_sized(what, unit, base, now, &mut r);
        }
        compare_cycles(&self.import_cycles, &current.import_cycles, &mut r);
        for edge in current
            .forbidden_crate_deps
            .difference(&self.forbidden_crate_deps)
        {
            r.regressions.push(format!(
                "new crate dependency breaking the layering: {edge}"
            ));
        }
        for edge in self
            .forbidden_crate_deps
            .difference(&current.forbidden_crate_deps)
        {
            r.improvements
                .push(format!("crate dependency gone: {edge}"));
        }
        r
    }
}

fn compare_sized(
    what: &str,
    unit: &str,
    base: &BTreeMap<String, usize>,
    now: &BTreeMap<String, usize>,
    r: &mut Ratchet,
) {
    for (key, &n) in now {
        match base.get(key) {
            None => {
                let mut line = format!("new: {what} {key}: {n} {unit}");
                if let Some(old) = moved_from(key, base, now) {
                    line.push_str(&format!(
                        " (moved from {old}? then rewrite the baseline: {UPDATE_COMMAND})"
                    ));
                }
                r.regressions.push(line);
            }
            Some(&b) if n > b => r
                .regressions
                .push(format!("grew: {what} {key}: {b} -> {n} {unit}")),
            Some(&b) if n < b => r
                .improvements
                .push(format!("{what} {key}: {b} -> {n} {unit}")),
            Some(_) => {}
        }
    }
    for (key, b) in base {
        if !now.contains_key(key) {
            r.improvements
                .push(format!("gone: {what} {key} (was {b} {unit})"));
        }
    }
}

/// A baseline key gone from `now` whose last `::` segment (a function's name) or file
/// name matches `key`: the offender probably moved.
fn moved_from<'a>(
    key: &str,
    base: &'a BTreeMap<String, usize>,
    now: &BTreeMap<String, usize>,
) -> Option<&'a str> {
    let tail = |k: &str| -> String {
        let k = k.split(" #").next().unwrap_or(k);
        let name = k.rsplit("::").next().unwrap_or(k);
        name.rsplit('/').next().unwrap_or(name).to_string()
    };
    let wanted = tail(key);
    base.keys()
        .find(|old| !now.contains_key(*old) && tail(old) == wanted)
        .map(String::as_str)
}

/// A cycle is allowed when it lies within a baseline cycle of the same crate.
fn compare_cycles(
    base: &BTreeMap<String, Vec<Vec<String>>>,
    now: &BTreeMap<String, Vec<Vec<String>>>,
    r: &mut Ratchet,
) {
    let empty = Vec::new();
    for (krate, cycles) in now {
        let allowed = base.get(krate).unwrap_or(&empty);
        for cycle in cycles {
            let within = allowed.iter().any(|a| cycle.iter().all(|f| a.contains(f)));
            if !within {
                r.regressions
                    .push(format!("new import cycle in {krate}: {}", cycle.join(", ")));
            }
        }
    }
    for (krate, cycles) in base {
        let current = now.get(krate).unwrap_or(&empty);
        for cycle in cycles.iter().filter(|c| !current.contains(c)) {
            r.improvements.push(format!(
                "import cycle in {krate} broken or smaller: {}",
                cycle.join(", ")
            ));
        }
    }
}
