//! Plan queries, the `ramus inspect` listing and `Display`.

use std::fmt;

use crate::graph::{Graph, NodeId};

use super::types::{FusedGroup, FusionPlan, SliceView, Step};

impl FusionPlan {
    /// The fused groups, in step order.
    pub fn groups(&self) -> impl Iterator<Item = &FusedGroup> {
        self.steps.iter().filter_map(|s| match s {
            Step::Fused(g) => Some(g),
            Step::Op(_) => None,
        })
    }

    /// Kernels launched per run of the phase (one per step).
    pub fn kernel_launches(&self) -> usize {
        self.steps.len()
    }

    /// Op nodes covered by the plan (steps, views, in-place concats and
    /// inline reads).
    pub fn op_count(&self) -> usize {
        self.steps
            .iter()
            .map(|s| match s {
                Step::Op(_) => 1,
                Step::Fused(g) => g.nodes.len(),
            })
            .sum::<usize>()
            + self.views.len()
            + self.in_place_concats.len()
            + self.inline_reads.len()
    }

    /// The view of `slice`, if the plan reads that slice in place.
    pub fn view(&self, slice: NodeId) -> Option<&SliceView> {
        self.views.iter().find(|v| v.slice == slice)
    }

    /// True if `concat` has no step: fused groups write it in place.
    pub fn is_in_place_concat(&self, concat: NodeId) -> bool {
        self.in_place_concats.contains(&concat)
    }

    /// True if `node` (a `sum_children` or `expand_children`) has no step
    /// and no buffer: the fused groups reading it read its operand through
    /// the row topology.
    pub fn is_inline_read(&self, node: NodeId) -> bool {
        self.inline_reads.contains(&node)
    }

    /// A readable listing with each node's op, operands and type
    /// (`ramus inspect`); `params` names parameters.
    pub fn listing(&self, graph: &Graph, params: &[String]) -> String {
        let line = |v: NodeId| match graph.nodes.get(v) {
            Some(node) => {
                let ins: Vec<String> = node.inputs.iter().map(|x| format!("%{x}")).collect();
                format!(
                    "%{v} = {}({}) : {}",
                    node.describe(params),
                    ins.join(", "),
                    node.ty
                )
            }
            None => format!("%{v} = ? (not in the graph)"),
        };
        let mut s = format!(
            "{} ops in {} kernels ({} fused groups",
            self.op_count(),
            self.kernel_launches(),
            self.groups().count()
        );
        if !self.views.is_empty() || !self.in_place_concats.is_empty() {
            s += &format!(
                ", {} slice views, {} concats in place",
                self.views.len(),
                self.in_place_concats.len()
            );
        }
        if !self.inline_reads.is_empty() {
            s += &format!(", {} inline reads", self.inline_reads.len());
        }
        s += ")\n";
        for step in &self.steps {
            match step {
                Step::Op(v) => s += &format!("{}\n", line(*v)),
                Step::Fused(g) => {
                    s += &format!("{}\n", g.header());
                    for &v in &g.nodes {
                        s += &format!("    {}\n", line(v));
                    }
                }
            }
        }
        for v in &self.views {
            s += &format!(
                "view {}  (in place: columns {}..{} of %{}, stride {})\n",
                line(v.slice),
                v.offset,
                v.offset + v.len,
                v.source,
                v.stride
            );
        }
        for &c in &self.in_place_concats {
            s += &format!("in place {}  (written by fused groups)\n", line(c));
        }
        for &v in &self.inline_reads {
            let how = match graph.nodes.get(v).and_then(|n| n.op()) {
                Some(op) if op.is_child_sum() => "CSR offsets",
                _ => "parent indices",
            };
            s += &format!("inline {}  (read by fused groups through {how})\n", line(v));
        }
        s
    }
}

impl fmt::Display for FusionPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for step in &self.steps {
            match step {
                Step::Op(v) => writeln!(f, "op %{v}")?,
                Step::Fused(g) => writeln!(f, "{}", g.header())?,
            }
        }
        for v in &self.views {
            writeln!(
                f,
                "view %{} = %{}[{}..{}]",
                v.slice,
                v.source,
                v.offset,
                v.offset + v.len
            )?;
        }
        for &c in &self.in_place_concats {
            writeln!(f, "concat in place %{c}")?;
        }
        for &v in &self.inline_reads {
            writeln!(f, "inline read %{v}")?;
        }
        Ok(())
    }
}
