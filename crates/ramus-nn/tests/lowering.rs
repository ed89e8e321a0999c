//! The Cortex lowering (`ramus_core::lower`) against the CPU reference
//! engine: every token model's vertex functions and head, lowered to cell
//! programs and evaluated vertex by vertex, give the engine's root scores on
//! random trees, deep paths, wide nodes and chains; and so does the
//! compiled CPU engine running those programs level by level.

use ramus_core::lower::{lower, CellProgram, ScalarExpr};
use ramus_core::{HeadRows, Model, Params};
use ramus_cpu::cell_eval::{eval_vertex, VertexInputs};
use ramus_cpu::compiled::CpuCompiledEngine;
use ramus_cpu::CpuEngine;
use ramus_exec::{Batch, Mode};
use ramus_graph::random::{grid_dag, random_chain, random_path, random_tree};
use ramus_graph::{BatchingPolicy, InputGraph};
use ramus_nn::{build_model_with, build_mvrnn, ModelConfig, ModelOptions};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const CFG: ModelConfig = ModelConfig {
    vocab: 11,
    hidden: 6,
    classes: 3,
};

struct Lowered {
    functions: Vec<CellProgram>,
    head: CellProgram,
}

fn lower_model(model: &Model) -> Lowered {
    let functions = model
        .functions
        .iter()
        .map(|f| {
            let outputs = [f.scatter.expect("scatters"), f.push.expect("pushes")];
            lower(&f.forward, &outputs).unwrap_or_else(|e| panic!("{}: {e}", f.name))
        })
        .collect();
    let logits = model.head.logits.expect("logits");
    let head = lower(&model.head.forward, &[logits]).expect("head lowers");
    Lowered { functions, head }
}

/// Root scores of `graph`, vertex by vertex through the cell programs.
fn lowered_scores(
    model: &Model,
    lowered: &Lowered,
    params: &Params<f64>,
    graph: &InputGraph,
) -> Vec<f64> {
    let data: Vec<&[f64]> = params.values.iter().map(|t| t.data()).collect();
    let mut states: Vec<Vec<f64>> = Vec::with_capacity(graph.len());
    let mut pushed: Vec<Vec<f64>> = Vec::with_capacity(graph.len());
    for v in 0..graph.len() {
        let kids = graph.children(v);
        let f = model
            .selector
            .select(graph.kind(v), kids.len())
            .expect("a function for every vertex");
        let children: Vec<&[f64]> = kids
            .iter()
            .map(|&c| states[c as usize].as_slice())
            .collect();
        let inputs = VertexInputs {
            children: &children,
            token: Some(graph.tokens[v]),
            head_input: None,
            token_table: None,
        };
        let mut out = eval_vertex(
            &lowered.functions[f],
            &model.functions[f].forward,
            &data,
            &inputs,
        )
        .expect("vertex evaluates");
        pushed.push(out.pop().expect("push row"));
        states.push(out.pop().expect("state row"));
    }
    let mut scores = Vec::new();
    for root in graph.roots() {
        let inputs = VertexInputs {
            children: &[],
            token: None,
            head_input: Some(&pushed[root as usize]),
            token_table: None,
        };
        let out = eval_vertex(&lowered.head, &model.head.forward, &data, &inputs)
            .expect("head evaluates");
        scores.extend_from_slice(&out[0]);
    }
    scores
}

/// A deep binary tree: each internal vertex joins the previous one and a
/// new leaf (`leaves - 1` levels).
fn caterpillar(rng: &mut ChaCha8Rng, leaves: usize) -> InputGraph {
    let v = CFG.vocab as u32;
    let mut g = InputGraph::new();
    let mut top = g.push_vertex(&[], rng.random_range(0..v), 0).expect("leaf");
    for i in 1..leaves {
        let leaf = g.push_vertex(&[], rng.random_range(0..v), 1).expect("leaf");
        let kids = if i % 2 == 0 { [top, leaf] } else { [leaf, top] };
        top = g
            .push_vertex(&kids, 0, rng.random_range(0..3))
            .expect("internal");
    }
    g
}

