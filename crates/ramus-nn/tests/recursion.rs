//! Cortex's recursion primitives (`ramus_core::recursion`,
//! `ramus_graph::unroll`) against the CPU reference engine: the refactored
//! cells, evaluated vertex by vertex, and the compiled CPU engine under
//! every combination of refactoring, unrolling and leaf tables give the
//! reference root scores on random trees (a single leaf, a 500-deep path, a
//! 64-ary node), chains, DAGs and real SST trees (when the shared data is
//! present); refactoring is refused where there is nothing to move, and
//! unrolling on DAG inputs.

use std::path::PathBuf;

use ramus_core::recursion::{analyze, lower_scheduled, ChildKey, RecursionSchedule};
use ramus_core::{HeadRows, Model, Params};
use ramus_cpu::cell_eval::{eval_vertex, VertexInputs};
use ramus_cpu::compiled::{CpuCompiledEngine, CpuCompiledSchedule};
use ramus_cpu::CpuEngine;
use ramus_exec::{Batch, Mode};
use ramus_graph::random::{grid_dag, random_chain, random_path, random_tree};
use ramus_graph::{ptb, BatchingPolicy, InputGraph, Vocab, VocabMode};
use ramus_nn::{build_model_with, ModelConfig, ModelOptions};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const MODELS: [&str; 6] = [
    "treelstm",
    "treelstm-nary",
    "treefc",
    "treegru",
    "dagrnn",
    "lstm-lm",
];

/// Up to `n` SST dev trees, tokens folded into `vocab`; empty (with a
/// notice) when the shared data is absent.
fn sst_trees(n: usize, vocab: u32) -> Vec<InputGraph> {
    let root = match std::env::var_os("RAMUS_DATA") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
    };
    let path = root.join("sst/dev.txt");
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipping the SST trees: {} not found", path.display());
        return Vec::new();
    };
    let mut words = Vocab::new();
    let mut trees = ptb::parse_trees(&text, "dev.txt", VocabMode::Grow(&mut words)).expect("SST");
    trees.truncate(n);
    for t in &mut trees {
        for tok in &mut t.tokens {
            *tok %= vocab;
        }
    }
    trees
}

fn graphs_for(name: &str, rng: &mut ChaCha8Rng, vocab: u32) -> Vec<InputGraph> {
    match name {
        "lstm-lm" => [1, 2, 9, 500]
            .iter()
            .map(|&n| random_chain(rng, n, vocab).expect("chain"))
            .collect(),
        "dagrnn" => vec![
            grid_dag(rng, 1, 1, vocab, 3).expect("one vertex"),
            grid_dag(rng, 4, 5, vocab, 3).expect("grid"),
            random_tree(rng, 20, &[2, 3], vocab, 3).expect("a tree is a DAG too"),
        ],
        _ => {
            let mut gs = vec![
                random_tree(rng, 1, &[2], vocab, 3).expect("a single leaf"),
                random_tree(rng, 9, &[2], vocab, 3).expect("tree"),
                random_tree(rng, 40, &[2], vocab, 3).expect("tree"),
            ];
            if name == "treelstm" || name == "treegru" {
                gs.push(random_path(rng, 500, vocab, 3).expect("a 500-deep path"));
                gs.push(random_tree(rng, 64, &[64], vocab, 3).expect("a 64-ary node"));
                gs.push(random_tree(rng, 30, &[1, 2, 3, 6], vocab, 3).expect("mixed arities"));
            }
            gs.extend(sst_trees(12, vocab));
            gs
        }
    }
}

/// Reference root scores, graph by graph.
fn reference<T: ramus_core::real::Real>(
    model: &Model,
    params: &Params<T>,
    gs: &[InputGraph],
) -> Vec<T> {
    let mut want = Vec::new();
    for g in gs {
        let batch = Batch::new(model, vec![g], BatchingPolicy::Cavs).expect("schedule");
        want.extend(
            CpuEngine::<T>::new()
                .forward_rows(model, params, &batch, Mode::Infer, HeadRows::Roots)
                .expect("reference")
                .logits,
        );
    }
    want
}

