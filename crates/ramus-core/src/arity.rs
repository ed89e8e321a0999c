//! Which children a vertex function reads, derived from its inputs
//! (`gather(k)`, `gather_optional(k)`, `gather_all()`), and the check that
//! a vertex fits the function a model runs there: input structure a model
//! cannot read is refused, never silently ignored (a binary cell given a
//! third child would drop it; given one child, read zeros for the second).

use std::fmt;

use crate::graph::{Graph, NodeKind, Source};

/// Which vertex function runs at a vertex.
///
/// A vertex is described to the selector by its *kind* (a small integer the
/// input graph carries per vertex, `InputGraph::kind`; 0 unless the reader
/// that built the graph set one) and its number of children. `Single` and
/// `LeafInternal` look only at the children; `ByKind` only at the kind, so
/// one graph can mix several roles — the forward and backward steps and the
/// output vertices of a BiLSTM tagger, the character steps of its
/// character model — that have the same shape of children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FunctionSelector {
    /// One function everywhere.
    Single(usize),
    /// One function for vertices without children, another for the rest.
    LeafInternal { leaf: usize, internal: usize },
    /// Entry `k` is the function of vertices of kind `k`; a vertex whose
    /// kind has no entry cannot be scheduled (an error naming the vertex).
    ByKind(Vec<usize>),
}

impl FunctionSelector {
    /// The function for a vertex of `kind` with `children` children, or
    /// `None` for a kind a `ByKind` table does not list.
    #[inline]
    pub fn select(&self, kind: u16, children: usize) -> Option<usize> {
        match self {
            FunctionSelector::Single(f) => Some(*f),
            FunctionSelector::LeafInternal { leaf, internal } => {
                Some(if children == 0 { *leaf } else { *internal })
            }
            FunctionSelector::ByKind(table) => table.get(usize::from(kind)).copied(),
        }
    }

    /// Every function the selector can name (with repeats, in table order).
    pub fn functions(&self) -> Vec<usize> {
        match self {
            FunctionSelector::Single(f) => vec![*f],
            FunctionSelector::LeafInternal { leaf, internal } => vec![*leaf, *internal],
            FunctionSelector::ByKind(table) => table.clone(),
        }
    }
}

/// The number of children a vertex function reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arity {
    /// `gather_all()`: every child, however many.
    Any,
    /// `gather(k)` for children `k < max`: a vertex must have no children
    /// at all (the start of a chain: every `gather` reads zeros) or between
    /// `min` and `max`. `min < max` only where `gather_optional(k)` made
    /// children `min..max` optional (a word step whose previous step the
    /// first word lacks).
    Fixed { min: usize, max: usize },
}

impl Arity {
    /// What `forward` reads: `Any` if it gathers all children, else
    /// children up to its largest `gather(k)`, of which those from
    /// `optional_from` on may be missing.
    pub fn of(forward: &Graph, optional_from: Option<usize>) -> Arity {
        if forward.input_node(Source::GatherAll).is_some() {
            return Arity::Any;
        }
        let max = forward
            .nodes
            .iter()
            .filter_map(|n| match n.kind {
                NodeKind::Input(Source::Gather(k)) => Some(k + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let min = optional_from.map_or(max, |o| o.min(max));
        Arity::Fixed { min, max }
    }

    /// Whether a vertex with `children` children fits.
    #[inline]
    pub fn admits(self, children: usize) -> bool {
        match self {
            Arity::Any => true,
            Arity::Fixed { min, max } => children == 0 || (min..=max).contains(&children),
        }
    }

    /// True for a function that reads exactly two children (a binary
    /// composition: `--binarize` makes trees fit it).
    pub fn is_binary(self) -> bool {
        self == Arity::Fixed { min: 2, max: 2 }
    }
}

impl fmt::Display for Arity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural = |n: usize| if n == 1 { "" } else { "ren" };
        match *self {
            Arity::Any => write!(f, "any number of children"),
            Arity::Fixed { max: 0, .. } => write!(f, "no children"),
            Arity::Fixed { min, max } if min == max => {
                write!(f, "exactly {max} child{} (or none)", plural(max))
            }
            Arity::Fixed { min, max } => write!(f, "{min} to {max} children (or none)"),
        }
    }
}

/// What an input graph must fit: which function a model runs at a vertex
/// and what that function reads. [`Model::function_for`](crate::Model::function_for) answers from the
/// model; a check of whole graphs ([`VertexRules::check`]: the compiled
/// engines per batch, the command line per file) uses this snapshot,
/// taken once with [`VertexRules::of`].
#[derive(Clone, Debug, PartialEq)]
pub struct VertexRules {
    model: String,
    selector: FunctionSelector,
    /// Name and arity of every function.
    functions: Vec<(String, Arity)>,
    /// Bit `c` of entry `k`: a vertex of kind `k` (any kind, entry 0,
    /// unless the selector goes by kind) with `c < 64` children fits —
    /// one load and a shift per vertex, without the data-dependent
    /// branches of the selection (leaves and internal vertices alternate).
    fits: Vec<u64>,
}

impl VertexRules {
    /// The rules of a model named `model` whose `selector` picks among
    /// `functions` (name and arity of each).
    pub(crate) fn new(
        model: String,
        selector: FunctionSelector,
        functions: Vec<(String, Arity)>,
    ) -> VertexRules {
        let mut rules = VertexRules {
            model,
            selector,
            functions,
            fits: Vec::new(),
        };
        let kinds = match &rules.selector {
            FunctionSelector::ByKind(table) => table.len(),
            _ => 1,
        };
        rules.fits = (0..kinds)
            .map(|k| {
                (0..64).fold(0u64, |bits, c| {
                    let fits = rules.function_for(k as u16, c).is_ok();
                    bits | (u64::from(fits) << c)
                })
            })
            .collect();
        rules
    }

