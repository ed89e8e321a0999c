//! Pass 2 of a batch's lowering: the index arrays in the upload region
//! (tokens, child offsets and parents, the absolute rows gathers read and
//! child-gradient scatters write, the head's labels and pushed rows, the
//! touched rows of row-gradient parameters).

use ramus_core::graph::{NodeKind, Role, Source};
use ramus_core::ops::Op;
use ramus_core::vpps::isa::NO_INDEX;
use ramus_graph::NO_LABEL;

use super::{err, u32_of, FunctionIndex, Unroller};
use crate::error::Result;
use crate::persistent::program::GraphKey;

impl Unroller<'_> {
    /// Fills the index arrays (needs the regions' bases).
    pub(super) fn index_arrays(&mut self) -> Result<()> {
        for f in 0..self.model.functions.len() {
            let fi = self.function_index(f)?;
            self.functions.push(fi);
        }
        self.head_index()?;
        self.touched_rows();
        Ok(())
    }

    /// Vertex function `f`'s index arrays.
    fn function_index(&mut self, f: usize) -> Result<FunctionIndex> {
        let model = self.model;
        let s = self.s;
        let func = &model.functions[f];
        let rows = &s.functions[f];
        let mut fi = FunctionIndex::default();
        let fwd = &func.forward;
        if fwd.input_node(Source::Token).is_some() {
            let toks: Vec<u32> = rows.vertex.iter().map(|&v| s.tokens[v as usize]).collect();
            if let Some(bad) = toks.iter().find(|&&t| {
                fwd.nodes.iter().any(|n| {
                    matches!(n.op(), Some(Op::Embedding(_)))
                        && fwd.nodes[n.inputs[0]].ty.shape[0] <= t as usize
                })
            }) {
                return Err(err(format!(
                    "token id {bad} is outside the embedding table of function `{}`",
                    func.name
                )));
            }
            fi.tokens = Some(self.alloc_upload(&toks));
        }
        fi.edge_offsets = self.alloc_upload(&rows.edge_offsets);
        fi.edge_parent = self.alloc_upload(&rows.edge_parent);
        // absolute offsets of children's scattered rows (gathers) and
        // of their state-gradient rows (child-gradient scatters)
        let state_row = |u: &Self, v: u32, backward: bool| -> Result<u32> {
            let (cf, cr) = (
                s.vertex_function[v as usize] as usize,
                s.vertex_row[v as usize] as usize,
            );
            let cfunc = &model.functions[cf];
            let Some(scattered) = cfunc.scatter else {
                return Err(err(format!("function `{}` scatters no state", cfunc.name)));
            };
            if backward {
                match cfunc.output_grad_node(Role::Scatter) {
                    Some(n) => u.row_at(GraphKey::Backward(cf), n, cr),
                    None => Ok(NO_INDEX),
                }
            } else {
                u.row_at(GraphKey::Forward(cf), scattered, cr)
            }
        };
        let mut gather_ks = Vec::new();
        for node in &fwd.nodes {
            match node.kind {
                NodeKind::Input(Source::GatherAll) => {
                    let v: Vec<u32> = rows
                        .edge_child
                        .iter()
                        .map(|&c| state_row(self, c, false))
                        .collect::<Result<_>>()?;
                    fi.gather_all_src = Some(self.alloc_upload(&v));
                }
                NodeKind::Input(Source::Gather(k)) => gather_ks.push(k),
                _ => {}
            }
        }
        for k in gather_ks {
            let v: Vec<u32> = (0..rows.rows())
                .map(|r| match rows.child(r, k) {
                    Some(c) => state_row(self, c, false),
                    None => Ok(NO_INDEX),
                })
                .collect::<Result<_>>()?;
            fi.gather_src.insert(k, self.alloc_upload(&v));
        }
        for o in &func.backward.outputs {
            match o.role {
                Role::ChildGradAll => {
                    let v: Vec<u32> = rows
                        .edge_child
                        .iter()
                        .map(|&c| state_row(self, c, true))
                        .collect::<Result<_>>()?;
                    fi.child_grad_all_dst = Some(self.alloc_upload(&v));
                }
                Role::ChildGrad(k) => {
                    let v: Vec<u32> = (0..rows.rows())
                        .map(|r| match rows.child(r, k) {
                            Some(c) => state_row(self, c, true),
                            None => Ok(NO_INDEX),
                        })
                        .collect::<Result<_>>()?;
                    fi.child_grad_dst.insert(k, self.alloc_upload(&v));
                }
                Role::PullGrad => return Err(err("pulled inputs are not supported yet")),
                _ => {}
            }
        }
        Ok(fi)
    }

    /// The head's labels, the pushed rows it reads and where their
    /// gradients go.
    fn head_index(&mut self) -> Result<()> {
        let model = self.model;
        let s = self.s;
        let head = &model.head;
        if head.forward.input_node(Source::Label).is_some() {
            let mut labels = Vec::with_capacity(self.head_vertices.len());
            for &v in &self.head_vertices {
                let l = s.labels[v as usize];
                if l == NO_LABEL || l < 0 {
                    return Err(err(format!(
                        "graph {} of the batch has a head vertex without a label",
                        s.graph[v as usize]
                    )));
                }
                labels.push(l as u32);
            }
            self.labels_at = Some(self.alloc_upload(&labels));
        }
        let mut push_src = Vec::with_capacity(self.head_vertices.len());
        let mut grad_dst = Vec::with_capacity(self.head_vertices.len());
        for &v in &self.head_vertices {
            let (f, r) = (
                s.vertex_function[v as usize] as usize,
                s.vertex_row[v as usize] as usize,
            );
            let func = &model.functions[f];
            let Some(pushed) = func.push else {
                return Err(err(format!(
                    "function `{}` pushes nothing to the head",
                    func.name
                )));
            };
            push_src.push(self.row_at(GraphKey::Forward(f), pushed, r)?);
            grad_dst.push(match func.output_grad_node(Role::Push) {
                Some(n) => self.row_at(GraphKey::Backward(f), n, r)?,
                None => NO_INDEX,
            });
        }
        self.push_src_at = self.alloc_upload(&push_src);
        self.head_grad_dst_at = self.alloc_upload(&grad_dst);
        Ok(())
    }

    /// The touched rows of row-gradient parameters.
    fn touched_rows(&mut self) {
        let model = self.model;
        let s = self.s;
        for &p in &self.prog.row_grad_params {
            let mut touched: Vec<u32> = Vec::new();
            for (f, func) in model.functions.iter().enumerate() {
                if func
                    .backward
                    .outputs
                    .iter()
                    .any(|o| o.role == Role::ParamRowGrad(p))
                {
                    let rows = &s.functions[f];
                    touched.extend(rows.vertex.iter().map(|&v| s.tokens[v as usize]));
                }
            }
            touched.sort_unstable();
            touched.dedup();
            let at = self.alloc_upload(&touched);
            self.update_rows.insert(p, (at, touched.len()));
        }
    }

    /// Pool offset of an upload-region word.
    pub(super) fn up(&self, at: usize) -> Result<u32> {
        u32_of(self.bases[2] + at, "upload offset")
    }
}
