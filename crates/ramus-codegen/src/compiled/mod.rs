//! CodeGen of the compiled inference engine (Cortex §5): CUDA C++ for a
//! recursive model's [`CellProgram`]s — one persistent kernel that walks
//! every level of a linearized batch, and one that tabulates the leaf cell
//! per token at model load (leaf specialization with hoisting).
//!
//! # The level kernel
//!
//! A warp owns one unit `j` of the internal cell (and a replica number: with
//! `R` warps per unit, replica `r` takes nodes `r, r + R, …` of a level). With
//! **model persistence** the warp loads its unit's weight rows into registers
//! once (lane `l` holds columns `l, l + 32, …`) and keeps them across all
//! levels; without, it reads them from global memory at each use.
//!
//! Per node the warp evaluates the **fused cell**: each dot product's lanes
//! evaluate their own columns of the input vector straight from the
//! children's state rows (a child sum is summed on the fly), multiply by
//! their weights and reduce with warp shuffles; the unit's gate arithmetic
//! follows in registers; lane 0 stores the unit's columns of the new state
//! and pushed rows. No intermediate tensor touches memory. The lanes'
//! input columns are loaded into registers first, all chunks at once (a
//! child sum loops over the children once), so a node costs a few memory
//! round trips, not one per column block. Between levels a grid-wide
//! barrier (the kernel is launched cooperatively, so all blocks are
//! resident) orders the stores before the next level's loads; the next
//! level's range is loaded before the barrier. Plain (L1-cached) loads are
//! safe for the state: a row is written once, in its level, and read only
//! after it, so no SM ever caches a stale copy.
//!
//! With **node counters** ([`TreeKernelSpec::node_counters`]) the levels
//! are ordered by data flow instead of grid barriers. Each internal node
//! has a completion counter per stage (`done`, zeroed by the host with
//! each batch's upload). A block (or a warp, when a block holds units of
//! two replicas) starts a level by waiting for the internal children of
//! the nodes it computes there, one node per thread, all polled at once
//! with relaxed loads and then one acquire fence per polling thread and a
//! block barrier; after computing them, a block barrier and one release
//! add per node. A block thus waits only for the rows it reads, never for
//! the slowest block of the grid, and a stage waits for its own nodes'
//! previous stage the same way. Deadlock-free for the same reason as the
//! barriers: every block is resident and walks the levels in order,
//! waiting only for nodes of earlier levels (or stages).
//!
//! With the **leaf table**, leaves run no code: the host encodes each
//! child as a *row code* (`child_rows`): its node number if it is internal,
//! `num_internal + token` if it is a leaf (the linearizer numbers leaves
//! last, so the kernel's leaf check is the one comparison `code <
//! num_internal`, with no further load), and a leaf's row is its token's
//! row of the table the table kernel filled at load. Without it, codes are
//! node numbers and the kernel first runs the leaf cell on every leaf, then
//! a barrier. After the last level the head cell scores every root from its
//! pushed row.
//!
//! A **multi-stage** internal cell (a product of a per-unit value, as in a
//! TreeGRU: [`CellProgram::stages`]) runs each level stage by stage: a
//! stage's warps store the values the next stage reads as vectors into the
//! node's scratch row, and a grid barrier separates the stages.
//!
//! With **hoisting** ([`CellProgram::hoist_token_values`]), the internal
//! cell's values that depend on a node's token alone (a DAG-RNN's or an
//! LSTM's input projection `W x + b`) come from a second per-token table,
//! filled by the token-table kernel at load, instead of a product per node.
//!
//! Kernel parameters (the engine's launch relies on this order):
//!
//! ```text
//! NAME_levels(const float* params, float* state, float* push,
//!             const float* table_state, const float* table_push, const float* token_table,
//!             float* scratch,
//!             const u32* child_offsets, const u32* child_rows, const u32* tokens,
//!             const u32* batch_begin, const u32* batch_length, u32 num_batches,
//!             u32 num_internal, u32 num_nodes, const u32* roots, u32 num_roots,
//!             float* scores, u32* barrier, u32* done,
//!             InlineIndices inl, u32* done_next, u32 done_clear)
//! NAME_leaf_table(const float* params, float* out_state, float* out_push, u32 vocab)
//! NAME_token_table(const float* params, float* out_table, u32 vocab)   // with hoisting
//! ```
//!
//! A batch whose index arrays fit [`INLINE_INDEX_WORDS`] words passes
//! them by value in `inl` (`inl.count > 0`; the pointers are then
//! unused): the launch carries them, with no copy to issue, and each block
//! reads them from shared memory. Every launch clears `done_clear` words
//! of `done_next`, the counters of the next launch (the engine alternates
//! two arrays), so no batch uploads zeroed counters.
//!
//! A multi-stage leaf cell (a refactored model's leaf, see
//! [`ramus_core::recursion`]) runs stage by stage too: without the table, with
//! a grid barrier after each stage of the leaf phase (scratch rows then
//! cover every node); its table is built by one kernel per stage,
//! `NAME_leaf_table`, `NAME_leaf_table_s1`, …, each taking a scratch
//! pointer (a row per token) before `vocab`, launched in order. The
//! unrolled level kernel is [`TreeKernelSpec::unrolled_source`].
//!
//! `params` holds every parameter at its offset ([`TreeKernelSpec::param_offsets`],
//! compiled in as constants); `state`/`push` have a row per node
//! (`num_nodes` rows); `scores` a row per root; `barrier` two zeroed
//! words; `done` `stages · num_internal` zeroed counters (node counters
//! only; unused otherwise); `scratch` a row of the internal cell's scratch width per internal
//! node (multi-stage cells).
//!
//! [`CellProgram`]: ramus_core::lower::CellProgram
//! [`CellProgram::stages`]: ramus_core::lower::CellProgram::stages
//! [`CellProgram::hoist_token_values`]: ramus_core::lower::CellProgram::hoist_token_values

mod level;
mod spec;
mod unroll;
mod writer;

pub use level::token_stage_kernel;
pub use spec::{
    used_stages, LoweredCell, TreeKernelSpec, CELL_BLOCK, INLINE_INDEX_WORDS, WIDE_CELL_BLOCK,
};
