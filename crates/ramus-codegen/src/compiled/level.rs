//! The level kernel and the per-token table kernels of the compiled engine
//! (see the [module docs](super)): [`TreeKernelSpec::source`].

use std::fmt::Write as _;

use super::spec::{
    chunks, gen_error, used_stages, LoweredCell, TreeKernelSpec, INLINE_INDEX_WORDS,
};
use super::writer::CellWriter;
use crate::template::fill;
use ramus_core::error::Result;
use ramus_core::lower::ScalarExpr;

/// The device functions every level kernel uses (`prelude.cu`): the warp
/// sum, child prefetch, grid barrier and node counters.
const PRELUDE: &str = include_str!("prelude.cu");

/// The level kernel (`levels.cu`), its `@KEY@`s filled by
/// [`TreeKernelSpec::source`]. It starts by taking the index arrays from the
/// launch's inline words (copied to shared memory) or from the pointers
/// passed, and clearing the next launch's node counters (the engine
/// alternates two counter arrays, so no batch uploads zeros).
const LEVELS: &str = include_str!("levels.cu");

/// `const float* P<p> = params + offset;` for every parameter.
pub(crate) fn param_pointers(offsets: &[usize]) -> String {
    offsets
        .iter()
        .enumerate()
        .map(|(p, off)| format!("const float* __restrict__ P{p} = params + {off}ull;\n"))
        .collect()
}

/// Warp coordinates for a cell of `units` units: `j`, replica `rep`, `R`.
pub(crate) fn warp_coordinates(units: usize) -> String {
    format!(
        "const u32 j = gw % {units}u; const u32 rep = gw / {units}u; const u32 R = gwarps / {units}u;\n"
    )
}

/// The name of stage `stage`'s kernel of token kernel `name`: `name`
/// itself for stage 0, `name_s<stage>` after.
pub fn token_stage_kernel(name: &str, stage: usize) -> String {
    if stage == 0 {
        name.to_string()
    } else {
        format!("{name}_s{stage}")
    }
}

/// A kernel `name(params, <one float* per output>, vocab)` that runs `cell`
/// once per token below `vocab` (a vertex with that token and no children)
/// and stores output `o` at row `tok` of `outputs[o]` (`(name, width)`).
/// A multi-stage cell (a refactored leaf: its moved products need every
/// unit of its new state) gets one kernel per stage
/// ([`token_stage_kernel`]), launched in order, each taking a scratch
/// row per token before `vocab`: `name(params, outputs..., scratch, vocab)`.
fn token_kernel(
    name: &str,
    block: u32,
    cell: LoweredCell<'_>,
    outputs: &[(&str, usize)],
    param_offsets: &[usize],
) -> Result<String> {
    let rows: Vec<String> = outputs
        .iter()
        .map(|(o, w)| format!("{o} + (u64)tok * {w}u"))
        .collect();
    let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
    let mut params: String = outputs
        .iter()
        .map(|(o, _)| format!("float* {o}, "))
        .collect();
    let stages = used_stages(cell.program);
    if stages > 1 {
        params += "float* scratch, ";
    }
    let mut src = String::new();
    for stage in 0..stages {
        let code = CellWriter::new(cell, None).cell_stage(stage, &rows)?;
        let _ = write!(
            src,
            "extern \"C\" __global__ void __launch_bounds__({block}) {}(const float* __restrict__ params, {params}u32 vocab) {{\n{}const u32 lane = threadIdx.x & 31u;\nconst u32 gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;\nconst u32 gwarps = (gridDim.x * blockDim.x) >> 5;\n{}if (rep < R) {{\n// no children and no tables: only the token and the parameters\nconst bool use_table = false; const u32 num_internal = 0; const float* state = nullptr; const float* table_state = nullptr; const float* token_table = nullptr; const u32* child_rows = nullptr;\n(void)use_table; (void)num_internal; (void)state; (void)table_state; (void)token_table; (void)child_rows;\nfor (u32 tok = rep; tok < vocab; tok += R) {{\nconst u32 n = tok; (void)n;\nconst u32 cb = 0, ce = 0, c0 = 0, c1 = 0; (void)cb; (void)ce; (void)c0; (void)c1;\n{code}}}\n}}\n}}\n",
            token_stage_kernel(name, stage),
            param_pointers(param_offsets),
            warp_coordinates(cell.program.units),
        );
    }
    Ok(src)
}

