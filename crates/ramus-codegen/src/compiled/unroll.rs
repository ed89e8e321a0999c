//! CodeGen of the **unrolled** level kernel of the compiled inference
//! engine (Cortex §3.1 Fig. 4, §7.4 and appendix D): the recursion
//! unrolled once over the groups of an unrolled plan (a node and its
//! children of the level below; see `ramus_graph::unroll`).
//!
//! One **thread block per group**: its warps split the children's (node,
//! unit) pairs, a block barrier (`__syncthreads`) follows, then they split
//! the parent's units, so the parent reads its children's new state rows
//! while they are still in the multiprocessor's L1, and every stage of a
//! multi-stage cell is separated by a block barrier instead of a grid
//! barrier. Only steps (two levels each) are separated by grid barriers:
//! half as many as level by level, but each block computes whole nodes,
//! so a warp covers many units and the weight rows cannot stay in its
//! registers (model persistence is off: weights come from L2), and a
//! step's parents wait for its slowest group. The leaf phase (without
//! the leaf table) and the head are the level kernel's.
//!
//! Kernel parameters (the engine's launch relies on this order):
//!
//! ```text
//! NAME_unrolled(const float* params, float* state, float* push,
//!               const float* table_state, const float* table_push, const float* token_table,
//!               float* scratch,
//!               const u32* child_offsets, const u32* child_rows, const u32* tokens,
//!               const u32* step_begin, u32 num_steps, const u32* group_parent,
//!               const u32* group_child_begin, const u32* group_children,
//!               u32 num_internal, u32 num_nodes, const u32* roots, u32 num_roots,
//!               float* scores, u32* barrier)
//! ```
//!
//! `scratch` holds a row per node (the wider of the leaf's and internal
//! cell's scratch widths); the rest as in [`super`].

use std::fmt::Write as _;

use ramus_core::error::Result;

use super::level::param_pointers;
use super::spec::{used_stages, TreeKernelSpec};
use super::writer::CellWriter;
use crate::template::fill;

/// The unrolled level kernel (`unrolled.cu`), its `@KEY@`s filled by
/// [`TreeKernelSpec::unrolled_source`].
const UNROLLED: &str = include_str!("unrolled.cu");

