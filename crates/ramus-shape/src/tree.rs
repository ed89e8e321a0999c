//! A crate's module tree: which file holds which module, and the names in each module's
//! scope (items, imports, child modules), enough to resolve `crate::` / `super::` paths to
//! the module that defines what they name.

use std::collections::{BTreeMap, BTreeSet};

use syn::{ForeignItem, Item, ItemMod, UseTree};

use crate::attrs::{is_test_only, item_attrs};
use crate::error::{Result, ShapeError};

/// The Rust sources of one crate, as read from disk or written by a test.
#[derive(Debug, Clone)]
pub struct CrateSources {
    /// The package name (`ramus-core`).
    pub name: String,
    /// The crate's directory, relative to the workspace (`crates/ramus-core`).
    pub dir: String,
    /// Every `.rs` file under `src/`, by path relative to `src/` (`ops/mod.rs`) → text.
    pub files: BTreeMap<String, String>,
}

impl CrateSources {
    /// The path of a source file relative to the workspace, as reports name it.
    pub fn path_of(&self, rel: &str) -> String {
        format!("{}/src/{rel}", self.dir)
    }
}

/// One module: a file, or an inline `mod name { .. }` within one.
#[derive(Debug, Clone)]
pub struct Module {
    /// The file (relative to `src/`) that holds the module's items.
    pub file: String,
    /// The enclosing module; `None` for a crate root.
    pub parent: Option<usize>,
    /// The crate root of this module's target (the library or a binary).
    pub root: usize,
    /// Whether the module is test-only (`#[cfg(test)]`, or inside such a module).
    pub test: bool,
    /// Child modules that are not test-only, by name.
    pub children: BTreeMap<String, usize>,
    /// Names of the items the module defines.
    pub items: BTreeSet<String>,
    /// Names brought in by `use`, each with the path it stands for (as written).
    pub imports: BTreeMap<String, Vec<String>>,
    /// The paths of `use path::*` imports.
    pub globs: Vec<Vec<String>>,
}

/// A parsed source file.
pub struct ParsedFile {
    /// Path relative to `src/`.
    pub rel: String,
    /// The file's text.
    pub text: String,
    /// The file's syntax tree.
    pub ast: syn::File,
    /// The module the file holds; `None` for a file no `mod` declaration reaches.
    pub module: Option<usize>,
    /// Whether every line of the file is test code (a file reached only through
    /// `#[cfg(test)] mod tests;`).
    pub test: bool,
}

/// A crate's modules and parsed files.
pub struct CrateTree {
    /// Every module, crate roots first.
    pub modules: Vec<Module>,
    /// Every source file under `src/`, parsed.
    pub files: Vec<ParsedFile>,
    /// Files under `src/` that no `mod` declaration reaches (relative to `src/`).
    pub unreached: Vec<String>,
}

/// A name or glob brought in by a `use` declaration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UseLeaf {
    /// `use a::b::c as d;`: the name `d` for the path `a::b::c`.
    Name {
        /// The name in scope (`_` for `as _`).
        alias: String,
        /// The full path, as written.
        segments: Vec<String>,
    },
    /// `use a::b::*;`: the path `a::b`.
    Glob {
        /// The path whose names are imported.
        segments: Vec<String>,
    },
}

impl UseLeaf {
    /// The path the leaf refers to: the imported item, or the module of a glob.
    pub fn segments(&self) -> &[String] {
        match self {
            UseLeaf::Name { segments, .. } | UseLeaf::Glob { segments } => segments,
        }
    }
}

/// The names and globs of a `use` tree, each with its full path.
pub fn use_leaves(tree: &UseTree) -> Vec<UseLeaf> {
    fn walk(tree: &UseTree, prefix: &mut Vec<String>, out: &mut Vec<UseLeaf>) {
        match tree {
            UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                walk(&p.tree, prefix, out);
                prefix.pop();
            }
            UseTree::Name(n) => push_name(prefix, n.ident.to_string(), None, out),
            UseTree::Rename(r) => {
                push_name(prefix, r.ident.to_string(), Some(r.rename.to_string()), out)
            }
            UseTree::Glob(_) => out.push(UseLeaf::Glob {
                segments: prefix.clone(),
            }),
            UseTree::Group(g) => g.items.iter().for_each(|t| walk(t, prefix, out)),
        }
    }
    fn push_name(prefix: &[String], name: String, rename: Option<String>, out: &mut Vec<UseLeaf>) {
        let mut segments = prefix.to_vec();
        // `use a::b::{self}` names the module `a::b` itself.
        if name != "self" {
            segments.push(name);
        }
        if let Some(last) = segments.last() {
            let alias = rename.unwrap_or_else(|| last.clone());
            out.push(UseLeaf::Name { alias, segments });
        }
    }
    let mut out = Vec::new();
    walk(tree, &mut Vec::new(), &mut out);
    out
}