#[test]
fn refactoring_moves_the_child_only_products_of_each_model() {
    let cfg = ModelConfig {
        vocab: 11,
        hidden: 6,
        classes: 3,
    };
    let h = cfg.hidden;
    for name in MODELS {
        let model = build_model_with(name, &cfg, &ModelOptions { dropout: 0.25 }).expect("model");
        let moved = analyze(&model).expect("analyzes");
        let keys: Vec<(ChildKey, usize)> = moved.iter().map(|m| (m.key, m.width)).collect();
        let expected: &[(ChildKey, usize)] = match name {
            // σ(U_f h_k + b_f) ⊙ c_k
            "treelstm" => &[(ChildKey::Edge, h)],
            // σ(U_r h_k + b_r) ⊙ h_k
            "treegru" => &[(ChildKey::Edge, h)],
            // W_h h_prev (no bias: zero for the first token, as before)
            "lstm-lm" => &[(ChildKey::Index(0), 4 * h)],
            // products of several children or of a child sum: nothing
            _ => &[],
        };
        assert_eq!(keys, expected, "{name}");
        let base = lower_scheduled(&model, false).expect("lowers");
        if expected.is_empty() {
            let err = lower_scheduled(&model, true).expect_err("nothing to refactor");
            assert!(
                err.to_string().contains("nothing to refactor"),
                "{name}: {err}"
            );
            let params: Params<f32> = Params::init(&model, 1);
            let schedule = CpuCompiledSchedule {
                leaf_table: true,
                recursion: RecursionSchedule {
                    refactor: Some(true),
                    unroll: None,
                },
            };
            let err = CpuCompiledEngine::with_schedule(&model, &params, &schedule)
                .err()
                .expect("refused");
            assert!(
                err.to_string().contains(name) && err.to_string().contains("nothing to refactor"),
                "{name}: {err}"
            );
            continue;
        }
        let cells = lower_scheduled(&model, true).expect("refactors");
        let extra: usize = expected.iter().map(|e| e.1).sum();
        assert_eq!(cells.state_width(), model.state_width + extra, "{name}");
        assert_eq!(
            cells.leaf.program.output_width(0),
            cells.state_width(),
            "{name}"
        );
        // the parent's per-edge products are gone
        let edge_dots = |p: &ramus_core::lower::CellProgram| {
            p.scalars
                .iter()
                .filter(|s| {
                    s.scope == ramus_core::lower::Scope::Edge
                        && matches!(s.expr, ramus_core::lower::ScalarExpr::Dot { .. })
                })
                .count()
        };
        assert_eq!(edge_dots(&cells.internal.program), 0, "{name}");
        if name == "treegru" {
            // U_h Σ r_k ⊙ h_k no longer needs a stage of its own in the parent
            assert_eq!(base.internal.program.stages, 2);
            assert!(edge_dots(&base.internal.program) > 0);
        }
    }
}

#[test]
fn refactored_cells_reproduce_the_reference_vertex_by_vertex() {
    let cfg = ModelConfig {
        vocab: 11,
        hidden: 6,
        classes: 3,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for name in ["treelstm", "treegru", "lstm-lm"] {
        let model = build_model_with(name, &cfg, &ModelOptions { dropout: 0.25 }).expect("model");
        let params: Params<f64> = Params::init(&model, 5);
        let data: Vec<&[f64]> = params.values.iter().map(|t| t.data()).collect();
        let cells = lower_scheduled(&model, true).expect("refactors");
        let gs = graphs_for(name, &mut rng, cfg.vocab as u32);
        let want = reference(&model, &params, &gs);
        let mut got = Vec::new();
        for g in &gs {
            let mut states: Vec<Vec<f64>> = Vec::new();
            let mut pushed: Vec<Vec<f64>> = Vec::new();
            for v in 0..g.len() {
                let kids = g.children(v);
                let f = if kids.is_empty() {
                    &cells.leaf
                } else {
                    &cells.internal
                };
                let children: Vec<&[f64]> = kids
                    .iter()
                    .map(|&c| states[c as usize].as_slice())
                    .collect();
                let inputs = VertexInputs {
                    children: &children,
                    token: Some(g.tokens[v]),
                    head_input: None,
                    token_table: None,
                };
                let mut out = eval_vertex(&f.program, &f.graph, &data, &inputs).expect("evaluates");
                pushed.push(out.pop().expect("push"));
                states.push(out.pop().expect("state"));
            }
            for root in g.roots() {
                let inputs = VertexInputs {
                    children: &[],
                    token: None,
                    head_input: Some(&pushed[root as usize]),
                    token_table: None,
                };
                let out =
                    eval_vertex(&cells.head, &model.head.forward, &data, &inputs).expect("head");
                got.extend_from_slice(&out[0]);
            }
        }
        assert_eq!(want.len(), got.len(), "{name}");
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(
                (w - g).abs() <= 1e-9 * (1.0 + w.abs()),
                "{name} score {i}: reference {w} vs refactored {g}"
            );
        }
    }
}

