//! `--binarize left|right` and the structure check every command that reads
//! graphs makes right after reading them: a vertex the model cannot run as
//! it is (a third child of a binary cell, a one-child vertex for it) is
//! refused before any work, naming its file:line and vertex, instead of
//! when its batch comes up (or, before, silently misread).

use crate::result::AnyResult;
use ramus_core::{Model, VertexRules};
use ramus_graph::binarize::{binarize, Side};
use ramus_graph::{check_structure, InputGraph};
use ramus_nn::DataKind;

use crate::data::Splits;

/// The structure options of the commands that read trees.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct StructureArgs {
    /// Rewrite every tree so that each internal vertex has two children
    /// (for the binary models: treelstm-nary, treefc, mvrnn, rvnn): a
    /// vertex with more children becomes a chain of binary vertices nested
    /// to the left, ((c1 c2) c3)..., or to the right, c1 (c2 (c3 ...)); a
    /// one-child vertex is replaced by its child, which takes its label.
    /// Without it such trees are refused.
    #[arg(long)]
    pub binarize: Option<Side>,
}

impl StructureArgs {
    /// Binarizes `graphs` when asked (tree data only), then checks that
    /// `model` can run every vertex.
    pub fn fit(&self, model: &Model, kind: DataKind, graphs: &mut [InputGraph]) -> AnyResult {
        if let Some(side) = self.binarize {
            if kind != DataKind::Trees {
                return Err(format!(
                    "--binarize rewrites trees; `{}` does not read trees as they are",
                    model.name
                )
                .into());
            }
            for (i, g) in graphs.iter_mut().enumerate() {
                *g = binarize(g, side, i)?;
            }
        }
        let rules = VertexRules::of(model);
        check_structure(graphs.iter(), |kind, children| rules.check(kind, children))?;
        Ok(())
    }

    /// [`StructureArgs::fit`] over the train, dev and test splits.
    pub fn fit_splits(&self, model: &Model, kind: DataKind, data: &mut Splits) -> AnyResult {
        for split in [&mut data.train, &mut data.dev, &mut data.test] {
            self.fit(model, kind, split)?;
        }
        Ok(())
    }
}
