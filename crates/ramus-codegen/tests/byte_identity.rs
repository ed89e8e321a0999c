//! The generated CUDA sources of real models are byte-identical to the ones
//! recorded before code generation moved out of `ramus-core` (issue 31): the
//! kernel cache is keyed on the source, and a restructuring of the
//! generators must not change what they emit. A deliberate change to a
//! generator updates these hashes (run with `--nocapture` to see the new
//! ones in the failure message).

use ramus_codegen::compiled::{
    token_stage_kernel, used_stages, LoweredCell, TreeKernelSpec, CELL_BLOCK,
};
use ramus_codegen::fused::FusedSource;
use ramus_core::fusion::{forward_reads, fuse, FusionPlan, Step};
use ramus_core::graph::{Graph, NodeId, NodeKind};
use ramus_core::recursion::{analyze, lower_scheduled};
use ramus_core::Model;
use ramus_nn::{build_model_with, ModelConfig, ModelOptions};

/// FNV-1a (64 bits): stable across Rust releases, unlike `DefaultHasher`.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn model(name: &str, hidden: usize) -> Model {
    let cfg = ModelConfig {
        vocab: 50,
        hidden,
        classes: 5,
    };
    build_model_with(name, &cfg, &ModelOptions { dropout: 0.1 })
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// One compiled-engine schedule, as `ramus-cuda`'s `CompiledEngine` applies it.
#[derive(Clone, Copy, Debug)]
struct Schedule {
    leaf_table: bool,
    persistent_weights: bool,
    node_counters: bool,
    refactor: bool,
    unroll: bool,
}

/// The sources the compiled engine generates for `model` under `s`: the
/// level kernel (or the unrolled one) and the leaf tables' stage kernels.
fn compiled_sources(model: &Model, s: Schedule) -> String {
    let cells = lower_scheduled(model, s.refactor).unwrap_or_else(|e| panic!("{s:?}: {e}"));
    let leaf_table = s.leaf_table && cells.vocab.is_some();
    let mut internal = cells.internal;
    let hoisted = if leaf_table {
        internal.program.hoist_token_values()
    } else {
        None
    };
    let token_table = hoisted.map(|h| {
        internal.program = h.program;
        h.table
    });
    let mut offsets = Vec::new();
    let mut total = 0;
    for p in &model.params {
        offsets.push(total);
        total += p.shape.iter().product::<usize>();
    }
    let mut spec = TreeKernelSpec {
        name: "cortex",
        leaf: LoweredCell {
            graph: &cells.leaf.graph,
            program: &cells.leaf.program,
        },
        internal: LoweredCell {
            graph: &internal.graph,
            program: &internal.program,
        },
        head: LoweredCell {
            graph: &model.head.forward,
            program: &cells.head,
        },
        param_offsets: &offsets,
        persistent_weights: s.persistent_weights && !s.unroll,
        leaf_table,
        block_threads: CELL_BLOCK,
        node_counters: s.node_counters && !s.unroll,
        token_table: token_table.as_ref().map(|table| LoweredCell {
            graph: &internal.graph,
            program: table,
        }),
    };
    spec.block_threads = spec.default_block_threads();
    let mut out = if s.unroll {
        spec.unrolled_source()
    } else {
        spec.source()
    }
    .unwrap_or_else(|e| panic!("{s:?}: {e}"));
    out += &format!(
        "// block {} registers {} rows {:?}\n",
        spec.block_threads,
        spec.weight_registers(),
        spec.register_rows()
    );
    for stage in 0..used_stages(&cells.leaf.program) {
        out += &token_stage_kernel("cortex_leaf_table", stage);
    }
    out
}

/// Every schedule the compiled engine's GPU tests run `model` under.
fn compiled_schedules(model: &Model) -> Vec<Schedule> {
    let refactorable = !analyze(model).expect("analyzes").is_empty();
    let mut out = Vec::new();
    for (leaf_table, persistent_weights, node_counters) in [
        (true, true, true),
        (true, true, false),
        (true, false, true),
        (false, true, true),
        (false, true, false),
        (false, false, false),
    ] {
        for (refactor, unroll) in [(false, false), (true, false), (false, true), (true, true)] {
            if refactor && !refactorable {
                continue;
            }
            out.push(Schedule {
                leaf_table,
                persistent_weights,
                node_counters,
                refactor,
                unroll,
            });
        }
    }
    out
}

#[test]
fn compiled_engine_sources_are_byte_identical_to_the_recorded_ones() {
    let mut got = Vec::new();
    for (name, hiddens) in [
        ("treelstm", &[24, 64, 512][..]),
        ("treelstm-nary", &[24, 64]),
        ("treefc", &[24, 64]),
        ("treegru", &[24, 64]),
        ("mvrnn", &[6, 32]),
        ("dagrnn", &[24, 64]),
        ("lstm-lm", &[24, 64]),
    ] {
        for &hidden in hiddens {
            let m = model(name, hidden);
            let mut all = String::new();
            for s in compiled_schedules(&m) {
                all += &format!("{s:?}\n");
                all += &compiled_sources(&m, s);
            }
            got.push((format!("{name} h{hidden}"), all.len(), fnv1a(&all)));
        }
    }
    let want: [(&str, usize, u64); 15] = [
        ("treelstm h24", 509099, 0x7f8c1c0d3c56e1f2),
        ("treelstm h64", 504141, 0xcd7172caeb44467a),
        ("treelstm h512", 508062, 0x67b39ae082402909),
        ("treelstm-nary h24", 230867, 0x576c20a0ba0ca43a),
        ("treelstm-nary h64", 228169, 0x9d076b991e9c198f),
        ("treefc h24", 171992, 0x46a2ed55211063a7),
        ("treefc h64", 171571, 0x5d6dbebcc76a8416),
        ("treegru h24", 520035, 0xbbf539e37db665d9),
        ("treegru h64", 517380, 0x382fa3a3464e7805),
        ("mvrnn h6", 259637, 0xf99b55c3cba9c287),
        ("mvrnn h32", 382030, 0xc494543df9d4b9e8),
        ("dagrnn h24", 211875, 0x6eb7d594d3a50332),
        ("dagrnn h64", 210318, 0xe7a2eb9aa4e64fda),
        ("lstm-lm h24", 589017, 0x86670053bd8e0651),
        ("lstm-lm h64", 578485, 0xed413c4177d8610b),
    ];
    let got: Vec<(&str, usize, u64)> = got.iter().map(|(n, l, h)| (n.as_str(), *l, *h)).collect();
    assert_eq!(got, want, "{got:#x?}");
}