#[test]
fn every_schedule_of_the_cpu_compiled_engine_matches_the_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(33);
    for hidden in [6, 40] {
        let cfg = ModelConfig {
            vocab: 23,
            hidden,
            classes: 3,
        };
        for name in MODELS {
            let model =
                build_model_with(name, &cfg, &ModelOptions { dropout: 0.1 }).expect("model");
            let mut params: Params<f32> = Params::init(&model, 9);
            for t in params.values.iter_mut() {
                for x in t.data_mut() {
                    *x += rng.random_range(-0.1..0.1);
                }
            }
            let refactorable = !analyze(&model).expect("analyzes").is_empty();
            let gs = graphs_for(name, &mut rng, cfg.vocab as u32);
            let want = reference(&model, &params, &gs);
            let refs: Vec<&InputGraph> = gs.iter().collect();
            let is_dag = name == "dagrnn";
            for refactor in [false, true] {
                if refactor && !refactorable {
                    continue;
                }
                for unroll in [false, true] {
                    for leaf_table in [true, false] {
                        let schedule = CpuCompiledSchedule {
                            leaf_table,
                            recursion: RecursionSchedule::fixed(refactor, unroll),
                        };
                        let what = format!(
                            "{name} h{hidden} refactor {refactor} unroll {unroll} table {leaf_table}"
                        );
                        let mut engine =
                            CpuCompiledEngine::with_schedule(&model, &params, &schedule)
                                .unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_eq!(engine.schedule().recursion, schedule.recursion, "{what}");
                        if unroll && is_dag {
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
                                    "{what} round {round}: score {i} reference {w} vs compiled {g}"
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
fn refactoring_is_exact_on_dag_inputs_and_unrolling_refuses_them() {
    // a child-sum model on grid DAGs: a vertex read by two parents keeps
    // one copy of its moved values, which both read
    let cfg = ModelConfig {
        vocab: 13,
        hidden: 8,
        classes: 3,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let gs: Vec<InputGraph> = [(3, 4), (5, 5)]
        .iter()
        .map(|&(r, c)| grid_dag(&mut rng, r, c, cfg.vocab as u32, 3).expect("grid"))
        .collect();
    let refs: Vec<&InputGraph> = gs.iter().collect();
    for name in ["treelstm", "treegru"] {
        let model = build_model_with(name, &cfg, &ModelOptions { dropout: 0.0 }).expect("model");
        let params: Params<f32> = Params::init(&model, 2);
        let want = reference(&model, &params, &gs);
        let mut engine = CpuCompiledEngine::with_schedule(
            &model,
            &params,
            &CpuCompiledSchedule {
                leaf_table: true,
                recursion: RecursionSchedule::fixed(true, false),
            },
        )
        .expect("compiles");
        let got = engine.infer(&refs).expect("a DAG refactors");
        for (w, g) in want.iter().zip(&got.scores) {
            assert!(
                (w - g).abs() <= 1e-4 * (1.0 + w.abs()),
                "{name}: {w} vs {g}"
            );
        }
        let mut unrolled = CpuCompiledEngine::with_schedule(
            &model,
            &params,
            &CpuCompiledSchedule {
                leaf_table: true,
                recursion: RecursionSchedule::fixed(true, true),
            },
        )
        .expect("compiles");
        let err = unrolled
            .infer(&refs)
            .expect_err("a DAG does not unroll")
            .to_string();
        assert!(
            err.contains("several parents") && err.contains(" vertex "),
            "{name}: {err}"
        );
    }
}

#[test]
fn defaults_refactor_child_sum_models_on_the_cpu_only() {
    let cfg = ModelConfig {
        vocab: 11,
        hidden: 6,
        classes: 3,
    };
    for name in MODELS {
        let model = build_model_with(name, &cfg, &ModelOptions { dropout: 0.0 }).expect("model");
        let resolve = |backend, table| {
            RecursionSchedule::default()
                .resolve(&model, backend, table)
                .expect("resolves")
        };
        let cpu = resolve(ramus_core::recursion::Backend::Cpu, true);
        let cuda = resolve(ramus_core::recursion::Backend::Cuda, true);
        assert_eq!(
            cpu.refactor,
            name == "treelstm" || name == "treegru",
            "{name}"
        );
        assert!(!cpu.unroll && !cuda.refactor && !cuda.unroll, "{name}");
        assert!(!resolve(ramus_core::recursion::Backend::Cpu, false).refactor);
    }
}
