//! What the compiled engine allocates, from the sizes it allocates with:
//! the model lowered to its cells on the host ([`Cells`], before the
//! device is touched), the sizes of its per-token tables
//! ([`TableLens`]) and of a batch's buffers ([`batch_lens`], the node
//! counters of [`CounterPair`]), and the run's [`need`] counted from them.

use ramus_core::lower::CellProgram;
use ramus_core::recursion::{lower_scheduled, Backend, LoweredFunction, RecursionSchedule};
use ramus_core::Model;
use ramus_exec::memory::{ActivationCost, BatchExtra, CostTerms, DeviceNeed, Pass, ELEMENT_BYTES};
use ramus_graph::{InputGraph, LinearBatch};

use super::options::{CompiledOptions, CompiledSchedule, COUNTERS_MAX_UNITS};
use std::sync::Arc;

use crate::error::{CudaError, Result};
use crate::memory::block_bytes;
use crate::pool::{DevicePool, DeviceView, PoolBuffer};

/// The model lowered for the compiled engine: its leaf, internal and head
/// cells, the schedule in effect and, with leaf specialization, the
/// program of the internal cell's hoisted token table and its width.
pub(super) struct Cells {
    pub leaf: LoweredFunction,
    pub internal: LoweredFunction,
    pub head: CellProgram,
    /// Rows of the embedding table the cells read, if they read a token.
    pub vocab: Option<usize>,
    pub schedule: CompiledSchedule,
    pub unroll: bool,
    pub token_table: Option<(CellProgram, usize)>,
}

impl Cells {
    /// Lowers `model` under `options`' schedule (host work only).
    pub fn lower(model: &Model, options: &CompiledOptions) -> Result<Self> {
        let recursion = options.schedule.recursion.resolve(
            model,
            Backend::Cuda,
            options.schedule.leaf_table,
        )?;
        let cells = lower_scheduled(model, recursion.refactor)?;
        let vocab = cells.vocab;
        let mut internal = cells.internal;
        let schedule = CompiledSchedule {
            // a table needs a token to index it
            leaf_table: options.schedule.leaf_table && vocab.is_some(),
            // a block computing whole nodes cannot keep every unit's rows,
            // and orders its steps by grid barriers
            persistent_weights: options.schedule.persistent_weights && !recursion.unroll,
            node_counters: Some(
                !recursion.unroll
                    && options
                        .schedule
                        .node_counters
                        .unwrap_or(internal.program.units <= COUNTERS_MAX_UNITS),
            ),
            recursion: RecursionSchedule::fixed(recursion.refactor, recursion.unroll),
        };
        // hoisting: the internal cell's token-only values from a table
        let hoisted = if schedule.leaf_table {
            internal.program.hoist_token_values()
        } else {
            None
        };
        let token_table = hoisted.map(|h| {
            internal.program = h.program;
            (h.table, h.width)
        });
        Ok(Cells {
            leaf: cells.leaf,
            internal,
            head: cells.head,
            vocab,
            schedule,
            unroll: recursion.unroll,
            token_table,
        })
    }

    /// Floats of a node's row in each per-batch buffer: its state, its
    /// pushed value and its scratch (multi-stage cells: the wider of the
    /// leaf's and the internal cell's).
    pub fn row_widths(&self) -> [usize; 3] {
        let internal = &self.internal.program;
        [
            internal.output_width(0),
            internal.output_width(1),
            internal.scratch_width.max(self.leaf.program.scratch_width),
        ]
    }

    /// The per-token tables' floats (none without leaf specialization).
    pub fn table_lens(&self) -> Result<TableLens> {
        if !self.schedule.leaf_table {
            return Ok(TableLens::default());
        }
        let v = self
            .vocab
            .ok_or_else(|| CudaError::Model("leaf table without a vocabulary".into()))?;
        let [state, push, _] = self.row_widths();
        let leaf = &self.leaf.program;
        Ok(TableLens {
            state: v * state,
            push: v * push,
            // stage by stage, a scratch row per token
            scratch: (ramus_codegen::compiled::used_stages(leaf) > 1)
                .then_some(v * leaf.scratch_width),
            token: self.token_table.as_ref().map(|(_, width)| v * width),
        })
    }
}

/// Floats of the compiled engine's per-token tables: the leaf cell's
/// state and pushed value, its scratch while it is tabulated (freed before
/// the token table is made), and the internal cell's hoisted token values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct TableLens {
    pub state: usize,
    pub push: usize,
    pub scratch: Option<usize>,
    pub token: Option<usize>,
}

impl TableLens {
    /// Bytes the tables hold at most at once.
    fn bytes(&self) -> u64 {
        if self.state == 0 && self.push == 0 {
            return 0;
        }
        let block = |n: Option<usize>| n.map_or(0, block_bytes);
        block_bytes(self.state)
            + block_bytes(self.push)
            + block(self.scratch).max(block(self.token))
    }
}

