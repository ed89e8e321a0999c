//! The compiled inference engine (Cortex) on the device against the CPU
//! reference engine: root scores of every token model, for every schedule
//! (leaf table and weight persistence on and off), on one batch of random
//! trees with degenerate shapes (a single leaf, a 500-deep path, a 64-ary
//! node, an 80-leaf binary caterpillar for the MV-RNN), grid DAGs or chains;
//! the MV-RNN with shared word matrices; and under recursive refactoring and
//! unrolling (Cortex Fig. 4, 5) on the same graphs (refactoring also on
//! DAGs, unrolling refused there). Skips with a notice where no CUDA
//! driver is found.

mod common;

use ramus_core::recursion::{analyze, RecursionSchedule};
use ramus_core::{HeadRows, Model, Params};
use ramus_cpu::CpuEngine;
use ramus_cuda::compiled::{
    CompiledEngine, CompiledOptions, CompiledOutput, CompiledSchedule, LEVEL_ORDER_SAMPLES,
};
use ramus_exec::{Batch, Mode};
use ramus_graph::random::{grid_dag, random_chain, random_path, random_tree};
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_nn::{build_model_with, build_mvrnn, ModelConfig, ModelOptions};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A deep binary tree: each internal vertex joins the previous one and a
/// new leaf (`leaves - 1` levels).
fn caterpillar(rng: &mut ChaCha8Rng, leaves: usize, vocab: u32) -> InputGraph {
    let mut g = InputGraph::new();
    let mut top = g
        .push_vertex(&[], rng.random_range(0..vocab), 0)
        .expect("leaf");
    for i in 1..leaves {
        let leaf = g
            .push_vertex(&[], rng.random_range(0..vocab), 1)
            .expect("leaf");
        let kids = if i % 2 == 0 { [top, leaf] } else { [leaf, top] };
        top = g.push_vertex(&kids, 0, 2).expect("internal");
    }
    g
}

fn graphs(name: &str, rng: &mut ChaCha8Rng, vocab: u32) -> Vec<InputGraph> {
    if name == "dagrnn" {
        return [(1, 1), (3, 5), (10, 10)]
            .iter()
            .map(|&(r, c)| grid_dag(rng, r, c, vocab, 3).expect("grid"))
            .collect();
    }
    if name == "lstm-lm" {
        return [1, 2, 17, 300]
            .iter()
            .map(|&n| random_chain(rng, n, vocab).expect("chain"))
            .collect();
    }
    let mut gs = vec![
        random_tree(rng, 1, &[2], vocab, 3).expect("a single leaf"),
        random_tree(rng, 9, &[2], vocab, 3).expect("tree"),
        random_tree(rng, 40, &[2], vocab, 3).expect("tree"),
    ];
    if name == "mvrnn" {
        gs.push(caterpillar(rng, 80, vocab));
    }
    // real trees: binary, for every tree model
    gs.extend(common::sst_dev_trees(12, vocab));
    if name == "treelstm" || name == "treegru" {
        gs.push(random_path(rng, 500, vocab, 3).expect("a 500-deep path"));
        gs.push(random_tree(rng, 64, &[64], vocab, 3).expect("a 64-ary node"));
        gs.push(random_tree(rng, 30, &[1, 2, 3, 6], vocab, 3).expect("mixed arities"));
    }
    gs
}

/// Model `name` with its initial parameters perturbed (so no weight is
/// a round value).
fn perturbed_model(name: &str, cfg: &ModelConfig, rng: &mut ChaCha8Rng) -> (Model, Params<f32>) {
    let model = build_model_with(name, cfg, &ModelOptions { dropout: 0.1 }).expect("model");
    let mut params: Params<f32> = Params::init(&model, 3);
    for t in params.values.iter_mut() {
        for x in t.data_mut() {
            *x += rng.random_range(-0.1..0.1);
        }
    }
    (model, params)
}

/// This process's kernel cache for the schedule tests.
fn cache_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("ramus-compiled-{}", std::process::id()))
}

