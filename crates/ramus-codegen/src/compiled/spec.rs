//! What the compiled engine's kernels are generated from ([`TreeKernelSpec`]:
//! the lowered cells and the schedule), its launch constants, and the checks
//! and register counts every generator of this module shares.

use ramus_core::error::{CoreError, Result};
use ramus_core::graph::Graph;
use ramus_core::lower::{CellProgram, ScalarExpr};

/// Index words a level kernel launch carries by value
/// (`InlineIndices::words`; the whole parameter block stays under the
/// 4 KiB every CUDA driver accepts).
pub const INLINE_INDEX_WORDS: usize = 896;

/// Threads per block of the generated kernels by default: few, large
/// blocks keep the grid barrier cheap (1024 was slower: costlier block
/// barriers and half the registers per thread;
/// `docs/benchmarks.md#compiled-engine-block-size`).
pub const CELL_BLOCK: u32 = 512;

/// Threads per block when the persistent weights need more than 64
/// registers per thread: a block of 256 threads may use up to 255 each,
/// where 512 threads (128 each) would spill them (see
/// `docs/benchmarks.md#compiled-engine-block-size`).
pub const WIDE_CELL_BLOCK: u32 = 256;

/// A lowered function: its graph (for the ops' templates) and program.
#[derive(Clone, Copy)]
pub struct LoweredCell<'a> {
    pub graph: &'a Graph,
    pub program: &'a CellProgram,
}

/// What the level and table kernels are generated from.
#[derive(Clone, Copy)]
pub struct TreeKernelSpec<'a> {
    /// Kernel name prefix.
    pub name: &'a str,
    /// The leaf cell (outputs: state, pushed value).
    pub leaf: LoweredCell<'a>,
    /// The internal cell (outputs: state, pushed value).
    pub internal: LoweredCell<'a>,
    /// The head (output: scores).
    pub head: LoweredCell<'a>,
    /// Float offset of each parameter in the parameter buffer.
    pub param_offsets: &'a [usize],
    /// Keep the internal cell's weight rows in registers across levels.
    pub persistent_weights: bool,
    /// Read leaves from the token table instead of running the leaf cell.
    pub leaf_table: bool,
    /// Threads per block the kernels are launched with (a multiple of 32;
    /// compiled in as their launch bound).
    pub block_threads: u32,
    /// Order levels (and stages) by per-node completion counters instead
    /// of grid barriers: a block (or warp) waits only for the children of
    /// the nodes it computes, so a level starts where its children are
    /// ready (see the module docs).
    pub node_counters: bool,
    /// With hoisting, the program computing the internal cell's token
    /// table (its values that depend on the token alone; the internal
    /// program then reads them through
    /// [`VecExpr::TokenTable`](ramus_core::lower::VecExpr::TokenTable)).
    pub token_table: Option<LoweredCell<'a>>,
}

pub(crate) fn gen_error(message: impl Into<String>) -> CoreError {
    CoreError::Kernel {
        op: "compiled-engine codegen".into(),
        message: message.into(),
    }
}

/// Columns per lane of a dot product of length `k` (lane `l` takes
/// `l, l + 32, …`).
pub(crate) fn chunks(k: usize) -> usize {
    k.div_ceil(32)
}

/// Stages a program's scalars use (a program compacted from a
/// multi-stage one may keep a larger [`CellProgram::stages`]).
pub fn used_stages(program: &CellProgram) -> usize {
    1 + program.scalars.iter().map(|s| s.stage).max().unwrap_or(0)
}

impl TreeKernelSpec<'_> {
    pub(crate) fn state_width(&self) -> usize {
        self.internal.program.output_width(0)
    }

    pub(crate) fn push_width(&self) -> usize {
        self.internal.program.output_width(1)
    }

    /// What code generation needs of the cells and the launch (each
    /// cell's outputs, the block size, a one-stage head), without
    /// generating anything: [`Self::source`] starts with it, and engines
    /// run it before they need a device.
    pub fn check(&self) -> Result<()> {
        let (s, p) = (self.state_width(), self.push_width());
        for (what, cell) in [("leaf", self.leaf), ("internal", self.internal)] {
            let prog = cell.program;
            if prog.outputs.len() != 2 || prog.output_width(0) != s || prog.output_width(1) != p {
                return Err(gen_error(format!(
                    "the {what} cell must output a state of {s} and a pushed row of {p} columns"
                )));
            }
        }
        if self.block_threads == 0
            || !self.block_threads.is_multiple_of(32)
            || self.block_threads > 1024
        {
            return Err(gen_error(format!(
                "{} threads per block: expected a multiple of 32 up to 1024",
                self.block_threads
            )));
        }
        if self.head.program.outputs.len() != 1 {
            return Err(gen_error("the head must output one row of scores"));
        }
        if used_stages(self.head.program) > 1 {
            return Err(gen_error(format!(
                "the head has {} stages (a product of a product): only vertex cells may \
                 have more than one",
                self.head.program.stages
            )));
        }
        // a leaf cell may read children (one function for every vertex):
        // leaves have none, so its child loops run zero times
        Ok(())
    }

    /// The weight rows the internal cell keeps in registers, if persistent.
    pub fn register_rows(&self) -> Option<Vec<(usize, usize)>> {
        self.persistent_weights
            .then(|| self.internal.program.weight_rows())
    }

    /// Threads per block by default: [`WIDE_CELL_BLOCK`] when the
    /// persistent weights take more than 64 registers per thread, else
    /// [`CELL_BLOCK`].
    pub fn default_block_threads(&self) -> u32 {
        if self.weight_registers() > 64 {
            WIDE_CELL_BLOCK
        } else {
            CELL_BLOCK
        }
    }

    /// Registers per thread the persistent weights take.
    pub fn weight_registers(&self) -> usize {
        let prog = self.internal.program;
        self.register_rows().map_or(0, |rows| {
            rows.iter()
                .map(|&(w, r)| {
                    prog.scalars
                        .iter()
                        .find_map(|s| match s.expr {
                            ScalarExpr::Dot { weight, row, k, .. } if (weight, row) == (w, r) => {
                                Some(chunks(k))
                            }
                            _ => None,
                        })
                        .unwrap_or(0)
                })
                .sum()
        })
    }
}