impl TreeKernelSpec<'_> {
    /// The table kernels and level kernel of [`TreeKernelSpec::source`]
    /// plus `NAME_unrolled` (see the module docs). The internal cell reads
    /// its weights from memory whatever `persistent_weights` says.
    pub fn unrolled_source(&self) -> Result<String> {
        let mut src = self.source()?;
        let (s, p) = (
            self.internal.program.output_width(0),
            self.internal.program.output_width(1),
        );
        let (name, block) = (self.name, self.block_threads);
        let units = self.internal.program.units;
        let outputs = [
            format!("state + (u64)n * {s}u"),
            format!("push + (u64)n * {p}u"),
        ];
        let outputs: Vec<&str> = outputs.iter().map(String::as_str).collect();
        // a node's loads, for node `n` in scope
        let node = "const u32 tok = tokens[n]; (void)tok;\nconst u32 cb = child_offsets[n], ce = child_offsets[n + 1];\nconst u32 c0 = cb < ce ? child_rows[cb] : 0, c1 = cb + 1 < ce ? child_rows[cb + 1] : 0;\n";
        let mut children = String::new();
        let mut parent = String::new();
        for stage in 0..used_stages(self.internal.program) {
            let code = CellWriter::new(self.internal, None).cell_stage(stage, &outputs)?;
            let _ = write!(
                children,
                "for (u32 t = bw; t < (ke - kb) * {units}u; t += BW) {{\nconst u32 n = group_children[kb + t / {units}u];\nconst u32 j = t % {units}u;\n{node}{code}}}\n__syncthreads();\n"
            );
            let _ = write!(
                parent,
                "for (u32 j = bw; j < {units}u; j += BW) {{\nconst u32 n = par;\n{node}{code}}}\n__syncthreads();\n"
            );
        }
        let leaf_phase = self.leaf_phase()?;
        // every branch of the steps' loop is uniform over the block (group
        // and step indices), so each `__syncthreads` is reached by all its
        // threads
        src += &fill(
            UNROLLED,
            &[
                ("BLOCK", &block.to_string()),
                ("NAME", name),
                ("PARAM_POINTERS", &param_pointers(self.param_offsets)),
                ("USE_TABLE", &self.leaf_table.to_string()),
                ("LEAF_PHASE", &leaf_phase),
                ("CHILDREN", &children),
                ("PARENT", &parent),
                ("HEAD_PHASE", &self.head_phase("")?),
            ],
        );
        Ok(src)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compiled::{LoweredCell, CELL_BLOCK};
    use ramus_core::lower::lower;
    use ramus_core::model::{FunctionSelector, HeadRows, Init, ModelBuilder};

    /// Calls `check` with the kernel spec of a binary tree RNN (hidden 32,
    /// no tables, weights from memory, grid barriers).
    fn with_tree_rnn_spec(check: impl FnOnce(TreeKernelSpec<'_>)) {
        let (vocab, h) = (7, 32);
        let mut m = ModelBuilder::new("tree-rnn", h);
        let emb = m.param("emb", &[vocab, h], Init::Normal { std: 0.1 });
        let w = m.param("W", &[h, 2 * h], Init::Xavier);
        let w_out = m.param("W_out", &[3, h], Init::Xavier);
        let leaf = m
            .vertex_fn("leaf", |f| {
                let x = f.embed(emb);
                let x = f.tanh(x);
                f.scatter(x);
                f.push(x);
            })
            .expect("leaf");
        let internal = m
            .vertex_fn("internal", |f| {
                let (l, r) = (f.gather(0), f.gather(1));
                let lr = f.concat(&[l, r]);
                let w = f.param(w);
                let z = f.linear(lr, w, None);
                let h = f.tanh(z);
                f.scatter(h);
                f.push(h);
            })
            .expect("internal");
        m.select(FunctionSelector::LeafInternal { leaf, internal });
        m.head(HeadRows::Roots, h, |hd| {
            let x = hd.input();
            let w = hd.param(w_out);
            let logits = hd.linear(x, w, None);
            let labels = hd.labels();
            let l = hd.softmax_xent(logits, labels);
            let loss = hd.mean_rows(l);
            hd.loss(loss);
            hd.logits(logits);
        })
        .expect("head");
        let model = m.build().expect("model");
        let cell = |f: usize| {
            let func = &model.functions[f];
            lower(
                &func.forward,
                &[func.scatter.expect("scatter"), func.push.expect("push")],
            )
            .expect("lowers")
        };
        let (lp, ip) = (cell(leaf), cell(internal));
        let hp = lower(&model.head.forward, &[model.head.logits.expect("logits")]).expect("head");
        let offsets = vec![0; model.params.len()];
        let spec = TreeKernelSpec {
            name: "cortex",
            leaf: LoweredCell {
                graph: &model.functions[leaf].forward,
                program: &lp,
            },
            internal: LoweredCell {
                graph: &model.functions[internal].forward,
                program: &ip,
            },
            head: LoweredCell {
                graph: &model.head.forward,
                program: &hp,
            },
            param_offsets: &offsets,
            persistent_weights: false,
            leaf_table: false,
            node_counters: false,
            block_threads: CELL_BLOCK,
            token_table: None,
        };
        check(spec);
    }

    /// Whether `{` and `}` balance in `src`.
    fn balanced(src: &str) -> bool {
        src.matches('{').count() == src.matches('}').count()
    }

    #[test]
    fn the_unrolled_kernel_walks_steps_and_groups_with_block_barriers() {
        with_tree_rnn_spec(|spec| {
            let src = spec.unrolled_source().expect("generates");
            let kernel = &src[src.find("cortex_unrolled").expect("the unrolled kernel")..];
            // the leaf phase's grid barrier and one per step; block barriers
            // after the children and after the parent
            assert_eq!(kernel.matches("grid_sync(barrier, &bar_gen);").count(), 2);
            assert_eq!(kernel.matches("__syncthreads();").count(), 2);
            assert!(kernel.contains("group_children[kb + t / 32u]"));
            // no persistent weight registers: rows come from memory
            assert!(!kernel.contains("float w0["));
            assert!(balanced(kernel), "balanced braces");
        });
    }

    #[test]
    fn node_counters_replace_the_level_barriers_by_waits_on_the_children() {
        with_tree_rnn_spec(|spec| {
            let levels = |spec: TreeKernelSpec<'_>| {
                let src = spec.source().expect("generates");
                let at = src.find("cortex_levels").expect("the level kernel");
                src[at..].to_string()
            };
            let barriers = levels(spec);
            // the leaf phase's barrier and one per level
            assert_eq!(barriers.matches("grid_sync(barrier, &bar_gen);").count(), 2);
            assert!(!barriers.contains("signal_done("));
            let counters = levels(TreeKernelSpec {
                node_counters: true,
                ..spec
            });
            // only the leaf phase's barrier is left; 32 units in blocks of
            // 16 warps: a block arrives as one, twice per node
            assert_eq!(counters.matches("grid_sync(barrier, &bar_gen);").count(), 1);
            assert!(counters.contains("wait_children(done + 0u * num_internal, cb, ce, c0, c1, child_rows, num_internal, 2u);"));
            assert!(counters.contains("signal_done(done + 0u * num_internal + begin + i);"));
            assert!(counters.contains("wait_count(done + 0u * num_internal + root, 2u)"));
            assert!(
                balanced(&barriers) && balanced(&counters),
                "balanced braces"
            );
        });
    }
}