/// How the level kernel orders a level (or stage) after the ones it reads:
/// a grid barrier after each, or per-node completion counters (see the
/// module docs). With counters the nodes a block (or a warp, when a block
/// holds units of several replicas) computes in a level are waited for and
/// published together: its threads poll the children of one node each,
/// then a block barrier; after the level, a block barrier and one release
/// per node.
struct LevelSync {
    counters: bool,
    /// The block arrives as one (else each warp).
    per_block: bool,
    /// Arrivals that complete a node's stage.
    arrivals: usize,
}

impl LevelSync {
    fn new(counters: bool, units: usize, block_threads: u32) -> Self {
        // a block's warps are consecutive units of one replica (so they
        // walk the same nodes in the same order) when the units are a
        // multiple of the warps per block
        let warps_per_block = (block_threads / 32).max(1) as usize;
        let per_block = units.is_multiple_of(warps_per_block);
        LevelSync {
            counters,
            per_block,
            arrivals: if per_block {
                units / warps_per_block
            } else {
                units
            },
        }
    }

    /// The thread index, thread count and barrier of the arriving group.
    fn group(&self) -> (&'static str, &'static str, &'static str) {
        if self.per_block {
            ("threadIdx.x", "blockDim.x", "__syncthreads();")
        } else {
            ("lane", "32u", "__syncwarp();")
        }
    }

    /// Before the level loop: each thread of the group loads the child
    /// range and first two children of the node it will wait for.
    fn prefetch_first(&self) -> String {
        if !self.counters {
            return String::new();
        }
        let (tid, ..) = self.group();
        format!(
            "u32 qcb = 0, qce = 0, qc0 = 0, qc1 = 0;\nprefetch_node(begin, len, rep + {tid} * R, child_offsets, child_rows, &qcb, &qce, &qc0, &qc1);\n"
        )
    }

    /// At a level's start: wait for the last stage of every internal child
    /// of the group's nodes (leaves are ready: tabulated, or computed
    /// before the levels' first barrier).
    fn before_level(&self, stages: usize) -> String {
        if !self.counters {
            return String::new();
        }
        let (tid, threads, barrier) = self.group();
        format!(
            "{{\nbool waited = false;\nfor (u32 i = rep + {tid} * R; i < len; i += {threads} * R) {{\nu32 cb = qcb, ce = qce, c0 = qc0, c1 = qc1;\nif (i != rep + {tid} * R) prefetch_node(begin, len, i, child_offsets, child_rows, &cb, &ce, &c0, &c1);\nwait_children(done + {}u * num_internal, cb, ce, c0, c1, child_rows, num_internal, {}u);\nwaited = true;\n}}\nif (waited) acquire_fence();\n}}\n{barrier}\n",
            stages - 1,
            self.arrivals
        )
    }

    /// Before stage `stage > 0`: a grid barrier, or wait for the group's
    /// nodes' previous stage.
    fn before_stage(&self, stage: usize) -> String {
        if !self.counters {
            return "}\ngrid_sync(barrier, &bar_gen);\nif (rep < R) {\n".into();
        }
        let (tid, threads, barrier) = self.group();
        format!(
            "{{\nbool waited = false;\nfor (u32 i = rep + {tid} * R; i < len; i += {threads} * R) {{ wait_count(done + {}u * num_internal + begin + i, {}u); waited = true; }}\nif (waited) acquire_fence();\n}}\n{barrier}\n",
            stage - 1,
            self.arrivals
        )
    }

    /// After the group computed stage `stage` of its nodes: one release
    /// per node (none with grid barriers).
    fn publish(&self, stage: usize) -> String {
        if !self.counters {
            return String::new();
        }
        let (tid, threads, barrier) = self.group();
        format!(
            "{barrier}\nfor (u32 i = rep + {tid} * R; i < len; i += {threads} * R) signal_done(done + {stage}u * num_internal + begin + i);\n"
        )
    }

    /// After a level: the grid barrier and, with counters, the next
    /// level's waiter prefetch.
    fn after_level(&self) -> String {
        if !self.counters {
            return "grid_sync(barrier, &bar_gen);\n".into();
        }
        let (tid, ..) = self.group();
        format!(
            "prefetch_node(next_begin, next_len, rep + {tid} * R, child_offsets, child_rows, &qcb, &qce, &qc0, &qc1);\n"
        )
    }

