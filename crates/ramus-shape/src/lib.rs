//! Measures the shape rules of issue 31 over the workspace's crates and holds them to a
//! ratchet baseline (`baseline.json`), so that restructuring only ever lowers them.
//!
//! Per crate (every `crates/*/src/**/*.rs`, parsed with `syn`; test code left out):
//! files over 1,000 non-test lines; functions over 100 and over 150 lines;
//! `#[allow(clippy::too_many_arguments)]` exemptions; import cycles between module files;
//! runtime op dispatch sites (`op_as` / `downcast_ref` calls); and, from the manifests,
//! the dependencies between workspace crates. `docs/shape.md` says how each is counted.
//!
//! ```no_run
//! let root = std::path::Path::new(".");
//! let report = ramus_shape::measure_workspace(root).unwrap();
//! print!("{}", report.render_text());
//! ```

pub mod attrs;
pub mod baseline;
pub mod deps;
pub mod error;
pub mod imports;
pub mod metrics;
pub mod report;
pub mod tree;

use std::collections::BTreeMap;
use std::path::Path;

pub use baseline::{Baseline, Ratchet, UPDATE_COMMAND};
pub use error::{Result, ShapeError};
pub use report::{CrateReport, Report};
pub use tree::CrateSources;

use imports::{cycles, module_edges};
use metrics::measure_file;
use report::{Cycle, FileCount, LongFile, LongFn, FILE_LINES_LIMIT, FN_LINES_LISTED};
use tree::CrateTree;

/// Where the committed baseline lives, relative to the workspace.
pub const BASELINE_PATH: &str = "crates/ramus-shape/baseline.json";

/// Measures one crate's sources.
pub fn measure_crate(src: &CrateSources) -> Result<CrateReport> {
    let tree = CrateTree::build(src)?;
    let mut report = CrateReport {
        name: src.name.clone(),
        files: tree.files.len(),
        unreached: tree.unreached.iter().map(|f| src.path_of(f)).collect(),
        ..CrateReport::default()
    };
    for file in &tree.files {
        let m = measure_file(&file.text, &file.ast, file.test);
        let path = src.path_of(&file.rel);
        report.test_files += usize::from(file.test);
        report.lines += m.total_lines;
        report.non_test_lines += m.non_test_lines;
        if m.non_test_lines > FILE_LINES_LIMIT {
            report.long_files.push(LongFile {
                file: path.clone(),
                non_test_lines: m.non_test_lines,
                total_lines: m.total_lines,
            });
        }
        for f in m.fns.into_iter().filter(|f| f.lines > FN_LINES_LISTED) {
            report.long_fns.push(LongFn {
                file: path.clone(),
                name: f.name,
                line: f.line,
                lines: f.lines,
            });
        }
        if m.too_many_arguments > 0 {
            report.too_many_arguments.push(FileCount {
                file: path.clone(),
                count: m.too_many_arguments,
            });
        }
        if m.op_dispatch > 0 {
            report.op_dispatch.push(FileCount {
                file: path,
                count: m.op_dispatch,
            });
        }
    }
    report.long_files.sort_by(|a, b| {
        b.non_test_lines
            .cmp(&a.non_test_lines)
            .then(a.file.cmp(&b.file))
    });
    report
        .long_fns
        .sort_by(|a, b| b.lines.cmp(&a.lines).then(a.key().cmp(&b.key())));
    let edges = module_edges(&tree);
    report.cycles = cycles(&edges)
        .into_iter()
        .map(|files| Cycle {
            edges: edges
                .iter()
                .filter(|e| files.contains(&e.from) && files.contains(&e.to))
                .cloned()
                .collect(),
            files,
        })
        .collect();
    Ok(report)
}

/// Measures every crate under `root/crates/`.
pub fn measure_workspace(root: &Path) -> Result<Report> {
    let mut manifests = Vec::new();
    let mut crates = Vec::new();
    for dir in crate_dirs(root)? {
        let manifest = format!("{dir}/Cargo.toml");
        manifests.push((manifest.clone(), read(root, &manifest)?));
        crates.push(dir);
    }
    let crate_deps = deps::workspace_deps(&manifests)?;
    let forbidden_deps = deps::forbidden_edges(&crate_deps);
    let mut reports = Vec::new();
    for (dir, deps) in crates.iter().zip(&crate_deps) {
        let src = CrateSources {
            name: deps.name.clone(),
            dir: dir.clone(),
            files: read_sources(root, &format!("{dir}/src"))?,
        };
        reports.push(measure_crate(&src)?);
    }
    Ok(Report {
        crates: reports,
        crate_deps,
        forbidden_deps,
    })
}

/// `crates/<name>` for each directory of `root/crates` with a `Cargo.toml`, sorted.
fn crate_dirs(root: &Path) -> Result<Vec<String>> {
    let mut dirs = Vec::new();
    for entry in read_dir(root, "crates")? {
        if entry.path().join("Cargo.toml").is_file() {
            dirs.push(format!("crates/{}", entry.file_name().to_string_lossy()));
        }
    }
    dirs.sort();
    Ok(dirs)
}

/// Every `.rs` file under `root/dir`, by path relative to `dir`.
fn read_sources(root: &Path, dir: &str) -> Result<BTreeMap<String, String>> {
    let mut files = BTreeMap::new();
    let mut pending = vec![String::new()];
    while let Some(sub) = pending.pop() {
        let here = if sub.is_empty() {
            dir.to_string()
        } else {
            format!("{dir}/{sub}")
        };
        for entry in read_dir(root, &here)? {
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if sub.is_empty() {
                name.clone()
            } else {
                format!("{sub}/{name}")
            };
            if entry.path().is_dir() {
                pending.push(rel);
            } else if name.ends_with(".rs") {
                files.insert(rel.clone(), read(root, &format!("{dir}/{rel}"))?);
            }
        }
    }
    Ok(files)
}

fn read_dir(root: &Path, dir: &str) -> Result<Vec<std::fs::DirEntry>> {
    let io = |source| ShapeError::Io {
        path: root.join(dir).display().to_string(),
        source,
    };
    std::fs::read_dir(root.join(dir))
        .map_err(io)?
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(io)
}

fn read(root: &Path, file: &str) -> Result<String> {
    let path = root.join(file);
    std::fs::read_to_string(&path).map_err(|source| ShapeError::Io {
        path: path.display().to_string(),
        source,
    })
}