/// Floats of a batch of `nodes` nodes in the state, pushed-value and
/// scratch buffers (rows of [`Cells::row_widths`]).
pub(super) fn batch_lens(nodes: usize, widths: [usize; 3]) -> [usize; 3] {
    widths.map(|w| (nodes * w).max(1))
}

/// Bytes of the batch arena's first block: the largest batch a check
/// found to fit (`eval_batch`), else 16 MiB (it grows as batches need).
pub(super) fn arena_bytes(eval_batch: u64) -> u64 {
    match eval_batch {
        0 => 16 << 20,
        b => b,
    }
}

/// Fewest node counters the engine allocates.
pub(super) const MIN_COUNTERS: usize = 1024;

/// Words of each node-counter array for a launch needing `words` counters,
/// the arrays holding `capacity` (they double, so that growing is rare).
pub(super) fn counter_capacity(words: usize, capacity: usize) -> usize {
    words.max(capacity.saturating_mul(2)).max(MIN_COUNTERS)
}

/// The two node-counter arrays the level kernels alternate between: a
/// launch uses one and clears the other for the next (so the counters
/// are never uploaded).
pub(super) struct CounterPair {
    pub pool: Arc<DevicePool>,
    pub buffers: Option<[PoolBuffer<u32>; 2]>,
    /// Words of each array (all zero outside a running launch).
    pub capacity: usize,
    /// The array the next launch uses.
    pub next: usize,
}

impl CounterPair {
    /// No arrays yet (the first launch allocates them from `pool`).
    pub fn new(pool: Arc<DevicePool>) -> Self {
        CounterPair {
            pool,
            buffers: None,
            capacity: 0,
            next: 0,
        }
    }