    /// Before the head reads root `root`'s pushed row (each head warp
    /// waits for its own root).
    fn before_head(&self, stages: usize) -> String {
        if !self.counters {
            return String::new();
        }
        format!(
            "if (root < num_internal) {{ wait_count(done + {}u * num_internal + root, {}u); acquire_fence(); }}\n",
            stages - 1,
            self.arrivals
        )
    }
}

impl TreeKernelSpec<'_> {
    /// Both kernels' source; see the module docs.
    pub fn source(&self) -> Result<String> {
        self.check()?;
        let (s, p) = (self.state_width(), self.push_width());
        let (name, block) = (self.name, self.block_threads);
        let mut src = String::from(PRELUDE);
        let _ = writeln!(
            src,
            "// A small batch's index arrays, passed by value with the launch (no copy\n// to issue): `count` words, array `a` starting at word `at[a]` (child\n// offsets, child rows, tokens, level begins, level lengths, roots).\n#define INLINE_INDEX_WORDS {INLINE_INDEX_WORDS}u\nstruct InlineIndices {{ u32 count; u32 at[6]; u32 words[INLINE_INDEX_WORDS]; }};"
        );
        let _ = writeln!(
            src,
            "// The state row of child code c (see `child_rows`): an internal node's row, or its token's table row.\n__device__ __forceinline__ const float* row_of(u32 c, const float* state, const float* table, u32 num_internal, bool use_table) {{\n    return (c < num_internal || !use_table) ? state + (u64)c * {s}u : table + (u64)(c - num_internal) * {s}u;\n}}\n#define ROW(c) row_of((c), state, table_state, num_internal, use_table)"
        );
        // ---- table kernels: the leaf cell, and the hoisted token values
        src += &token_kernel(
            &format!("{name}_leaf_table"),
            block,
            self.leaf,
            &[("out_state", s), ("out_push", p)],
            self.param_offsets,
        )?;
        if let Some(cell) = self.token_table {
            src += &token_kernel(
                &format!("{name}_token_table"),
                block,
                cell,
                &[("out_table", cell.program.output_width(0))],
                self.param_offsets,
            )?;
        }
        // ---- level kernel
        let registers = self.register_rows();
        let mut weights = self.register_weights(registers.as_deref())?;
        let internal_outputs = [
            format!("state + (u64)n * {s}u"),
            format!("push + (u64)n * {p}u"),
        ];
        let internal_outputs: Vec<&str> = internal_outputs.iter().map(String::as_str).collect();
        let (units, stages) = (self.internal.program.units, self.internal.program.stages);
        let sync = LevelSync::new(self.node_counters, units, self.block_threads);
        // a block's warps are consecutive units of one node when the units
        // are a multiple of them: its cells may cooperate
        let writer = || {
            let w = CellWriter::new(self.internal, registers.clone());
            if sync.per_block {
                w.block_uniform((self.block_threads / 32) as usize)
            } else {
                w
            }
        };
        let (internal_cell, preload) = writer().cell_stage_with_preload(0, &internal_outputs)?;
        weights += &preload;
        // later stages of a multi-stage cell: each after a barrier (or its
        // own nodes' previous stage), its nodes reloading their children
        let mut later_stages = String::new();
        for stage in 1..stages {
            let (code, preload) = writer().cell_stage_with_preload(stage, &internal_outputs)?;
            weights += &preload;
            let _ = write!(
                later_stages,
                "{}for (u32 i = rep; i < len; i += R) {{\nconst u32 n = begin + i;\nconst u32 tok = tokens[n]; (void)tok;\nconst u32 cb = child_offsets[n], ce = child_offsets[n + 1];\nconst u32 c0 = cb < ce ? child_rows[cb] : 0, c1 = cb + 1 < ce ? child_rows[cb + 1] : 0;\n{code}}}\n{}",
                sync.before_stage(stage),
                sync.publish(stage),
            );
        }
        let leaf_phase = self.leaf_phase()?;
        let head_phase = self.head_phase(&sync.before_head(stages))?;
        src += &fill(
            LEVELS,
            &[
                ("BLOCK", &block.to_string()),
                ("NAME", name),
                ("PARAM_POINTERS", &param_pointers(self.param_offsets)),
                ("USE_TABLE", &self.leaf_table.to_string()),
                ("LEAF_PHASE", &leaf_phase),
                (
                    "WARP_COORDINATES",
                    &warp_coordinates(self.internal.program.units),
                ),
                ("WEIGHTS", &weights),
                ("PREFETCH_FIRST", &sync.prefetch_first()),
                ("BEFORE_LEVEL", &sync.before_level(stages)),
                ("INTERNAL_CELL", &internal_cell),
                ("PUBLISH", &sync.publish(0)),
                ("LATER_STAGES", &later_stages),
                ("AFTER_LEVEL", &sync.after_level()),
                ("HEAD_PHASE", &head_phase),
            ],
        );
        Ok(src)
    }

    /// The code that loads the internal cell's persistent weight `rows`
    /// (none without persistence) into registers `w<q>[i]`, once before
    /// the level loop.
    fn register_weights(&self, rows: Option<&[(usize, usize)]>) -> Result<String> {
        let mut weights = String::new();
        let Some(rows) = rows else {
            return Ok(weights);
        };
        let prog = self.internal.program;
        for (q, &(w, r)) in rows.iter().enumerate() {
            let k = prog
                .scalars
                .iter()
                .find_map(|s| match s.expr {
                    ScalarExpr::Dot { weight, row, k, .. } if (weight, row) == (w, r) => Some(k),
                    _ => None,
                })
                .ok_or_else(|| gen_error("a register row without a dot"))?;
            let _ = writeln!(
                weights,
                "float w{q}[{}];\n#pragma unroll\nfor (u32 i = 0; i < {}u; ++i) {{ const u32 t = lane + 32u * i; w{q}[i] = (rep < R && t < {k}u) ? P{w}[(u64)({r}u + j) * {k}u + t] : 0.0f; }}",
                chunks(k),
                chunks(k)
            );
        }
        Ok(weights)
    }

    /// Without the leaf table: the leaf cell on every leaf, stage by stage,
    /// then a grid barrier (nothing with the table). Code inside a level
    /// kernel (its parameters, `lane`, `gw`, `gwarps`, `bar_gen` in scope).
    pub(crate) fn leaf_phase(&self) -> Result<String> {
        if self.leaf_table {
            return Ok(String::new());
        }
        let (s, p) = (self.state_width(), self.push_width());
        let rows = [
            format!("state + (u64)n * {s}u"),
            format!("push + (u64)n * {p}u"),
        ];
        let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
        let mut src = String::new();
        for stage in 0..used_stages(self.leaf.program) {
            let code = CellWriter::new(self.leaf, None).cell_stage(stage, &rows)?;
            let _ = write!(
                src,
                "{{\n{}if (rep < R) {{\nfor (u32 n = num_internal + rep; n < num_nodes; n += R) {{\nconst u32 tok = tokens[n]; (void)tok;\nconst u32 cb = child_offsets[n], ce = child_offsets[n + 1]; (void)cb; (void)ce;\nconst u32 c0 = 0, c1 = 0; (void)c0; (void)c1;\n{code}}}\n}}\n}}\ngrid_sync(barrier, &bar_gen);\n",
                warp_coordinates(self.leaf.program.units)
            );
        }
        Ok(src)
    }

    /// The head cell on every root (code inside a level kernel).
    /// The head over every root; `before_root` runs before a root's pushed
    /// row is read (the wait for its node, with node counters).
    pub(crate) fn head_phase(&self, before_root: &str) -> Result<String> {
        let p = self.push_width();
        let classes = self.head.program.output_width(0);
        let head_cell =
            CellWriter::new(self.head, None).cell(&[&format!("scores + (u64)r * {classes}u")])?;
        Ok(format!(
            "{{\n{}if (rep < R) {{\nfor (u32 r = rep; r < num_roots; r += R) {{\nconst u32 root = roots[r];\n{before_root}const float* hin = (root < num_internal || !use_table) ? push + (u64)root * {p}u : table_push + (u64)tokens[root] * {p}u;\nconst u32 cb = 0, ce = 0, c0 = 0, c1 = 0; (void)cb; (void)ce; (void)c0; (void)c1; const u32 tok = 0; (void)tok;\n{head_cell}}}\n}}\n}}\n",
            warp_coordinates(self.head.program.units)
        ))
    }
}
