//! Dependency edges between the workspace's crates, read from their `Cargo.toml`s, and
//! the layering rule they must keep.

use std::collections::BTreeSet;

use toml_edit::{Document, Item};

use crate::error::{Result, ShapeError};

/// Crates that run models on a device (engines).
pub const ENGINE_CRATES: &[&str] = &["ramus-cpu", "ramus-cuda"];

/// The training crate (trainer, checkpoints, models). Engines must not depend on it.
pub const TRAINING_CRATES: &[&str] = &["ramus-nn"];

/// The backend-neutral execution layer (batches, the engine contract, optimizers,
/// errors) every engine builds on. It depends on no engine and not on the trainer.
pub const EXEC_CRATES: &[&str] = &["ramus-exec"];

/// Code generation (the CUDA C++ the engines compile). It depends on the IR crate
/// alone; engines may depend on it.
pub const CODEGEN_CRATES: &[&str] = &["ramus-codegen"];

/// The one workspace crate a code-generation crate may depend on.
pub const IR_CRATE: &str = "ramus-core";

/// What one workspace crate depends on among the others.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct CrateDeps {
    /// The package name.
    pub name: String,
    /// `[dependencies]` (any target) on workspace crates.
    pub normal: BTreeSet<String>,
    /// `[build-dependencies]` on workspace crates.
    pub build: BTreeSet<String>,
    /// `[dev-dependencies]` on workspace crates.
    pub dev: BTreeSet<String>,
}

/// The dependencies among workspace crates, from `(manifest path, manifest text)` pairs.
pub fn workspace_deps(manifests: &[(String, String)]) -> Result<Vec<CrateDeps>> {
    let mut parsed = Vec::new();
    for (path, text) in manifests {
        let doc: Document<String> =
            text.parse()
                .map_err(|e: toml_edit::TomlError| ShapeError::Manifest {
                    file: path.clone(),
                    message: e.to_string(),
                })?;
        let name = doc
            .get("package")
            .and_then(|p| p.get("name"))
            .and_then(Item::as_str)
            .ok_or_else(|| ShapeError::Manifest {
                file: path.clone(),
                message: "no [package] name".to_string(),
            })?
            .to_string();
        parsed.push((name, doc));
    }
    let members: BTreeSet<String> = parsed.iter().map(|(name, _)| name.clone()).collect();
    let mut out = Vec::new();
    for (name, doc) in &parsed {
        let mut deps = CrateDeps {
            name: name.clone(),
            ..CrateDeps::default()
        };
        let targets = doc.get("target").and_then(Item::as_table_like);
        let mut tables: Vec<&Item> = vec![doc.as_item()];
        if let Some(targets) = targets {
            tables.extend(targets.iter().map(|(_, item)| item));
        }
        for table in tables {
            collect(table.get("dependencies"), &members, &mut deps.normal);
            collect(table.get("build-dependencies"), &members, &mut deps.build);
            collect(table.get("dev-dependencies"), &members, &mut deps.dev);
        }
        out.push(deps);
    }
    Ok(out)
}

/// Adds the workspace crates of one dependency table (a `package = ".."` rename counts
/// under the package's name).
fn collect(table: Option<&Item>, members: &BTreeSet<String>, into: &mut BTreeSet<String>) {
    let Some(table) = table.and_then(Item::as_table_like) else {
        return;
    };
    for (key, item) in table.iter() {
        let name = item.get("package").and_then(Item::as_str).unwrap_or(key);
        if members.contains(name) {
            into.insert(name.to_string());
        }
    }
}

/// Edges that break the layering, as `from -> to`: an engine crate depending (normal or
/// build) on another engine crate or on the training crate, the execution layer
/// depending on any engine or on the training crate, or a code-generation crate
/// depending on any workspace crate but the IR crate.
pub fn forbidden_edges(deps: &[CrateDeps]) -> Vec<String> {
    let mut out = Vec::new();
    for d in deps.iter() {
        let from = d.name.as_str();
        if CODEGEN_CRATES.contains(&from) {
            let beyond_ir = d.normal.iter().chain(&d.build).filter(|to| *to != IR_CRATE);
            out.extend(beyond_ir.map(|to| format!("{from} -> {to}")));
            continue;
        }
        let is_engine = ENGINE_CRATES.contains(&from);
        if !is_engine && !EXEC_CRATES.contains(&from) {
            continue;
        }
        for to in d.normal.iter().chain(&d.build) {
            let engine = ENGINE_CRATES.contains(&to.as_str()) && *to != d.name;
            if engine || TRAINING_CRATES.contains(&to.as_str()) {
                out.push(format!("{} -> {to}", d.name));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}