#[test]
fn compiled_scores_match_the_cpu_engine_for_every_model_and_schedule() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    // 24 columns: dot products with a partial last chunk; 64: two full ones
    for hidden in [24, 64] {
        let cfg = ModelConfig {
            vocab: 50,
            hidden,
            classes: 5,
        };
        for name in [
            "treelstm",
            "treelstm-nary",
            "treefc",
            "treegru",
            "mvrnn",
            "dagrnn",
            "lstm-lm",
        ] {
            let (model, params) = perturbed_model(name, &cfg, &mut rng);
            let gs = graphs(name, &mut rng, cfg.vocab as u32);
            let want = reference(&model, &params, &gs);
            let refs: Vec<&InputGraph> = gs.iter().collect();
            for (leaf_table, persistent_weights, node_counters) in [
                (true, true, true),
                (true, true, false),
                (true, false, true),
                (false, true, true),
                (false, true, false),
                (false, false, false),
            ] {
                let options = CompiledOptions {
                    schedule: CompiledSchedule {
                        leaf_table,
                        persistent_weights,
                        node_counters: Some(node_counters),
                        recursion: RecursionSchedule::fixed(false, false),
                    },
                    cache_dir: Some(cache_dir()),
                    ..CompiledOptions::default()
                };
                let mut engine = CompiledEngine::new(&model, &params, &options).expect("compiles");
                let what = format!(
                    "{name} h{hidden} table {leaf_table} persistent {persistent_weights} \
                     counters {node_counters}"
                );
                // round 0: one batch (its index arrays uploaded, where
                // they outgrow the launch's inline words); round 1: graph
                // by graph (small batches carried by the launch)
                for round in 0..2 {
                    let got = if round == 0 {
                        engine.infer(&refs).expect("infers")
                    } else {
                        let mut all = CompiledOutput::default();
                        for (g, graph) in gs.iter().enumerate() {
                            let one = engine.infer(&[graph]).expect("infers");
                            all.classes = one.classes;
                            all.scores.extend(one.scores);
                            all.root_graph
                                .extend(one.root_graph.iter().map(|_| g as u32));
                        }
                        all
                    };
                    assert_eq!(got.scores.len(), want.len(), "{what}: score count");
                    for (i, (w, g)) in want.iter().zip(&got.scores).enumerate() {
                        assert!(
                            (w - g).abs() <= 1e-4 * (1.0 + w.abs()),
                            "{what} round {round}: score {i} (graph {}) CPU {w} vs compiled {g}",
                            got.root_graph[i / got.classes]
                        );
                    }
                }
            }
        }
    }
}

/// Reference root scores of `gs`, graph by graph.
fn reference(model: &Model, params: &Params<f32>, gs: &[InputGraph]) -> Vec<f32> {
    let mut want = Vec::new();
    for g in gs {
        let batch = Batch::new(model, vec![g], BatchingPolicy::Cavs).expect("schedule");
        let out = CpuEngine::<f32>::new()
            .forward_rows(model, params, &batch, Mode::Infer, HeadRows::Roots)
            .expect("reference");
        want.extend(out.logits);
    }
    want
}