impl CrateTree {
    /// Parses every file of a crate and follows its `mod` declarations from the crate
    /// roots (`lib.rs`, `main.rs`, `bin/*.rs`).
    pub fn build(src: &CrateSources) -> Result<CrateTree> {
        let mut builder = Builder {
            src,
            modules: Vec::new(),
            files: Vec::new(),
        };
        let roots = src.files.keys().filter(|rel| {
            matches!(rel.as_str(), "lib.rs" | "main.rs")
                || (rel.starts_with("bin/") && rel.matches('/').count() == 1)
        });
        for rel in roots {
            let root = builder.modules.len();
            builder.modules.push(Module::new(rel, None, root, false));
            builder.load_file(rel, root, false, parent_dir(rel))?;
        }
        let reached: BTreeSet<String> = builder.files.iter().map(|f| f.rel.clone()).collect();
        let mut unreached = Vec::new();
        for (rel, text) in &src.files {
            if !reached.contains(rel) {
                let ast = parse(src, rel, text)?;
                builder.files.push(ParsedFile {
                    rel: rel.clone(),
                    text: text.clone(),
                    ast,
                    module: None,
                    test: false,
                });
                unreached.push(rel.clone());
            }
        }
        Ok(CrateTree {
            modules: builder.modules,
            files: builder.files,
            unreached,
        })
    }

    /// The module a path names or defines its target in, seen from module `from`:
    /// `crate::a::B` → module `a` (or, when `a` re-exports `B`, the module `B` comes
    /// from). `None` for paths outside the crate (`std::..`, other crates, locals).
    pub fn resolve(&self, from: usize, segments: &[String]) -> Option<usize> {
        self.resolve_with_fuel(from, segments, RESOLVE_FUEL)
    }

    fn resolve_with_fuel(&self, from: usize, segments: &[String], fuel: u32) -> Option<usize> {
        let fuel = fuel.checked_sub(1)?;
        match segments.first()?.as_str() {
            "crate" => self.walk(self.modules[from].root, &segments[1..], false, fuel),
            "self" => self.walk(from, &segments[1..], false, fuel),
            "super" => {
                let mut cur = from;
                let supers = segments.iter().take_while(|s| *s == "super").count();
                for _ in 0..supers {
                    cur = self.modules[cur].parent?;
                }
                self.walk(cur, &segments[supers..], false, fuel)
            }
            _ => self.walk(from, segments, true, fuel),
        }
    }

    /// Follows `segments` down from module `cur`. `relative`: the first segment must be a
    /// name in `cur`'s scope, else the path leaves the crate.
    fn walk(
        &self,
        mut cur: usize,
        segments: &[String],
        relative: bool,
        fuel: u32,
    ) -> Option<usize> {
        for (i, seg) in segments.iter().enumerate() {
            let module = &self.modules[cur];
            if let Some(&child) = module.children.get(seg) {
                cur = child;
                continue;
            }
            if module.items.contains(seg) {
                return Some(cur);
            }
            if let Some(target) = module.imports.get(seg) {
                let mut path = target.clone();
                path.extend_from_slice(&segments[i + 1..]);
                return self.resolve_with_fuel(cur, &path, fuel);
            }
            let fuel = fuel.checked_sub(1)?;
            for glob in &module.globs {
                let Some(source) = self.resolve_with_fuel(cur, glob, fuel) else {
                    continue;
                };
                if source != cur && self.modules[source].has_name(seg) {
                    return self.walk(source, &segments[i..], false, fuel);
                }
            }
            return (!relative || i > 0).then_some(cur);
        }
        Some(cur)
    }
}

/// How many imports and globs a path resolution follows before it gives up (a guard
/// against import loops).
const RESOLVE_FUEL: u32 = 8;

impl Module {
    fn new(file: &str, parent: Option<usize>, root: usize, test: bool) -> Module {
        Module {
            file: file.to_string(),
            parent,
            root,
            test,
            children: BTreeMap::new(),
            items: BTreeSet::new(),
            imports: BTreeMap::new(),
            globs: Vec::new(),
        }
    }

    fn has_name(&self, name: &str) -> bool {
        self.children.contains_key(name)
            || self.items.contains(name)
            || self.imports.contains_key(name)
    }