    /// The arrays for a launch needing `words` counters: (this launch's,
    /// the next's), growing both (zeroed on `stream`) when too small.
    pub fn for_launch(
        &mut self,
        words: usize,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<(DeviceView<u32>, DeviceView<u32>)> {
        if self.buffers.is_none() || words > self.capacity {
            let capacity = counter_capacity(words, self.capacity);
            let pair = [
                self.pool.alloc::<u32>(capacity)?,
                self.pool.alloc::<u32>(capacity)?,
            ];
            for b in &pair {
                b.view().fill_zero(stream)?;
            }
            self.buffers = Some(pair);
            self.capacity = capacity;
        }
        let Some(pair) = &self.buffers else {
            return Err(CudaError::Model("node counters were not allocated".into()));
        };
        Ok((pair[self.next].view(), pair[1 - self.next].view()))
    }

    /// After a launch with [`CounterPair::for_launch`]'s arrays was
    /// enqueued: the next launch uses the array it clears. (A launch that
    /// failed to enqueue cleared nothing, so the arrays stay.)
    pub fn launched(&mut self) {
        self.next = 1 - self.next;
    }
}

/// Index words a batch uploads at most per node and per child edge: the
/// child offsets (one more than the nodes), tokens, the level ranges (two
/// per level; unrolled: the steps and groups, two each, and their
/// children) and the roots; the child rows, one per edge.
const INDEX_WORDS_PER_NODE: u64 = 7;
const INDEX_WORDS_FIXED: u64 = 3;

/// The batch buffers an arena holds (indices, state, pushed value, scratch).
const BATCH_ALLOCATIONS: u64 = 4;

/// What the compiled engine allocates for `model` lowered to `cells`: the
/// parameters, the grid barrier and the per-token tables, and per
/// inference batch (every node, internal or leaf, counted alike) its arena:
/// state, pushed-value and scratch rows and index words; beside it, with
/// levels ordered by node counters, the counter arrays, measured on the
/// batch's internal nodes ([`counter_bytes`]).
pub(super) fn need(model: &Model, cells: &Cells) -> Result<DeviceNeed> {
    let params: usize = model
        .params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let [state, push, scratch] = cells.row_widths();
    let per_node = (state + push + scratch) as u64 + INDEX_WORDS_PER_NODE;
    let mut terms = CostTerms::zero(model.functions.len());
    terms.per_vertex = per_node * ELEMENT_BYTES;
    terms.per_any_edge = ELEMENT_BYTES;
    terms.fixed = INDEX_WORDS_FIXED * ELEMENT_BYTES + BATCH_ALLOCATIONS * crate::ALIGNMENT;
    let stages = cells.internal.program.stages;
    let counters: Option<BatchExtra> = match cells.schedule.node_counters {
        Some(false) => None,
        _ => Some(Arc::new(move |graphs: &[&InputGraph]| {
            let batch = LinearBatch::new(graphs).map_err(|e| e.to_string())?;
            Ok(counter_bytes(batch.num_internal() * stages))
        })),
    };
    Ok(DeviceNeed {
        engine: "cuda-compiled",
        parts: vec![
            ("parameters", block_bytes(params)),
            ("per-token tables", cells.table_lens()?.bytes()),
            ("grid barrier", block_bytes(2)),
        ],
        train: None,
        eval: Some(ActivationCost::from_terms(model, Pass::Infer, terms)),
        train_kept: false,
        train_extra: None,
        eval_extra: counters,
    })
}

/// Bytes of the node counters for a batch needing `words` of them: a pair
/// of arrays grown (doubling) to at most twice that, and while they grow
/// the old pair, each under it.
pub(super) fn counter_bytes(words: usize) -> u64 {
    2 * block_bytes(counter_capacity(words, words)) + 2 * block_bytes(words)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::offset_allocator::aligned_size;
    use ramus_graph::random::random_tree;
    use ramus_graph::{InputGraph, LinearBatch, UnrolledPlan};
    use ramus_nn::{build_model, ModelConfig};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// What [`super::super::CompiledEngine::infer`] allocates in its arena
    /// for `graphs` (every array uploaded, none carried by the launch),
    /// counted from the linearized batch: the index arrays, the state,
    /// pushed-value and scratch rows; and the node counters' pair.
    fn allocated(cells: &Cells, graphs: &[&InputGraph]) -> (u64, u64) {
        let batch = LinearBatch::new(graphs).unwrap();
        let mut words = batch.child_offsets().len()
            + batch.child_nodes().len()
            + batch.tokens().len()
            + batch.root_nodes().len();
        if cells.unroll {
            let mut plan = UnrolledPlan::new();
            plan.plan(&batch).unwrap();
            words += plan.step_begin().len()
                + plan.group_parent().len()
                + plan.group_child_begin().len()
                + plan.group_children().len();
        } else {
            words += batch.batch_begin().len() + batch.batch_length().len();
        }
        let block = |n: usize| aligned_size(4 * n.max(1) as u64).unwrap();
        let rows: u64 = batch_lens(batch.num_nodes(), cells.row_widths())
            .iter()
            .map(|&n| block(n))
            .sum();
        let counters = match cells.schedule.node_counters {
            Some(true) => {
                let words = batch.num_internal() * cells.internal.program.stages;
                2 * block(counter_capacity(words, 0))
            }
            _ => 0,
        };
        (block(words) + rows, counters)
    }

    #[test]
    fn the_batch_cost_bounds_what_a_batch_allocates() {
        let cfg = ModelConfig {
            vocab: 50,
            hidden: 40,
            classes: 5,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for name in ["treelstm", "treegru", "treefc"] {
            let model = build_model(name, &cfg).unwrap();
            for (counters, unroll) in [(true, false), (false, false), (false, true)] {
                let options = CompiledOptions {
                    schedule: CompiledSchedule {
                        node_counters: Some(counters),
                        recursion: RecursionSchedule::fixed(false, unroll),
                        ..CompiledSchedule::default()
                    },
                    ..CompiledOptions::default()
                };
                let cells = Cells::lower(&model, &options).unwrap();
                let need = need(&model, &cells).unwrap();
                let cost = need.eval.as_ref().unwrap();
                assert_eq!(need.eval_extra.is_some(), counters);
                for size in [1, 5, 40] {
                    let graphs: Vec<InputGraph> = (0..size)
                        .map(|_| random_tree(&mut rng, 30, &[2], 50, 5).unwrap())
                        .collect();
                    let refs: Vec<&InputGraph> = graphs.iter().collect();
                    let (arena, pair) = allocated(&cells, &refs);
                    let counted = cost.graph_costs(&model, &graphs).largest_batch(size);
                    let what = format!("{name} counters {counters} unroll {unroll}, {size}");
                    assert!(counted >= arena, "{what}: {counted} < {arena}");
                    assert!(
                        counted <= arena + arena / 4,
                        "{what}: {counted} for {arena}"
                    );
                    let beside = need.eval_extra.as_ref().map_or(0, |m| m(&refs).unwrap());
                    assert!(
                        beside >= pair && beside <= 3 * pair,
                        "{what}: {beside} for {pair}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_tables_are_counted_at_their_peak_and_only_with_leaf_tables() {
        let cfg = ModelConfig {
            vocab: 1000,
            hidden: 32,
            classes: 5,
        };
        let model = build_model("treelstm", &cfg).unwrap();
        let cells = Cells::lower(&model, &CompiledOptions::default()).unwrap();
        let lens = cells.table_lens().unwrap();
        let [state, push, _] = cells.row_widths();
        assert_eq!((lens.state, lens.push), (1000 * state, 1000 * push));
        let tables = need(&model, &cells).unwrap().parts[1].1;
        assert!(tables >= 4 * (lens.state + lens.push) as u64, "{tables}");
        let untabled = CompiledOptions {
            schedule: CompiledSchedule {
                leaf_table: false,
                ..CompiledSchedule::default()
            },
            ..CompiledOptions::default()
        };
        let cells = Cells::lower(&model, &untabled).unwrap();
        assert_eq!(need(&model, &cells).unwrap().parts[1].1, 0);
    }
}
