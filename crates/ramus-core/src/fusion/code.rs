//! Member code of fused groups: template instantiation, signatures, operand variables.

use crate::error::Result;
use crate::graph::{DType, Graph, NodeId, NodeKind, Source, Space};
use crate::op::OpDef;
use crate::ops::Op;

use super::types::{group_error, node_error, FusedGroup, FusedInput, InputKind};

/// Replaces the placeholders `{0}`, `{1}`, ... of an elementwise template by
/// `operands`; `{{` and `}}` stand for literal braces.
pub fn instantiate(template: &str, operands: &[String]) -> std::result::Result<String, String> {
    let bytes = template.as_bytes();
    let mut out = String::with_capacity(template.len() + 8 * operands.len());
    let mut i = 0;
    let mut literal_start = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' if bytes.get(i + 1) == Some(&b'{') => {
                out.push_str(&template[literal_start..i]);
                out.push('{');
                i += 2;
                literal_start = i;
            }
            b'{' => {
                out.push_str(&template[literal_start..i]);
                let digits_end = bytes[i + 1..]
                    .iter()
                    .position(|b| !b.is_ascii_digit())
                    .map_or(bytes.len(), |p| i + 1 + p);
                if digits_end == i + 1 || bytes.get(digits_end) != Some(&b'}') {
                    return Err(format!(
                        "malformed placeholder at byte {i} of template `{template}`"
                    ));
                }
                let k: usize = template[i + 1..digits_end]
                    .parse()
                    .map_err(|_| format!("placeholder at byte {i} of `{template}` is too large"))?;
                let operand = operands.get(k).ok_or_else(|| {
                    format!(
                        "template `{template}` uses operand {{{k}}} but the op has {} operands",
                        operands.len()
                    )
                })?;
                out.push_str(operand);
                i = digits_end + 1;
                literal_start = i;
            }
            b'}' if bytes.get(i + 1) == Some(&b'}') => {
                out.push_str(&template[literal_start..i]);
                out.push('}');
                i += 2;
                literal_start = i;
            }
            b'}' => {
                return Err(format!(
                    "unmatched `}}` at byte {i} of template `{template}`"
                ))
            }
            _ => i += 1,
        }
    }
    out.push_str(&template[literal_start..]);
    Ok(out)
}

/// A member of a group as code (see [`FusedGroup::members_code`]): its op
/// signature, operand variables and C expression.
pub struct MemberCode {
    pub signature: String,
    pub operands: Vec<String>,
    pub expr: String,
}

impl FusedGroup {
    /// `fused vertex×256 [%7 %8] in(%5, %4 bcast, %3 window %2[0..256]/512,
    /// %6 childsum %1) out(%8) cat(%8→%9[0..256])`.
    pub(super) fn header(&self) -> String {
        let space = match self.space {
            Space::Vertex => "vertex",
            Space::Edge => "edge",
            Space::Static => "static",
        };
        let ids = |xs: &[NodeId]| {
            let shown: Vec<String> = xs.iter().map(|v| format!("%{v}")).collect();
            shown.join(" ")
        };
        let inputs: Vec<String> = self
            .inputs
            .iter()
            .map(|i| match i.kind {
                InputKind::PerElement => format!("%{}", i.node),
                InputKind::Broadcast => format!("%{} bcast", i.node),
                InputKind::Window {
                    source,
                    offset,
                    stride,
                } => format!(
                    "%{} window %{source}[{offset}..{}]/{stride}",
                    i.node,
                    offset + self.width
                ),
                InputKind::ChildSum { source } => format!("%{} childsum %{source}", i.node),
                InputKind::ParentRow { source } => format!("%{} parent %{source}", i.node),
            })
            .collect();
        let mut s = format!(
            "fused {space}×{} [{}] in({}) out({})",
            self.width,
            ids(&self.nodes),
            inputs.join(", "),
            ids(&self.outputs),
        );
        if !self.concat_writes.is_empty() {
            let writes: Vec<String> = self
                .concat_writes
                .iter()
                .map(|w| {
                    format!(
                        "%{}→%{}[{}..{}]",
                        w.member,
                        w.concat,
                        w.offset,
                        w.offset + self.width
                    )
                })
                .collect();
            s += &format!(" cat({})", writes.join(", "));
        }
        s
    }

    /// Short name for errors: `fused group [%7 %8]`.
    pub fn describe(&self) -> String {
        let ids: Vec<String> = self.nodes.iter().map(|v| format!("%{v}")).collect();
        format!("fused group [{}]", ids.join(" "))
    }