fn graphs_for(name: &str, rng: &mut ChaCha8Rng) -> Vec<InputGraph> {
    let v = CFG.vocab as u32;
    if name == "lstm-lm" {
        return [1, 2, 9, 40]
            .iter()
            .map(|&n| random_chain(rng, n, v).expect("chain"))
            .collect();
    }
    if name == "dagrnn" {
        return vec![
            grid_dag(rng, 1, 1, v, 3).expect("one vertex"),
            grid_dag(rng, 3, 4, v, 3).expect("grid"),
            grid_dag(rng, 10, 10, v, 3).expect("grid"),
            random_tree(rng, 20, &[2, 3], v, 3).expect("a tree is a DAG too"),
        ];
    }
    let mut gs = vec![
        random_tree(rng, 1, &[2], v, 3).expect("a single leaf"),
        random_tree(rng, 7, &[2], v, 3).expect("tree"),
        random_tree(rng, 30, &[2], v, 3).expect("tree"),
    ];
    if name == "mvrnn" {
        gs.push(caterpillar(rng, 60));
    }
    if name == "treelstm" || name == "treegru" {
        gs.push(random_path(rng, 120, v, 3).expect("deep path"));
        gs.push(random_tree(rng, 64, &[64], v, 3).expect("a 64-ary node"));
        gs.push(random_tree(rng, 25, &[1, 2, 3, 6], v, 3).expect("mixed arities"));
    }
    gs
}

#[test]
fn lowered_cells_reproduce_the_reference_engine_for_every_token_model() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for name in [
        "treelstm",
        "treelstm-nary",
        "treefc",
        "treegru",
        "mvrnn",
        "dagrnn",
        "lstm-lm",
    ] {
        let model = build_model_with(name, &CFG, &ModelOptions { dropout: 0.25 }).expect("model");
        let params: Params<f64> = Params::init(&model, 5);
        let lowered = lower_model(&model);
        for f in &lowered.functions {
            assert_eq!(f.units, CFG.hidden, "{name}: one unit per hidden column");
        }
        for graph in graphs_for(name, &mut rng) {
            let batch = Batch::new(&model, vec![&graph], BatchingPolicy::Cavs).expect("schedule");
            let want = CpuEngine::<f64>::new()
                .forward_rows(&model, &params, &batch, Mode::Infer, HeadRows::Roots)
                .expect("reference")
                .logits;
            let got = lowered_scores(&model, &lowered, &params, &graph);
            assert_eq!(want.len(), got.len(), "{name}: score count");
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                assert!(
                    (w - g).abs() <= 1e-10 * (1.0 + w.abs()),
                    "{name} ({} vertices) score {i}: engine {w} vs lowered {g}",
                    graph.len()
                );
            }
        }
    }
}