/// Op nodes of `graph` that `wanted` accepts, in node order.
fn op_nodes(graph: &Graph, wanted: impl Fn(NodeId) -> bool) -> Vec<NodeId> {
    (0..graph.nodes.len())
        .filter(|&n| matches!(graph.nodes[n].kind, NodeKind::Op(_)) && wanted(n))
        .collect()
}

/// The fused groups' sources of one graph's plans: the batched engine's
/// kernels (name, source, signature) and the persistent kernel's cases,
/// their concat writes plain and scatter-added.
fn fused_sources(graph: &Graph, plans: &[FusionPlan]) -> String {
    let mut out = String::new();
    for (case, group) in plans
        .iter()
        .flat_map(|p| &p.steps)
        .filter_map(|s| match s {
            Step::Fused(g) => Some(g),
            Step::Op(_) => None,
        })
        .enumerate()
    {
        let kernel = group.kernel(graph).expect("generates");
        out += &format!("{}\n{}", kernel.name, kernel.source);
        out += &group.signature(graph).expect("signature");
        out += &group
            .persistent_case(graph, case, &|_| false)
            .expect("case");
        out += &group.persistent_case(graph, case, &|_| true).expect("case");
        out += &format!("operands {}\n", group.persistent_operands());
    }
    out
}

/// Every fused group's sources of `model`, planned the way the batched CUDA
/// engine plans it (forward with and without the backward's reads kept,
/// backward, head).
fn model_fused_sources(model: &Model) -> String {
    let plan = |g: &Graph, phases: &[Vec<NodeId>], keep: &std::collections::BTreeSet<NodeId>| {
        let plans: Vec<FusionPlan> = phases
            .iter()
            .map(|nodes| fuse(g, nodes, &|n| keep.contains(&n)).expect("fuses"))
            .collect();
        fused_sources(g, &plans)
    };
    let none = Default::default();
    let mut out = String::new();
    for f in &model.functions {
        let keep = forward_reads(&f.backward);
        let fp = &f.forward_plan;
        let phases = [fp.eager.clone(), fp.per_task.clone(), fp.lazy.clone()];
        out += &plan(&f.forward, &phases, &keep);
        out += &plan(&f.forward, &phases, &none);
        let bp = &f.backward_plan;
        let phases = [bp.eager.clone(), bp.per_task.clone(), bp.lazy.clone()];
        out += &plan(&f.backward, &phases, &none);
    }
    let head = &model.head;
    let keep = forward_reads(&head.backward);
    let phases = [op_nodes(&head.forward, |_| true)];
    out += &plan(&head.forward, &phases, &keep);
    out += &plan(&head.forward, &phases, &none);
    let phases = [op_nodes(&head.backward, |_| true)];
    out += &plan(&head.backward, &phases, &none);
    out
}

#[test]
fn fused_group_sources_are_byte_identical_to_the_recorded_ones() {
    let mut got = Vec::new();
    for name in [
        "treelstm",
        "treelstm-nary",
        "treefc",
        "treegru",
        "mvrnn",
        "dagrnn",
        "lstm-lm",
        "bilstm-tagger",
        "td-rnn",
        "td-lstm",
        "rvnn",
        "alexnet",
        "vgg11",
        "resnet",
    ] {
        let m = model(name, 24);
        let all = model_fused_sources(&m);
        got.push((name.to_string(), all.len(), fnv1a(&all)));
    }
    let want: [(&str, usize, u64); 14] = [
        ("treelstm", 81931, 0x27fe33829f20f157),
        ("treelstm-nary", 83661, 0x26c6b16a8402da45),
        ("treefc", 27637, 0x1def4326fd43606a),
        ("treegru", 56671, 0xfa35a9a0ecb65610),
        ("mvrnn", 32763, 0x601b2eb303347e92),
        ("dagrnn", 31055, 0x8efa5ac0dd438a67),
        ("lstm-lm", 51931, 0x8f98c5c2e2235f5f),
        ("bilstm-tagger", 104829, 0xae08c45b8de9c54a),
        ("td-rnn", 35130, 0x50cc671d77ff5157),
        ("td-lstm", 90978, 0xcd96eb993e11f3b4),
        ("rvnn", 34188, 0x2774928b6c816b9b),
        ("alexnet", 59833, 0xf16868815bb8e13d),
        ("vgg11", 78940, 0x677ded947735eaa2),
        ("resnet", 72688, 0x75e01d134b94fdee),
    ];
    let got: Vec<(&str, usize, u64)> = got.iter().map(|(n, l, h)| (n.as_str(), *l, *h)).collect();
    assert_eq!(got, want, "{got:#x?}");
}
