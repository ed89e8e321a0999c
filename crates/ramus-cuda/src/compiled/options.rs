//! The options of the compiled engine: its Cortex schedule and the
//! device-side knobs (a leaf module: the engine and its memory estimate
//! both read them).

use std::path::PathBuf;

use ramus_core::recursion::RecursionSchedule;

/// The Cortex schedule knobs of the compiled engine (the ablation of
/// Cortex Fig. 11(a)–(c)): fusion is always on; leaf specialization and
/// model persistence can be switched off, recursive refactoring and
/// unrolling on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompiledSchedule {
    /// Leaf specialization with computation hoisting: leaves read a
    /// per-token table built at load instead of running the leaf cell, and
    /// the internal cell's token-only values (input projections) another.
    pub leaf_table: bool,
    /// The internal cell's weight rows stay in registers across levels
    /// (even where they spill, still faster than reading them from L2:
    /// `docs/benchmarks.md#compiled-engine-persistent-weights`).
    pub persistent_weights: bool,
    /// Levels ordered by per-node completion counters instead of grid
    /// barriers
    /// ([`TreeKernelSpec::node_counters`](ramus_codegen::compiled::TreeKernelSpec::node_counters)):
    /// a block waits only for the children of the nodes it computes. `None` measures: the engine
    /// compiles both orderings, times the first [`LEVEL_ORDER_SAMPLES`]
    /// batches of each (alternating) and keeps the faster; until then it
    /// starts from counters up to [`COUNTERS_MAX_UNITS`] units, barriers
    /// above.
    pub node_counters: Option<bool>,
    /// Recursive refactoring and unrolling (`None`: the best known default
    /// for the model on CUDA, [`RecursionSchedule::resolve`]: both off).
    /// Unrolling runs each group (a node and its children of the level
    /// below) in one thread block with a block barrier between them, and
    /// reads the weights from memory (a block computes every unit: their
    /// rows do not fit its registers; Cortex appendix D).
    pub recursion: RecursionSchedule,
}

/// The widest internal cell (in units) that orders its levels by node
/// counters by default: counters were faster for every tree model at 256
/// units and slower at 512
/// (`docs/benchmarks.md#compiled-engine-node-counters`).
pub const COUNTERS_MAX_UNITS: usize = 256;

/// Batches each level ordering is timed on before the engine keeps the
/// faster (schedule `node_counters: None`).
pub const LEVEL_ORDER_SAMPLES: usize = 3;

impl Default for CompiledSchedule {
    fn default() -> Self {
        CompiledSchedule {
            leaf_table: true,
            persistent_weights: true,
            node_counters: None,
            recursion: RecursionSchedule::default(),
        }
    }
}

/// Options of [`CompiledEngine::new`](super::CompiledEngine::new).
#[derive(Clone, Debug)]
pub struct CompiledOptions {
    /// Device ordinal.
    pub device: usize,
    pub schedule: CompiledSchedule,
    /// Kernel cache directory (`None`: [`crate::default_cache_dir`]).
    pub cache_dir: Option<PathBuf>,
    /// Threads per block (a multiple of 32, at most 1024); `None`: by the
    /// weight registers
    /// ([`TreeKernelSpec::default_block_threads`](ramus_codegen::compiled::TreeKernelSpec::default_block_threads)).
    pub block_threads: Option<u32>,
    /// Blocks per multiprocessor at most (fewer blocks: a cheaper grid
    /// barrier; more: more warps per level), within what fits. Default 2:
    /// no slower than 1 on narrow levels, faster on wide ones
    /// (`docs/benchmarks.md#compiled-engine-blocks-per-sm`).
    pub blocks_per_sm: u32,
    /// Blocks in all at most (`None`: as many as fit and the widest level
    /// can use).
    pub max_blocks: Option<u32>,
    /// Time each launch with device events
    /// ([`CompiledEngine::last_kernel_seconds`](super::CompiledEngine::last_kernel_seconds));
    /// off by default: two event records per batch.
    pub time_kernel: bool,
    /// Device memory the engine may take at most (its pool's budget, and
    /// what [`CompiledEngine::with_check`](super::CompiledEngine::with_check)
    /// checks against besides the free memory); `None`: as much as the
    /// device has free.
    pub memory_budget: Option<u64>,
}

impl Default for CompiledOptions {
    fn default() -> Self {
        CompiledOptions {
            device: 0,
            schedule: CompiledSchedule::default(),
            cache_dir: None,
            block_threads: None,
            blocks_per_sm: 2,
            max_blocks: None,
            time_kernel: false,
            memory_budget: None,
        }
    }
}
