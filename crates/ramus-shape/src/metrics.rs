//! Per-file measures: non-test lines, function lengths, `too_many_arguments` exemptions,
//! runtime op dispatch sites. Test code (`#[cfg(test)]` items, `#[test]` functions) is
//! left out of every measure.

use proc_macro2::{TokenStream, TokenTree};
use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Attribute, Block, Signature, Type};

use crate::attrs::{
    allows_too_many_arguments, impl_item_attrs, is_test_only, item_attrs, trait_item_attrs,
};

/// Method names that pick an op's implementation by its runtime type.
pub const DISPATCH_METHODS: &[&str] = &["op_as", "downcast_ref"];

/// What one file measures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileMetrics {
    /// Lines of the file.
    pub total_lines: usize,
    /// Lines outside test code.
    pub non_test_lines: usize,
    /// Every function with a body outside test code.
    pub fns: Vec<FnLength>,
    /// `#[allow(clippy::too_many_arguments)]` attributes outside test code.
    pub too_many_arguments: usize,
    /// `op_as` / `downcast_ref` calls outside test code.
    pub op_dispatch: usize,
}

/// A function and its length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FnLength {
    /// Name qualified within the file: `Type::method`, `outer::inner`, `module::f`.
    pub name: String,
    /// Line of its `fn` keyword.
    pub line: usize,
    /// Lines from the `fn` keyword to the closing brace.
    pub lines: usize,
}

/// Measures a parsed file; a test-only file measures zero everywhere.
pub fn measure_file(text: &str, ast: &syn::File, test_file: bool) -> FileMetrics {
    let total_lines = text.lines().count();
    if test_file {
        return FileMetrics {
            total_lines,
            ..FileMetrics::default()
        };
    }
    let mut visitor = MetricsVisitor::default();
    visitor.visit_file(ast);
    let test_lines = covered_lines(&mut visitor.test_ranges);
    FileMetrics {
        total_lines,
        non_test_lines: total_lines.saturating_sub(test_lines),
        fns: visitor.fns,
        too_many_arguments: visitor.too_many_arguments,
        op_dispatch: visitor.op_dispatch,
    }
}

/// Lines covered by a set of inclusive line ranges.
fn covered_lines(ranges: &mut [(usize, usize)]) -> usize {
    ranges.sort_unstable();
    let mut covered = 0;
    let mut next_free = 0;
    for &(start, end) in ranges.iter() {
        let start = start.max(next_free);
        if end >= start {
            covered += end - start + 1;
            next_free = end + 1;
        }
    }
    covered
}

#[derive(Default)]
struct MetricsVisitor {
    /// Enclosing modules, types and functions, for qualified function names.
    scope: Vec<String>,
    test_ranges: Vec<(usize, usize)>,
    fns: Vec<FnLength>,
    too_many_arguments: usize,
    op_dispatch: usize,
}

impl MetricsVisitor {
    /// Records test code; true when the item is test code (and must not be walked).
    fn skip_test(&mut self, attrs: &[Attribute], node: &impl Spanned) -> bool {
        if !is_test_only(attrs) {
            return false;
        }
        let span = node.span();
        self.test_ranges.push((span.start().line, span.end().line));
        true
    }

    fn record_fn(&mut self, sig: &Signature, body: &Block) {
        let start = sig.fn_token.span.start().line;
        let end = body.brace_token.span.close().end().line;
        let mut name = self.scope.join("::");
        if !name.is_empty() {
            name.push_str("::");
        }
        name.push_str(&sig.ident.to_string());
        self.fns.push(FnLength {
            name,
            line: start,
            lines: end + 1 - start,
        });
    }

    fn scoped(&mut self, name: String, walk: impl FnOnce(&mut Self)) {
        self.scope.push(name);
        walk(self);
        self.scope.pop();
    }
}

impl<'ast> Visit<'ast> for MetricsVisitor {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if !self.skip_test(item_attrs(item), item) {
            visit::visit_item(self, item);
        }
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        if !self.skip_test(impl_item_attrs(item), item) {
            visit::visit_impl_item(self, item);
        }
    }

    fn visit_trait_item(&mut self, item: &'ast syn::TraitItem) {
        if !self.skip_test(trait_item_attrs(item), item) {
            visit::visit_trait_item(self, item);
        }
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.scoped(item.ident.to_string(), |v| visit::visit_item_mod(v, item));
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        self.scoped(type_name(&item.self_ty), |v| {
            visit::visit_item_impl(v, item)
        });
    }

    fn visit_item_trait(&mut self, item: &'ast syn::ItemTrait) {
        self.scoped(item.ident.to_string(), |v| visit::visit_item_trait(v, item));
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        self.record_fn(&item.sig, &item.block);
        self.scoped(item.sig.ident.to_string(), |v| {
            visit::visit_item_fn(v, item)
        });
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        self.record_fn(&item.sig, &item.block);
        self.scoped(item.sig.ident.to_string(), |v| {
            visit::visit_impl_item_fn(v, item)
        });
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        if let Some(body) = &item.default {
            self.record_fn(&item.sig, body);
        }
        self.scoped(item.sig.ident.to_string(), |v| {
            visit::visit_trait_item_fn(v, item)
        });
    }

    fn visit_attribute(&mut self, attr: &'ast Attribute) {
        if allows_too_many_arguments(attr) {
            self.too_many_arguments += 1;
        }
        visit::visit_attribute(self, attr);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        if DISPATCH_METHODS.iter().any(|m| call.method == m) {
            self.op_dispatch += 1;
        }
        visit::visit_expr_method_call(self, call);
    }

    fn visit_expr_path(&mut self, path: &'ast syn::ExprPath) {
        let last = path.path.segments.last();
        if last.is_some_and(|s| DISPATCH_METHODS.iter().any(|m| s.ident == m)) {
            self.op_dispatch += 1;
        }
        visit::visit_expr_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.op_dispatch += dispatch_calls_in_tokens(&mac.tokens);
        visit::visit_macro(self, mac);
    }
}

/// `.op_as` / `.downcast_ref` in a macro's tokens (`format!("{}", x.op_as::<T>()..)`),
/// which the parser leaves unparsed.
fn dispatch_calls_in_tokens(tokens: &TokenStream) -> usize {
    let mut count = 0;
    let mut after_dot = false;
    for tree in tokens.clone() {
        match &tree {
            TokenTree::Ident(ident) if after_dot => {
                count += usize::from(DISPATCH_METHODS.iter().any(|m| ident == m));
            }
            TokenTree::Group(group) => count += dispatch_calls_in_tokens(&group.stream()),
            _ => {}
        }
        after_dot = matches!(&tree, TokenTree::Punct(p) if p.as_char() == '.');
    }
    count
}

/// The name of an `impl` block's type, for qualified function names.
fn type_name(ty: &Type) -> String {
    match ty {
        Type::Path(p) => p
            .path
            .segments
            .last()
            .map_or_else(|| "_".to_string(), |s| s.ident.to_string()),
        Type::Reference(r) => type_name(&r.elem),
        _ => "_".to_string(),
    }
}