    /// The concats this group writes into, each once, in order of their
    /// first entry in [`concat_writes`](Self::concat_writes) (the buffers
    /// `ramus_cpu::fused::eval_group` takes).
    pub fn concat_targets(&self) -> Vec<NodeId> {
        let mut targets: Vec<NodeId> = Vec::new();
        for w in &self.concat_writes {
            if !targets.contains(&w.concat) {
                targets.push(w.concat);
            }
        }
        targets
    }

    /// The variable holding value `x` inside the kernel: `t<j>` for member
    /// `j` computed before member `before`, `a<k>` for input `k`.
    fn variable(&self, x: NodeId, before: usize) -> Option<String> {
        if let Some(j) = self.nodes[..before].iter().position(|&m| m == x) {
            return Some(format!("t{j}"));
        }
        self.inputs
            .iter()
            .position(|i| i.node == x)
            .map(|k| format!("a{k}"))
    }

    /// Checks that a window or concat `what` of `self.width` columns at
    /// `offset` fits rows of `stride`, and that `node` is a row value of
    /// the group's space and that width — or, for a forward value a
    /// backward graph reads (stored by the forward graph's plan, whose row
    /// stride the backward graph does not know), of the group's width.
    fn check_strided(
        &self,
        graph: &Graph,
        what: &str,
        node: NodeId,
        offset: usize,
        stride: usize,
    ) -> Result<()> {
        if offset
            .checked_add(self.width)
            .is_none_or(|end| end > stride)
        {
            return Err(group_error(
                self,
                format!(
                    "{what} columns {offset}..{} do not fit rows of width {stride}",
                    offset.saturating_add(self.width)
                ),
            ));
        }
        let ty = &graph
            .nodes
            .get(node)
            .ok_or_else(|| group_error(self, format!("{what} %{node} is not in the graph")))?
            .ty;
        let forward_value = matches!(graph.nodes[node].kind, NodeKind::Input(Source::Forward(_)));
        let width = if forward_value { self.width } else { stride };
        if ty.space != self.space || !ty.is_rows() || ty.width() != width {
            return Err(group_error(
                self,
                format!(
                    "{what} %{node} has type {ty}, expected {:?} rows of width {width}",
                    self.space
                ),
            ));
        }
        Ok(())
    }

    /// Checks that a [`ChildSum`](InputKind::ChildSum) or
    /// [`ParentRow`](InputKind::ParentRow) input is what its kind says: the
    /// input node is a `sum_children` (`expand_children`) of `source`, a
    /// float edge-row (vertex-row) value of the group's width, and the group
    /// runs over vertex (edge) rows.
    fn check_inline_read(&self, graph: &Graph, input: &FusedInput) -> Result<()> {
        let (source, from, to, op) = match input.kind {
            InputKind::ChildSum { source } => (source, Space::Edge, Space::Vertex, "sum_children"),
            InputKind::ParentRow { source } => {
                (source, Space::Vertex, Space::Edge, "expand_children")
            }
            _ => return Ok(()),
        };
        let what = format!(
            "input %{} ({} of %{source})",
            input.node,
            input.kind.short()
        );
        let node = graph
            .nodes
            .get(input.node)
            .ok_or_else(|| group_error(self, format!("{what} is not in the graph")))?;
        let is_op = match input.kind {
            InputKind::ChildSum { .. } => node.op().is_some_and(Op::is_child_sum),
            _ => node.op().is_some_and(Op::is_expand_children),
        };
        if !is_op || node.inputs != [source] {
            return Err(group_error(self, format!("{what} is not {op}(%{source})")));
        }
        if self.space != to {
            return Err(group_error(
                self,
                format!(
                    "{what} is read by a group of {:?} rows, expected {to:?}",
                    self.space
                ),
            ));
        }
        let ty = &graph
            .nodes
            .get(source)
            .ok_or_else(|| group_error(self, format!("{what}: source is not in the graph")))?
            .ty;
        if ty.space != from || ty.dtype != DType::Float || ty.width() != self.width {
            return Err(group_error(
                self,
                format!(
                    "{what}: source has type {ty}, expected float {from:?} rows of width {}",
                    self.width
                ),
            ));
        }
        Ok(())
    }

