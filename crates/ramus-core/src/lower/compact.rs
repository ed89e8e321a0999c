//! Hoisting token-only values into a per-token table, and compaction (dead-value removal and renumbering).

use super::types::{
    scalar_deps, scalar_vectors, vec_deps, CellProgram, ScalarExpr, ScalarId, ScalarNode, Scope,
    VecExpr, VecId, VecNode,
};

/// A program whose token-only values come from a per-token table, and the
/// program that computes that table (see [`CellProgram::hoist_token_values`]).
#[derive(Clone, Debug)]
pub struct Hoisted {
    /// The cell, reading the hoisted values from [`VecExpr::TokenTable`].
    pub program: CellProgram,
    /// One output: the hoisted values of a token, side by side (`width`
    /// columns), for a vertex with that token and no children.
    pub table: CellProgram,
    pub width: usize,
}

impl CellProgram {
    /// Computation hoisting (Cortex §4.3): the vertex scalars that depend on
    /// the vertex's token alone (an input projection `W x + b` of its word
    /// vector, and anything computed from only such values), where a value
    /// that does not leaves them, are computed once per token into a table
    /// at load; the cell then reads them. `None` when nothing worth a table
    /// (a product or an op) depends on the token alone.
    pub fn hoist_token_values(&self) -> Option<Hoisted> {
        let mut vec_token = vec![false; self.vectors.len()];
        for (v, node) in self.vectors.iter().enumerate() {
            vec_token[v] = node.scope == Scope::Vertex
                && match &node.expr {
                    VecExpr::Embedding { .. }
                    | VecExpr::EmbeddingUnk { .. }
                    | VecExpr::One
                    | VecExpr::Param(_) => true,
                    VecExpr::Slice { src, .. } => vec_token[*src],
                    VecExpr::Concat { parts } => parts.iter().all(|&(p, _)| vec_token[p]),
                    VecExpr::Map { args, .. } => args.iter().all(|&a| vec_token[a]),
                    _ => false,
                };
        }
        let mut token_only = vec![false; self.scalars.len()];
        for (id, s) in self.scalars.iter().enumerate() {
            token_only[id] = s.scope == Scope::Vertex
                && match &s.expr {
                    ScalarExpr::Dot { input, .. } | ScalarExpr::ColumnDot { input, .. } => {
                        vec_token[*input]
                    }
                    ScalarExpr::RowDot { matrix, vector, .. } => {
                        vec_token[*matrix] && vec_token[*vector]
                    }
                    ScalarExpr::Read { src, .. } => vec_token[*src],
                    ScalarExpr::Param { .. } => true,
                    ScalarExpr::Map { args, .. } => args.iter().all(|&a| token_only[a]),
                    ScalarExpr::ChildSum(_) => false,
                };
        }
        // the frontier: token-only values read by other values or output,
        // unless they are mere reads (nothing to save)
        let mut read_outside = vec![false; self.scalars.len()];
        for (id, s) in self.scalars.iter().enumerate() {
            if !token_only[id] {
                for d in scalar_deps(&s.expr) {
                    read_outside[d] = true;
                }
            }
        }
        for lanes in &self.outputs {
            for &s in lanes {
                read_outside[s] = true;
            }
        }
        let frontier: Vec<ScalarId> = (0..self.scalars.len())
            .filter(|&id| {
                token_only[id]
                    && read_outside[id]
                    && matches!(
                        self.scalars[id].expr,
                        ScalarExpr::Dot { .. }
                            | ScalarExpr::RowDot { .. }
                            | ScalarExpr::ColumnDot { .. }
                            | ScalarExpr::Map { .. }
                    )
            })
            .collect();
        if frontier.is_empty() {
            return None;
        }
        let u = self.units;
        let width = frontier.len() * u;
        let mut table = self.clone();
        table.outputs = vec![frontier.clone()];
        let mut program = self.clone();
        program.vectors.push(VecNode {
            expr: VecExpr::TokenTable,
            width,
            scope: Scope::Vertex,
            stage: 0,
        });
        let t = program.vectors.len() - 1;
        for (q, &id) in frontier.iter().enumerate() {
            program.scalars[id].expr = ScalarExpr::Read { src: t, col: q * u };
        }
        Some(Hoisted {
            program: program.compact(),
            table: table.compact(),
            width,
        })
    }

    /// Marks everything the live scalars and vectors read as live.
    fn mark_live(&self, live_s: &mut [bool], live_v: &mut [bool]) {
        for id in (0..self.scalars.len()).rev() {
            if !live_s[id] {
                continue;
            }
            for d in scalar_deps(&self.scalars[id].expr) {
                live_s[d] = true;
            }
            for v in scalar_vectors(&self.scalars[id].expr) {
                live_v[v] = true;
            }
        }
        for v in (0..self.vectors.len()).rev() {
            if live_v[v] {
                for d in vec_deps(&self.vectors[v].expr) {
                    live_v[d] = true;
                }
            }
        }
    }