    /// Whether a vertex of `kind` with `children` children fits (else
    /// why not: [`Model::function_for`](crate::Model::function_for)'s message).
    #[inline]
    pub fn check(&self, kind: u16, children: usize) -> Result<(), String> {
        let row = match self.selector {
            FunctionSelector::ByKind(_) => usize::from(kind),
            _ => 0,
        };
        let bits = self.fits.get(row).copied().unwrap_or(0);
        if children < 64 && (bits >> children) & 1 == 1 {
            return Ok(());
        }
        self.function_for(kind, children).map(drop)
    }

    /// See [`Model::function_for`](crate::Model::function_for).
    fn function_for(&self, kind: u16, children: usize) -> Result<usize, String> {
        function_for(&self.model, &self.selector, kind, children, |f| {
            self.functions.get(f).map(|(n, a)| (n.as_str(), *a))
        })
    }
}

/// The function `selector` runs at a vertex of `kind` with `children`
/// children, if it reads them (`function(f)`: the name and arity of
/// function `f`); else why not. No allocation unless the vertex is refused.
#[inline]
pub(crate) fn function_for<'a>(
    model: &str,
    selector: &FunctionSelector,
    kind: u16,
    children: usize,
    function: impl Fn(usize) -> Option<(&'a str, Arity)>,
) -> Result<usize, String> {
    let Some(f) = selector.select(kind, children) else {
        return Err(no_function(model, kind));
    };
    match function(f) {
        Some((_, arity)) if arity.admits(children) => Ok(f),
        Some((name, arity)) => Err(refusal(model, name, arity, children)),
        None => Err(missing(model, f)),
    }
}

#[cold]
fn no_function(model: &str, kind: u16) -> String {
    format!("has kind {kind}, which no vertex function of model `{model}` runs")
}

#[cold]
fn missing(model: &str, f: usize) -> String {
    format!("model `{model}` selects vertex function {f}, which does not exist")
}

/// Why a vertex with `children` children cannot run function `name`.
#[cold]
fn refusal(model: &str, name: &str, arity: Arity, children: usize) -> String {
    let (first, last, fate) = match arity {
        Arity::Fixed { max, .. } if children > max => (max, children - 1, "be ignored"),
        Arity::Fixed { min, .. } => (children, min.saturating_sub(1), "read zeros"),
        Arity::Any => (0, 0, ""),
    };
    let what = match last.saturating_sub(first) {
        0 => format!("child {first} would {fate}"),
        _ => format!("children {first} to {last} would {fate}"),
    };
    let hint = if arity.is_binary() {
        "; rewrite the trees with `--binarize left` or `--binarize right` to use this model"
    } else {
        ""
    };
    format!(
        "has {children} child{}, but vertex function `{name}` of model `{model}` reads {arity}: \
         {what}{hint}",
        if children == 1 { "" } else { "ren" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_arity_admits_none_or_its_range() {
        let binary = Arity::Fixed { min: 2, max: 2 };
        assert!(binary.admits(0) && binary.admits(2));
        assert!(!binary.admits(1) && !binary.admits(3));
        let optional = Arity::Fixed { min: 2, max: 3 };
        assert!(optional.admits(2) && optional.admits(3) && !optional.admits(1));
        let leaf = Arity::Fixed { min: 0, max: 0 };
        assert!(leaf.admits(0) && !leaf.admits(1));
        assert!(Arity::Any.admits(0) && Arity::Any.admits(40));
        assert!(binary.is_binary() && !optional.is_binary());
        assert_eq!(binary.to_string(), "exactly 2 children (or none)");
        assert_eq!(leaf.to_string(), "no children");
        assert_eq!(
            Arity::Fixed { min: 1, max: 1 }.to_string(),
            "exactly 1 child (or none)"
        );
        assert_eq!(optional.to_string(), "2 to 3 children (or none)");
    }
}