    /// Checks the group against `graph` and renders each member as code.
    pub fn members_code(&self, graph: &Graph) -> Result<Vec<MemberCode>> {
        if self.nodes.is_empty() {
            return Err(group_error(self, "has no members"));
        }
        if let Some(&o) = self.outputs.iter().find(|o| !self.nodes.contains(o)) {
            return Err(group_error(self, format!("output %{o} is not a member")));
        }
        for input in &self.inputs {
            if let InputKind::Window {
                source,
                offset,
                stride,
            } = input.kind
            {
                self.check_strided(graph, "window source", source, offset, stride)?;
            }
            self.check_inline_read(graph, input)?;
        }
        for w in &self.concat_writes {
            if !self.nodes.contains(&w.member) {
                return Err(group_error(
                    self,
                    format!("concat write of %{}, which is not a member", w.member),
                ));
            }
            self.check_strided(graph, "concat", w.concat, w.offset, w.stride)?;
        }
        let mut code = Vec::with_capacity(self.nodes.len());
        for (j, &m) in self.nodes.iter().enumerate() {
            let node = graph
                .nodes
                .get(m)
                .ok_or_else(|| group_error(self, format!("member %{m} is not in the graph")))?;
            let op = node
                .op()
                .ok_or_else(|| node_error(graph, m, "fused member is not an op node"))?;
            let template = op
                .elementwise_template()
                .ok_or_else(|| node_error(graph, m, "fused member has no elementwise template"))?;
            if node.ty.space != self.space || node.ty.width() != self.width {
                return Err(node_error(
                    graph,
                    m,
                    format!(
                        "type {} does not match the group's {:?} rows of width {}",
                        node.ty, self.space, self.width
                    ),
                ));
            }
            let operands = node
                .inputs
                .iter()
                .map(|&x| {
                    self.variable(x, j).ok_or_else(|| {
                        node_error(
                            graph,
                            m,
                            format!("operand %{x} is neither an earlier member nor an input"),
                        )
                    })
                })
                .collect::<Result<Vec<String>>>()?;
            let expr = instantiate(&template, &operands).map_err(|e| node_error(graph, m, e))?;
            code.push(MemberCode {
                signature: op.signature(),
                operands,
                expr,
            });
        }
        Ok(code)
    }

    /// A normalized description of the computation — input kinds, member op
    /// signatures with operand variables, outputs, concat writes —
    /// independent of node ids, space, width, window and concat strides and
    /// offsets: equal signatures mean equal kernels (a cache key).
    pub fn signature(&self, graph: &Graph) -> Result<String> {
        let code = self.members_code(graph)?;
        let inputs: Vec<String> = self
            .inputs
            .iter()
            .enumerate()
            .map(|(k, i)| format!("a{k}:{}", i.kind.short()))
            .collect();
        let members: Vec<String> = code
            .iter()
            .enumerate()
            .map(|(j, c)| format!("t{j}={}({})", c.signature, c.operands.join(",")))
            .collect();
        let outputs = self.output_members()?;
        let outputs: Vec<String> = outputs.iter().map(|j| format!("t{j}")).collect();
        let mut s = format!(
            "in[{}] {} out[{}]",
            inputs.join(","),
            members.join(" "),
            outputs.join(",")
        );
        if !self.concat_writes.is_empty() {
            let writes: Vec<String> = self
                .concat_write_members()?
                .iter()
                .map(|j| format!("t{j}"))
                .collect();
            s += &format!(" cat[{}]", writes.join(","));
        }
        Ok(s)
    }

    /// Member index of each output.
    pub fn output_members(&self) -> Result<Vec<usize>> {
        self.outputs
            .iter()
            .map(|o| {
                self.nodes
                    .iter()
                    .position(|m| m == o)
                    .ok_or_else(|| group_error(self, format!("output %{o} is not a member")))
            })
            .collect()
    }

    /// Member index of each concat write.
    pub fn concat_write_members(&self) -> Result<Vec<usize>> {
        self.concat_writes
            .iter()
            .map(|w| {
                self.nodes
                    .iter()
                    .position(|&m| m == w.member)
                    .ok_or_else(|| {
                        group_error(
                            self,
                            format!("concat write of %{}, which is not a member", w.member),
                        )
                    })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_parsed_not_pattern_replaced() {
        let ops = ["t0".to_string(), "a11".to_string()];
        assert_eq!(
            instantiate("({0} * {1} + {0})", &ops).as_deref(),
            Ok("(t0 * a11 + t0)")
        );
        assert_eq!(instantiate("{{x}} {1}", &ops).as_deref(), Ok("{x} a11"));
        assert!(instantiate("{2}", &ops)
            .unwrap_err()
            .contains("operand {2}"));
        assert!(instantiate("{a}", &ops).unwrap_err().contains("malformed"));
        assert!(instantiate("{0", &ops).unwrap_err().contains("malformed"));
        assert!(instantiate("x}", &ops).unwrap_err().contains("unmatched"));
        assert_eq!(
            instantiate("expf(-1.0f)", &[]).as_deref(),
            Ok("expf(-1.0f)")
        );
    }
}