#[test]
fn refactored_and_unrolled_schedules_match_the_cpu_engine_for_every_model() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for hidden in [24, 64] {
        let cfg = ModelConfig {
            vocab: 50,
            hidden,
            classes: 5,
        };
        for name in [
            "treelstm",
            "treelstm-nary",
            "treefc",
            "treegru",
            "dagrnn",
            "lstm-lm",
        ] {
            let (model, params) = perturbed_model(name, &cfg, &mut rng);
            let refactorable = !analyze(&model).expect("analyzes").is_empty();
            let gs = graphs(name, &mut rng, cfg.vocab as u32);
            let want = reference(&model, &params, &gs);
            let refs: Vec<&InputGraph> = gs.iter().collect();
            for refactor in [false, true] {
                if refactor && !refactorable {
                    continue;
                }
                for unroll in [false, true] {
                    if !refactor && !unroll {
                        continue; // the test above
                    }
                    for leaf_table in [true, false] {
                        let options = CompiledOptions {
                            schedule: CompiledSchedule {
                                leaf_table,
                                persistent_weights: true,
                                // refactored stages both ways: counters
                                // with tables, grid barriers without
                                node_counters: Some(leaf_table),
                                recursion: RecursionSchedule::fixed(refactor, unroll),
                            },
                            cache_dir: Some(cache_dir()),
                            ..CompiledOptions::default()
                        };
                        let what = format!(
                            "{name} h{hidden} refactor {refactor} unroll {unroll} table {leaf_table}"
                        );
                        let mut engine = CompiledEngine::new(&model, &params, &options)
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_eq!(
                            engine.schedule().persistent_weights,
                            !unroll,
                            "{what}: unrolling reads the weights from memory"
                        );
                        if unroll && name == "dagrnn" {
                            let err = engine.infer(&refs).expect_err("a DAG does not unroll");
                            assert!(err.to_string().contains("several parents"), "{what}: {err}");
                            continue;
                        }
                        for round in 0..2 {
                            let got = engine
                                .infer(&refs)
                                .unwrap_or_else(|e| panic!("{what}: {e}"));
                            assert_eq!(got.scores.len(), want.len(), "{what}: score count");
                            for (i, (w, g)) in want.iter().zip(&got.scores).enumerate() {
                                assert!(
                                    (w - g).abs() <= 1e-4 * (1.0 + w.abs()),
                                    "{what} round {round}: score {i} (graph {}) CPU {w} vs compiled {g}",
                                    got.root_graph[i / got.classes]
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn refactoring_runs_on_dags_and_is_refused_where_nothing_moves() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let cfg = ModelConfig {
        vocab: 13,
        hidden: 32,
        classes: 3,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let gs: Vec<InputGraph> = [(3, 4), (6, 6)]
        .iter()
        .map(|&(r, c)| grid_dag(&mut rng, r, c, cfg.vocab as u32, 3).expect("grid"))
        .collect();
    let refs: Vec<&InputGraph> = gs.iter().collect();
    let refactored = CompiledOptions {
        schedule: CompiledSchedule {
            recursion: RecursionSchedule::fixed(true, false),
            ..CompiledSchedule::default()
        },
        ..CompiledOptions::default()
    };
    let model = build_model_with("treegru", &cfg, &ModelOptions { dropout: 0.0 }).expect("model");
    let params: Params<f32> = Params::init(&model, 2);
    let want = reference(&model, &params, &gs);
    let mut engine = CompiledEngine::new(&model, &params, &refactored).expect("compiles");
    let got = engine.infer(&refs).expect("a DAG refactors");
    for (w, g) in want.iter().zip(&got.scores) {
        assert!((w - g).abs() <= 1e-4 * (1.0 + w.abs()), "{w} vs {g}");
    }
    let model = build_model_with("treefc", &cfg, &ModelOptions { dropout: 0.0 }).expect("model");
    let params: Params<f32> = Params::init(&model, 2);
    let err = CompiledEngine::new(&model, &params, &refactored)
        .err()
        .expect("nothing to refactor")
        .to_string();
    assert!(err.contains("nothing to refactor"), "{err}");
}

#[test]
fn the_level_ordering_is_measured_then_kept_with_unchanged_scores() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let cfg = ModelConfig {
        vocab: 40,
        hidden: 64,
        classes: 5,
    };
    for name in ["treelstm", "treegru"] {
        let model = build_model_with(name, &cfg, &ModelOptions { dropout: 0.0 }).expect("model");
        let params: Params<f32> = Params::init(&model, 5);
        let gs = graphs(name, &mut rng, cfg.vocab as u32);
        let want = reference(&model, &params, &gs);
        let refs: Vec<&InputGraph> = gs.iter().collect();
        let options = CompiledOptions {
            cache_dir: Some(
                std::env::temp_dir().join(format!("ramus-compiled-order-{}", std::process::id())),
            ),
            ..CompiledOptions::default()
        };
        assert_eq!(options.schedule.node_counters, None, "measured by default");
        let mut engine = CompiledEngine::new(&model, &params, &options).expect("compiles");
        assert!(
            engine.measuring_level_order(),
            "{name}: both orderings timed"
        );
        // both orderings run (alternating), then the faster alone
        for round in 0..2 * LEVEL_ORDER_SAMPLES + 2 {
            let got = engine.infer(&refs).expect("infers");
            for (i, (w, g)) in want.iter().zip(&got.scores).enumerate() {
                assert!(
                    (w - g).abs() <= 1e-4 * (1.0 + w.abs()),
                    "{name} round {round}: score {i}: CPU {w} vs compiled {g}"
                );
            }
        }
        assert!(!engine.measuring_level_order(), "{name}: settled");
        assert!(
            engine.schedule().node_counters.is_some(),
            "{name}: a choice"
        );
        assert_eq!(engine.last_kernel_seconds(), None, "{name}: no timing left");
    }
}

#[test]
fn tokens_beyond_the_vocabulary_are_refused_naming_the_vertex() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let cfg = ModelConfig {
        vocab: 10,
        hidden: 32,
        classes: 3,
    };
    let model = build_model_with("treelstm", &cfg, &ModelOptions { dropout: 0.0 }).expect("model");
    let params: Params<f32> = Params::init(&model, 1);
    let mut engine =
        CompiledEngine::new(&model, &params, &CompiledOptions::default()).expect("compiles");
    let mut g = InputGraph::new();
    let a = g.push_vertex(&[], 3, 0).expect("leaf");
    let b = g.push_vertex(&[], 10, 0).expect("leaf");
    g.push_vertex(&[a, b], 0, 1).expect("root");
    let err = engine.infer(&[&g]).expect_err("token 10 of 10");
    let text = err.to_string();
    assert!(
        text.contains("graph 0 vertex 1") && text.contains("token 10"),
        "{text}"
    );
}

#[test]
fn too_few_blocks_for_the_units_is_an_error_not_a_silent_skip() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let cfg = ModelConfig {
        vocab: 10,
        hidden: 64,
        classes: 3,
    };
    let model = build_model_with("treelstm", &cfg, &ModelOptions { dropout: 0.0 }).expect("model");
    let params: Params<f32> = Params::init(&model, 1);
    // 64 units need 64 warps: 4 blocks of 512 threads
    let options = CompiledOptions {
        block_threads: Some(512),
        max_blocks: Some(1),
        ..CompiledOptions::default()
    };
    let err = CompiledEngine::new(&model, &params, &options)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("needs 4 resident blocks"), "{err}");
}

#[test]
fn compiled_mvrnn_with_shared_word_matrices_matches_the_cpu_engine() {
    if !common::cuda_ready("skipping") {
        return;
    }
    // 128 units (the benchmark's larger size); tokens 8.. share row 0 of
    // the word matrices
    let cfg = ModelConfig {
        vocab: 30,
        hidden: 128,
        classes: 5,
    };
    let model = build_mvrnn(&cfg, 8, &ModelOptions { dropout: 0.0 }).expect("model");
    let params: Params<f32> = Params::init(&model, 4);
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let gs = vec![
        random_tree(&mut rng, 1, &[2], 30, 3).expect("a single leaf"),
        random_tree(&mut rng, 20, &[2], 30, 3).expect("tree"),
        caterpillar(&mut rng, 30, 30),
    ];
    let mut want = Vec::new();
    for g in &gs {
        let batch = Batch::new(&model, vec![g], BatchingPolicy::Cavs).expect("schedule");
        want.extend(
            CpuEngine::<f32>::new()
                .forward_rows(&model, &params, &batch, Mode::Infer, HeadRows::Roots)
                .expect("reference")
                .logits,
        );
    }
    let refs: Vec<&InputGraph> = gs.iter().collect();
    for leaf_table in [true, false] {
        let options = CompiledOptions {
            schedule: CompiledSchedule {
                leaf_table,
                ..CompiledSchedule::default()
            },
            cache_dir: Some(
                std::env::temp_dir().join(format!("ramus-compiled-mv-{}", std::process::id())),
            ),
            ..CompiledOptions::default()
        };
        let mut engine = CompiledEngine::new(&model, &params, &options).expect("compiles");
        let got = engine.infer(&refs).expect("infers");
        assert_eq!(got.scores.len(), want.len());
        for (i, (w, g)) in want.iter().zip(&got.scores).enumerate() {
            assert!(
                (w - g).abs() <= 1e-4 * (1.0 + w.abs()),
                "table {leaf_table}: score {i} CPU {w} vs compiled {g}"
            );
        }
    }
}

/// A vertex the model's cell cannot read (three children, or one, for the
/// binary TreeFC) is refused by the compiled engine, naming the graph and
/// the vertex, rather than run with a child dropped or read as zeros; the
/// same trees binarized run and match the CPU engine.
#[test]
fn compiled_engine_refuses_vertices_its_cell_cannot_read() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let cfg = ModelConfig {
        vocab: 50,
        hidden: 24,
        classes: 5,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (model, params) = perturbed_model("treefc", &cfg, &mut rng);
    let mut ternary = InputGraph::new();
    for t in 1..=3 {
        ternary.push_vertex(&[], t, 1).expect("leaf");
    }
    ternary.push_vertex(&[0, 1, 2], 0, 2).expect("root");
    let mut unary = InputGraph::new();
    unary.push_vertex(&[], 4, 1).expect("leaf");
    unary.push_vertex(&[0], 0, 2).expect("root");
    let options = CompiledOptions {
        cache_dir: Some(cache_dir()),
        ..CompiledOptions::default()
    };
    let mut engine = CompiledEngine::new(&model, &params, &options).expect("compiles");
    let ok = random_tree(&mut rng, 5, &[2], 50, 3).expect("tree");
    for (bad, want) in [
        (&ternary, "graph 1: vertex 3 has 3 children"),
        (&unary, "graph 1: vertex 1 has 1 child"),
    ] {
        let e = engine.infer(&[&ok, bad]).err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.starts_with(want) && e.contains("--binarize")),
            "{e:?}"
        );
    }
    let binary: Vec<InputGraph> = [&ternary, &unary]
        .iter()
        .map(|g| ramus_graph::binarize::binarize(g, ramus_graph::binarize::Side::Left, 0))
        .collect::<Result<_, _>>()
        .expect("binarized");
    let refs: Vec<&InputGraph> = binary.iter().collect();
    let got = engine.infer(&refs).expect("binarized trees run").scores;
    let want = reference(&model, &params, &binary);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (w - g).abs() <= 1e-4 * (1.0 + w.abs()),
            "{got:?} vs {want:?}"
        );
    }
}