#[test]
fn the_compiled_cpu_engine_matches_the_reference_engine_in_one_batch() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    for hidden in [6, 40] {
        let cfg = ModelConfig { hidden, ..CFG };
        for name in [
            "treelstm",
            "treelstm-nary",
            "treefc",
            "treegru",
            "mvrnn",
            "dagrnn",
            "lstm-lm",
        ] {
            let model =
                build_model_with(name, &cfg, &ModelOptions { dropout: 0.25 }).expect("model");
            let params: Params<f32> = Params::init(&model, 9);
            let graphs = graphs_for(name, &mut rng);
            let mut want = Vec::new();
            for g in &graphs {
                let batch = Batch::new(&model, vec![g], BatchingPolicy::Cavs).expect("schedule");
                want.extend(
                    CpuEngine::<f32>::new()
                        .forward_rows(&model, &params, &batch, Mode::Infer, HeadRows::Roots)
                        .expect("reference")
                        .logits,
                );
            }
            let refs: Vec<&InputGraph> = graphs.iter().collect();
            for table in [true, false] {
                let mut engine = CpuCompiledEngine::new(&model, &params, table).expect("compiles");
                for round in 0..2 {
                    let got = engine.infer(&refs).expect("infers");
                    assert_eq!(got.scores.len(), want.len(), "{name}: score count");
                    for (i, (w, g)) in want.iter().zip(&got.scores).enumerate() {
                        assert!(
                            (w - g).abs() <= 1e-4 * (1.0 + w.abs()),
                            "{name} h{hidden} table {table} round {round}: score {i} engine {w} vs compiled {g}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_compiled_cpu_engine_refuses_unknown_tokens_naming_the_vertex() {
    let model = build_model_with("treelstm", &CFG, &ModelOptions { dropout: 0.0 }).expect("model");
    let params: Params<f32> = Params::init(&model, 1);
    let mut engine = CpuCompiledEngine::new(&model, &params, true).expect("compiles");
    let mut g = InputGraph::new();
    let a = g.push_vertex(&[], 3, 0).expect("leaf");
    let b = g.push_vertex(&[], CFG.vocab as u32, 0).expect("leaf");
    g.push_vertex(&[a, b], 0, 1).expect("root");
    let text = engine
        .infer(&[&g])
        .expect_err("token out of range")
        .to_string();
    assert!(
        text.contains("graph 0 vertex 1") && text.contains("token 11"),
        "{text}"
    );
}

#[test]
fn hoisted_token_values_give_the_same_cells() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut hoisted_any = Vec::new();
    for name in [
        "treelstm",
        "treelstm-nary",
        "treefc",
        "treegru",
        "mvrnn",
        "dagrnn",
        "lstm-lm",
    ] {
        let model = build_model_with(name, &CFG, &ModelOptions { dropout: 0.0 }).expect("model");
        let params: Params<f64> = Params::init(&model, 4);
        let data: Vec<&[f64]> = params.values.iter().map(|t| t.data()).collect();
        for f in &model.functions {
            let g = &f.forward;
            let program =
                lower(g, &[f.scatter.expect("scatter"), f.push.expect("push")]).expect("lowers");
            let Some(h) = program.hoist_token_values() else {
                continue;
            };
            hoisted_any.push(name);
            assert!(
                h.program.scalars.len() < program.scalars.len(),
                "{name}: hoisting removed no per-vertex work"
            );
            // random children, every token
            let kids: Vec<Vec<f64>> = (0..3)
                .map(|_| {
                    (0..model.state_width)
                        .map(|_| rng.random_range(-1.0..1.0))
                        .collect()
                })
                .collect();
            let kid_rows: Vec<&[f64]> = kids.iter().map(Vec::as_slice).collect();
            let children = if g.input_node(ramus_core::graph::Source::GatherAll).is_some()
                || g.input_node(ramus_core::graph::Source::Gather(0)).is_some()
            {
                &kid_rows[..2]
            } else {
                &kid_rows[..0]
            };
            for token in 0..CFG.vocab as u32 {
                let plain = VertexInputs {
                    children,
                    token: Some(token),
                    head_input: None,
                    token_table: None,
                };
                let want = eval_vertex(&program, g, &data, &plain).expect("plain");
                let row = eval_vertex(
                    &h.table,
                    g,
                    &data,
                    &VertexInputs {
                        children: &[],
                        ..plain
                    },
                )
                .expect("table row")
                .pop()
                .expect("one output");
                assert_eq!(row.len(), h.width);
                let got = eval_vertex(
                    &h.program,
                    g,
                    &data,
                    &VertexInputs {
                        token_table: Some(&row),
                        ..plain
                    },
                )
                .expect("hoisted");
                for (w, x) in want.iter().flatten().zip(got.iter().flatten()) {
                    assert!(
                        (w - x).abs() < 1e-12,
                        "{name} `{}` token {token}: {w} vs {x}",
                        f.name
                    );
                }
            }
        }
    }
    // the models with a word at every vertex: an input projection to hoist
    for name in ["dagrnn", "lstm-lm"] {
        assert!(hoisted_any.contains(&name), "{name}: nothing hoisted");
    }
}

#[test]
fn the_treegru_cell_lowers_to_two_stages() {
    let model = build_model_with("treegru", &CFG, &ModelOptions { dropout: 0.0 }).expect("model");
    let internal = &model.functions[1];
    let program = lower(
        &internal.forward,
        &[internal.scatter.unwrap(), internal.push.unwrap()],
    )
    .expect("lowers");
    // U_h reads the reset-gated child sum of every unit: stored in stage 0,
    // read back in stage 1; the stage-0 values the blend `z ⊙ h̃ + (1 − z) ⊙ ĥ`
    // reads (z ⊙ h̃ and 1 − z) are carried through the scratch row too
    assert_eq!(program.stages, 2);
    assert_eq!(program.scratch_width, 3 * CFG.hidden);
    assert_eq!(program.stores[0].len(), 3);
    assert!(program.stores[1].is_empty());
    // no stage reads another stage's registers
    for s in &program.scalars {
        for d in ramus_core::lower::scalar_deps(&s.expr) {
            assert_eq!(
                program.scalars[d].stage, s.stage,
                "{s:?} reads {d} across stages"
            );
        }
    }
}

#[test]
fn the_mvrnn_cell_lowers_to_row_and_column_products() {
    let n = CFG.hidden;
    // four word matrices for eleven words: tokens 4.. share the unknown word's
    let model = build_mvrnn(&CFG, 4, &ModelOptions { dropout: 0.0 }).expect("model");
    let internal = &model.functions[1];
    let program = lower(
        &internal.forward,
        &[internal.scatter.unwrap(), internal.push.unwrap()],
    )
    .expect("lowers");
    assert_eq!(
        program.units, n,
        "one unit per column of p and of each row of P"
    );
    let count = |f: fn(&ScalarExpr) -> bool| program.scalars.iter().filter(|s| f(&s.expr)).count();
    // B a and A b: one lane each; W_M [A; B]: one lane per row of P
    assert_eq!(count(|e| matches!(e, ScalarExpr::RowDot { .. })), 2);
    assert_eq!(count(|e| matches!(e, ScalarExpr::ColumnDot { .. })), n);
    // W [B a; A b] reads every unit's row products: a second stage
    assert_eq!(program.stages, 2);
    assert_eq!(program.scratch_width, 2 * n);
    assert_eq!(program.output_width(0), n + n * n);
    // the reference evaluator and the compiled CPU engine agree with the
    // batched engine, shared word matrices included
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let graphs = vec![
        random_tree(&mut rng, 1, &[2], CFG.vocab as u32, 3).expect("a single leaf"),
        caterpillar(&mut rng, 40),
        random_tree(&mut rng, 25, &[2], CFG.vocab as u32, 3).expect("tree"),
    ];
    let params: Params<f64> = Params::init(&model, 2);
    let lowered = lower_model(&model);
    let params32: Params<f32> = Params::init(&model, 2);
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let mut want32 = Vec::new();
    for graph in &graphs {
        assert!(graph.tokens.iter().any(|&t| t >= 4) || graph.len() == 1);
        let batch = Batch::new(&model, vec![graph], BatchingPolicy::Cavs).expect("schedule");
        let want = CpuEngine::<f64>::new()
            .forward_rows(&model, &params, &batch, Mode::Infer, HeadRows::Roots)
            .expect("reference")
            .logits;
        let got = lowered_scores(&model, &lowered, &params, graph);
        for (w, g) in want.iter().zip(&got) {
            assert!(
                (w - g).abs() <= 1e-10 * (1.0 + w.abs()),
                "engine {w} vs lowered {g}"
            );
        }
        want32.extend(
            CpuEngine::<f32>::new()
                .forward_rows(&model, &params32, &batch, Mode::Infer, HeadRows::Roots)
                .expect("reference")
                .logits,
        );
    }
    for table in [true, false] {
        let mut engine = CpuCompiledEngine::new(&model, &params32, table).expect("compiles");
        let got = engine.infer(&refs).expect("infers");
        assert_eq!(got.scores.len(), want32.len());
        for (w, g) in want32.iter().zip(&got.scores) {
            assert!(
                (w - g).abs() <= 1e-4 * (1.0 + w.abs()),
                "table {table}: engine {w} vs compiled {g}"
            );
        }
    }
}