    /// Adds what an item (not test-only) puts in the module's scope.
    fn declare(&mut self, item: &Item) {
        let name = match item {
            Item::Use(u) => {
                if u.leading_colon.is_none() {
                    for leaf in use_leaves(&u.tree) {
                        match leaf {
                            UseLeaf::Name { alias, segments } if alias != "_" => {
                                self.imports.insert(alias, segments);
                            }
                            UseLeaf::Name { .. } => {}
                            UseLeaf::Glob { segments } => self.globs.push(segments),
                        }
                    }
                }
                return;
            }
            Item::ForeignMod(f) => {
                for foreign in &f.items {
                    match foreign {
                        ForeignItem::Fn(x) => self.items.insert(x.sig.ident.to_string()),
                        ForeignItem::Static(x) => self.items.insert(x.ident.to_string()),
                        _ => false,
                    };
                }
                return;
            }
            Item::Const(i) => &i.ident,
            Item::Enum(i) => &i.ident,
            Item::ExternCrate(i) => i.rename.as_ref().map_or(&i.ident, |(_, r)| r),
            Item::Fn(i) => &i.sig.ident,
            Item::Macro(i) => match &i.ident {
                Some(ident) => ident,
                None => return,
            },
            Item::Static(i) => &i.ident,
            Item::Struct(i) => &i.ident,
            Item::Trait(i) => &i.ident,
            Item::TraitAlias(i) => &i.ident,
            Item::Type(i) => &i.ident,
            Item::Union(i) => &i.ident,
            _ => return,
        };
        self.items.insert(name.to_string());
    }
}

struct Builder<'a> {
    src: &'a CrateSources,
    modules: Vec<Module>,
    files: Vec<ParsedFile>,
}

impl Builder<'_> {
    /// Parses the file of `module` and scans its items; `dir` is where its child
    /// modules' files are (relative to `src/`).
    fn load_file(&mut self, rel: &str, module: usize, test: bool, dir: String) -> Result<()> {
        let text = self.src.files.get(rel).cloned().unwrap_or_default();
        let ast = parse(self.src, rel, &text)?;
        self.scan(&ast.items, module, &dir, rel, test)?;
        self.files.push(ParsedFile {
            rel: rel.to_string(),
            text,
            ast,
            module: Some(module),
            test,
        });
        Ok(())
    }

    fn scan(
        &mut self,
        items: &[Item],
        module: usize,
        dir: &str,
        rel: &str,
        test: bool,
    ) -> Result<()> {
        for item in items {
            let item_test = test || is_test_only(item_attrs(item));
            if let Item::Mod(m) = item {
                self.scan_mod(m, module, dir, rel, item_test)?;
            } else if !item_test {
                self.modules[module].declare(item);
            }
        }
        Ok(())
    }

    fn scan_mod(
        &mut self,
        m: &ItemMod,
        parent: usize,
        dir: &str,
        rel: &str,
        test: bool,
    ) -> Result<()> {
        let name = m.ident.to_string();
        let file = match &m.content {
            Some(_) => rel.to_string(),
            None => self.module_file(m, dir, rel)?,
        };
        let root = self.modules[parent].root;
        let child = self.modules.len();
        self.modules
            .push(Module::new(&file, Some(parent), root, test));
        if !test {
            self.modules[parent].children.insert(name.clone(), child);
        }
        match &m.content {
            Some((_, items)) => self.scan(items, child, &join(dir, &name), rel, test),
            None if path_attr(m).is_some() || file.ends_with("/mod.rs") || file == "mod.rs" => {
                self.load_file(&file, child, test, parent_dir(&file))
            }
            None => {
                let own_dir = file.trim_end_matches(".rs").to_string();
                self.load_file(&file, child, test, own_dir)
            }
        }
    }

    /// The file of `mod name;`: `#[path = ".."]` (relative to the declaring file's
    /// directory), else `dir/name.rs` or `dir/name/mod.rs`.
    fn module_file(&self, m: &ItemMod, dir: &str, rel: &str) -> Result<String> {
        let name = m.ident.to_string();
        let tried = match path_attr(m) {
            Some(path) => vec![join(&parent_dir(rel), &path)],
            None => vec![
                join(dir, &format!("{name}.rs")),
                join(dir, &format!("{name}/mod.rs")),
            ],
        };
        if let Some(found) = tried.iter().find(|t| self.src.files.contains_key(*t)) {
            return Ok(found.clone());
        }
        Err(ShapeError::ModuleFile {
            file: self.src.path_of(rel),
            line: m.ident.span().start().line,
            name,
            tried: tried
                .iter()
                .map(|t| self.src.path_of(t))
                .collect::<Vec<_>>()
                .join(", "),
        })
    }
}

fn path_attr(m: &ItemMod) -> Option<String> {
    m.attrs.iter().find_map(|attr| match &attr.meta {
        syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    })
}

fn parse(src: &CrateSources, rel: &str, text: &str) -> Result<syn::File> {
    syn::parse_file(text).map_err(|e| {
        let start = e.span().start();
        ShapeError::Parse {
            file: src.path_of(rel),
            line: start.line,
            column: start.column + 1,
            message: e.to_string(),
        }
    })
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

fn parent_dir(rel: &str) -> String {
    rel.rsplit_once('/')
        .map_or_else(String::new, |(dir, _)| dir.to_string())
}
