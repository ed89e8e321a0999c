//! What every rank of a data-parallel run knows of a global step before
//! it runs ([`StepPlan`]), worked out on the host from all ranks' graphs,
//! and which rows of a gradient a step sets ([`RowSet`]).

use ramus_core::graph::Role;
use ramus_core::{HeadRows, Model};
use ramus_graph::{GraphError, InputGraph, NO_LABEL};

use crate::error::{ExecError, Result};

/// What every rank knows of an optimizer step before it runs (see the
/// [`crate::data_parallel`] docs): the head rows of all ranks' graphs, and
/// for each row-gradient table ([`Model::row_grad_params`], ascending) the
/// rows that any rank's backward pass sets (sorted, unique): the rows one
/// engine would update for the whole global batch. With gradient
/// accumulation a step takes several batches, each with this plan (the
/// whole step's): all but the `last` only add their gradients to the sum.
#[derive(Clone, Debug, PartialEq)]
pub struct StepPlan {
    pub rows: usize,
    pub row_sets: Vec<(usize, Vec<u32>)>,
    /// Whether the batch is its step's last: the gradients summed so far
    /// (its own included) are summed over the ranks and applied.
    pub last: bool,
}

impl StepPlan {
    /// The plan of a global step of `graphs` (every rank's, in any order):
    /// their head rows ([`Model::head`]'s rows: each graph's roots, or its
    /// labelled vertices), and the tokens of the vertices whose function's
    /// backward pass sets each table's rows. A vertex the model cannot run
    /// is an error naming it, as in [`crate::Batch::new`].
    pub fn of(model: &Model, graphs: &[&InputGraph]) -> Result<StepPlan> {
        let tables: Vec<usize> = model.row_grad_params().into_iter().collect();
        // per function: the tables (indices into `tables`) its backward sets
        let sets: Vec<Vec<usize>> = model
            .functions
            .iter()
            .map(|f| {
                (0..tables.len())
                    .filter(|&t| {
                        let role = Role::ParamRowGrad(tables[t]);
                        f.backward.outputs.iter().any(|o| o.role == role)
                    })
                    .collect()
            })
            .collect();
        let mut row_sets: Vec<(usize, Vec<u32>)> =
            tables.iter().map(|&p| (p, Vec::new())).collect();
        let mut rows = 0;
        for (gi, g) in graphs.iter().enumerate() {
            rows += match model.head.rows {
                HeadRows::Roots => g.roots().len(),
                HeadRows::Labelled => g.labels.iter().filter(|&&l| l != NO_LABEL).count(),
            };
            if tables.is_empty() {
                continue;
            }
            for v in 0..g.len() {
                let f = model
                    .function_for(g.kind(v), g.children(v).len())
                    .map_err(|message| GraphError::Unfit {
                        place: g.describe(gi),
                        vertex: v,
                        message,
                    })?;
                for &t in &sets[f] {
                    row_sets[t].1.push(g.tokens[v]);
                }
            }
        }
        for (_, rows) in &mut row_sets {
            rows.sort_unstable();
            rows.dedup();
        }
        Ok(StepPlan {
            rows,
            row_sets,
            last: true,
        })
    }

    /// Refuses a step without head rows on any rank (nothing to average
    /// its loss over).
    pub fn check(&self) -> Result<()> {
        match self.rows {
            0 => Err(ExecError::Config(
                "data-parallel step: no rank had a head row in this step".into(),
            )),
            _ => Ok(()),
        }
    }

    /// A rank's share of the step's head rows: its gradients' and loss's
    /// scale before the sum over the ranks. A step without head rows on
    /// any rank is an error ([`check`](Self::check)).
    pub fn scale(&self, own_rows: usize) -> Result<f64> {
        self.check()?;
        Ok(own_rows as f64 / self.rows as f64)
    }

    /// The plan's rows as a host engine's row sets: for each trained
    /// parameter in `trained` order, its rows if it is a row-gradient
    /// table, else [`RowSet::Dense`].
    pub fn host_row_sets(&self, trained: &[usize]) -> Vec<RowSet> {
        trained
            .iter()
            .map(|p| match self.row_sets.iter().find(|(q, _)| q == p) {
                Some((_, rows)) => RowSet::Rows(rows.clone()),
                None => RowSet::Dense,
            })
            .collect()
    }
}

/// Which rows of a parameter's gradient are set: all of them (a dense
/// gradient), or some rows of an embedding table (sorted, unique).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowSet {
    Dense,
    Rows(Vec<u32>),
}