    /// Which scalars and vectors the outputs need: the outputs, what live
    /// values read, and the stores live vectors read back.
    fn live(&self) -> (Vec<bool>, Vec<bool>) {
        let mut live_s = vec![false; self.scalars.len()];
        let mut live_v = vec![false; self.vectors.len()];
        for lanes in &self.outputs {
            for &s in lanes {
                live_s[s] = true;
            }
        }
        // a store is live when a live vector reads its columns, and a later
        // stage's read can make an earlier stage's store live: iterate
        loop {
            self.mark_live(&mut live_s, &mut live_v);
            let mut changed = false;
            for &(sc, col) in self.stores.iter().flatten() {
                let read = self.vectors.iter().enumerate().any(|(v, node)| {
                    live_v[v]
                        && matches!(node.expr, VecExpr::Staged { slot } if slot <= col && col < slot + node.width)
                });
                if read && !live_s[sc] {
                    live_s[sc] = true;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        (live_s, live_v)
    }

    /// The program without the vectors and scalars no output needs,
    /// renumbered in order.
    pub fn compact(&self) -> CellProgram {
        let (live_s, live_v) = self.live();
        let renumber = |live: &[bool]| {
            let mut map = vec![usize::MAX; live.len()];
            let mut next = 0;
            for (i, &l) in live.iter().enumerate() {
                if l {
                    map[i] = next;
                    next += 1;
                }
            }
            map
        };
        let (vmap, smap) = (renumber(&live_v), renumber(&live_s));
        let vectors = self
            .vectors
            .iter()
            .enumerate()
            .filter(|&(v, _)| live_v[v])
            .map(|(_, node)| renumber_vector(node, &vmap))
            .collect();
        let scalars = self
            .scalars
            .iter()
            .enumerate()
            .filter(|&(id, _)| live_s[id])
            .map(|(_, s)| renumber_scalar(s, &vmap, &smap))
            .collect();
        CellProgram {
            units: self.units,
            vectors,
            scalars,
            outputs: self
                .outputs
                .iter()
                .map(|lanes| lanes.iter().map(|&s| smap[s]).collect())
                .collect(),
            stages: self.stages,
            stores: self
                .stores
                .iter()
                .map(|stage| {
                    stage
                        .iter()
                        .filter(|&&(sc, _)| live_s[sc])
                        .map(|&(sc, col)| (smap[sc], col))
                        .collect()
                })
                .collect(),
            scratch_width: self.scratch_width,
        }
    }
}

/// Vector `node` with its vector operands renumbered by `vmap`.
fn renumber_vector(node: &VecNode, vmap: &[VecId]) -> VecNode {
    let expr = match &node.expr {
        VecExpr::Slice { src, offset } => VecExpr::Slice {
            src: vmap[*src],
            offset: *offset,
        },
        VecExpr::Concat { parts } => VecExpr::Concat {
            parts: parts.iter().map(|&(p, w)| (vmap[p], w)).collect(),
        },
        VecExpr::Map { op, node, args } => VecExpr::Map {
            op: op.clone(),
            node: *node,
            args: args.iter().map(|&a| vmap[a]).collect(),
        },
        VecExpr::SumChildren(src) => VecExpr::SumChildren(vmap[*src]),
        VecExpr::Parent(src) => VecExpr::Parent(vmap[*src]),
        other => other.clone(),
    };
    VecNode {
        expr,
        ..node.clone()
    }
}

/// Scalar `s` with its operands renumbered by `vmap` (vectors) and `smap`
/// (scalars).
fn renumber_scalar(s: &ScalarNode, vmap: &[VecId], smap: &[ScalarId]) -> ScalarNode {
    let expr = match &s.expr {
        ScalarExpr::Dot {
            weight,
            row,
            input,
            k,
        } => ScalarExpr::Dot {
            weight: *weight,
            row: *row,
            input: vmap[*input],
            k: *k,
        },
        ScalarExpr::Read { src, col } => ScalarExpr::Read {
            src: vmap[*src],
            col: *col,
        },
        ScalarExpr::RowDot {
            matrix,
            row,
            vector,
            k,
        } => ScalarExpr::RowDot {
            matrix: vmap[*matrix],
            row: *row,
            vector: vmap[*vector],
            k: *k,
        },
        ScalarExpr::ColumnDot {
            input,
            weight,
            base,
            step,
            offset,
            stride,
            k,
        } => ScalarExpr::ColumnDot {
            input: vmap[*input],
            weight: *weight,
            base: *base,
            step: *step,
            offset: *offset,
            stride: *stride,
            k: *k,
        },
        ScalarExpr::Map { op, node, args } => ScalarExpr::Map {
            op: op.clone(),
            node: *node,
            args: args.iter().map(|&a| smap[a]).collect(),
        },
        ScalarExpr::ChildSum(src) => ScalarExpr::ChildSum(smap[*src]),
        other => other.clone(),
    };
    ScalarNode {
        expr,
        scope: s.scope,
        stage: s.stage,
    }
}
