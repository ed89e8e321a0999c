//! Import edges between the module files of a crate, and the cycles among them.
//!
//! A node is a module file (inline modules count as part of their file). File `a`
//! depends on file `b` when code in `a` outside tests names something `b` defines:
//! through a private `use` (`use crate::b::X;`, `use super::*;`), or a path in code
//! (`crate::b::f()`, `super::X`, `child::Y`, also inside macro calls). A `pub use`
//! re-export is forwarding, not use: paths through it resolve to the module that
//! defines the item.

use std::collections::BTreeMap;

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::{self, Visit};
use syn::Visibility;

use crate::attrs::{impl_item_attrs, is_test_only, item_attrs, trait_item_attrs};
use crate::tree::{use_leaves, CrateTree};

/// One file depending on another.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Edge {
    /// The depending file, relative to the crate's `src/`.
    pub from: String,
    /// The file it depends on.
    pub to: String,
    /// The first place that shows the dependency: `line: path`.
    pub site: String,
}

/// Every edge between two different module files of the crate, one per pair, sorted.
pub fn module_edges(tree: &CrateTree) -> Vec<Edge> {
    let mut edges = BTreeMap::new();
    for file in &tree.files {
        let Some(module) = file.module.filter(|_| !file.test) else {
            continue;
        };
        let mut visitor = EdgeVisitor {
            tree,
            module,
            edges: &mut edges,
        };
        visitor.visit_file(&file.ast);
    }
    edges
        .into_iter()
        .map(|((from, to), site)| Edge { from, to, site })
        .collect()
}

/// The strongly connected components of more than one file, each sorted, in order.
pub fn cycles(edges: &[Edge]) -> Vec<Vec<String>> {
    let mut names: Vec<&str> = edges
        .iter()
        .flat_map(|e| [e.from.as_str(), e.to.as_str()])
        .collect();
    names.sort_unstable();
    names.dedup();
    let index = |name: &str| names.binary_search(&name).unwrap_or_default();
    let mut succ = vec![Vec::new(); names.len()];
    for e in edges {
        succ[index(&e.from)].push(index(&e.to));
    }
    let mut sccs: Vec<Vec<String>> = Tarjan::run(&succ)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut files: Vec<String> = c.iter().map(|&i| names[i].to_string()).collect();
            files.sort();
            files
        })
        .collect();
    sccs.sort();
    sccs
}

/// Tarjan's strongly connected components.
struct Tarjan<'a> {
    succ: &'a [Vec<usize>],
    index: Vec<Option<usize>>,
    low: Vec<usize>,
    on_stack: Vec<bool>,
    stack: Vec<usize>,
    next: usize,
    out: Vec<Vec<usize>>,
}

impl Tarjan<'_> {
    fn run(succ: &[Vec<usize>]) -> Vec<Vec<usize>> {
        let n = succ.len();
        let mut t = Tarjan {
            succ,
            index: vec![None; n],
            low: vec![0; n],
            on_stack: vec![false; n],
            stack: Vec::new(),
            next: 0,
            out: Vec::new(),
        };
        for v in 0..n {
            if t.index[v].is_none() {
                t.connect(v);
            }
        }
        t.out
    }

    fn connect(&mut self, v: usize) {
        self.index[v] = Some(self.next);
        self.low[v] = self.next;
        self.next += 1;
        self.stack.push(v);
        self.on_stack[v] = true;
        for &w in &self.succ[v] {
            match self.index[w] {
                None => {
                    self.connect(w);
                    self.low[v] = self.low[v].min(self.low[w]);
                }
                Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(self.low[v]) == self.index[v] {
            let mut component = Vec::new();
            while let Some(w) = self.stack.pop() {
                self.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            self.out.push(component);
        }
    }
}

struct EdgeVisitor<'a> {
    tree: &'a CrateTree,
    /// The module whose code is being walked.
    module: usize,
    /// (from file, to file) → first site.
    edges: &'a mut BTreeMap<(String, String), String>,
}

impl EdgeVisitor<'_> {
    fn add(&mut self, segments: &[String], line: usize) {
        let Some(target) = self.tree.resolve(self.module, segments) else {
            return;
        };
        let from = &self.tree.modules[self.module].file;
        let to = &self.tree.modules[target].file;
        if from != to {
            self.edges
                .entry((from.clone(), to.clone()))
                .or_insert_with(|| format!("{from}:{line}: {}", segments.join("::")));
        }
    }
}

impl<'ast> Visit<'ast> for EdgeVisitor<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if !is_test_only(item_attrs(item)) {
            visit::visit_item(self, item);
        }
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        if !is_test_only(impl_item_attrs(item)) {
            visit::visit_impl_item(self, item);
        }
    }

    fn visit_trait_item(&mut self, item: &'ast syn::TraitItem) {
        if !is_test_only(trait_item_attrs(item)) {
            visit::visit_trait_item(self, item);
        }
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        // A `mod name;` file is walked on its own; an inline module's code belongs to
        // this file but resolves names in its own scope.
        if item.content.is_none() {
            return;
        }
        let outer = self.module;
        let Some(&inner) = self.tree.modules[outer]
            .children
            .get(&item.ident.to_string())
        else {
            return;
        };
        self.module = inner;
        visit::visit_item_mod(self, item);
        self.module = outer;
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        if item.leading_colon.is_some() || !matches!(item.vis, Visibility::Inherited) {
            return;
        }
        let line = item.use_token.span.start().line;
        for leaf in use_leaves(&item.tree) {
            self.add(leaf.segments(), line);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() && path.segments.len() > 1 {
            let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
            self.add(&segments, path.segments[0].ident.span().start().line);
        }
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        for (segments, line) in crate_paths_in_tokens(&mac.tokens) {
            self.add(&segments, line);
        }
        visit::visit_macro(self, mac);
    }
}

/// Paths starting with `crate::`, `super::` or `self::` in a macro's unparsed tokens,
/// each with its line.
fn crate_paths_in_tokens(tokens: &TokenStream) -> Vec<(Vec<String>, usize)> {
    let trees: Vec<TokenTree> = tokens.clone().into_iter().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < trees.len() {
        match &trees[i] {
            TokenTree::Group(g) => out.extend(crate_paths_in_tokens(&g.stream())),
            TokenTree::Ident(ident) if ["crate", "super", "self"].iter().any(|k| ident == k) => {
                let line = ident.span().start().line;
                let mut segments = vec![ident.to_string()];
                // `:: ident` pairs: two joint ':' puncts, then an identifier.
                while let [TokenTree::Punct(a), TokenTree::Punct(b), TokenTree::Ident(next), ..] =
                    &trees[i + 1..]
                {
                    if a.as_char() != ':' || b.as_char() != ':' {
                        break;
                    }
                    segments.push(next.to_string());
                    i += 3;
                }
                if segments.len() > 1 {
                    out.push((segments, line));
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}
