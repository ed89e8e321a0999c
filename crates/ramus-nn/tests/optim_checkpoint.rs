//! Optimizer updates against their formulas, sparse-row updates, clipping,
//! and checkpoint round trips and mismatches.

use ramus_core::{Grads, Params};
use ramus_cpu::CpuEngine;
use ramus_exec::{Batch, Mode};
use ramus_exec::{Optimizer, OptimizerConfig, OptimizerKind};
use ramus_graph::{BatchingPolicy, InputGraph, Vocab};
use ramus_nn::checkpoint;
use ramus_nn::{build_model, ModelConfig};

fn setup() -> (ramus_core::Model, Params<f64>, Grads<f64>) {
    let model = build_model(
        "treefc",
        &ModelConfig {
            vocab: 5,
            hidden: 2,
            classes: 2,
        },
    )
    .unwrap();
    let params = Params::init(&model, 4);
    let mut g = InputGraph::new();
    let a = g.push_vertex(&[], 1, 0).unwrap();
    let b = g.push_vertex(&[], 3, 1).unwrap();
    g.push_vertex(&[a, b], 0, 1).unwrap();
    let batch = Batch::new(&model, vec![&g], BatchingPolicy::Cavs).unwrap();
    let mut engine = CpuEngine::new();
    engine
        .forward(&model, &params, &batch, Mode::Train)
        .unwrap();
    let mut grads = Grads::zeros(&model);
    engine
        .backward(&model, &params, &batch, &mut grads)
        .unwrap();
    (model, params, grads)
}

#[test]
fn sgd_adagrad_adam_follow_their_formulas() {
    let (model, p0, grads) = setup();
    let emb = model.param_id("emb").unwrap();
    // embeddings got row gradients for tokens 1 and 3 only
    assert_eq!(grads.touched_rows[emb].as_deref(), Some(&[1u32, 3][..]));
    for kind in [
        OptimizerKind::Sgd,
        OptimizerKind::Adagrad,
        OptimizerKind::Adam,
    ] {
        let mut p = p0.clone();
        let cfg = OptimizerConfig {
            weight_decay: 0.1,
            ..OptimizerConfig::new(kind, 0.5)
        };
        let mut opt = Optimizer::new(cfg, &p);
        opt.step(&mut p, &grads);
        for (i, (new, old)) in p.values.iter().zip(&p0.values).enumerate() {
            let g = grads.values[i].data();
            let w = grads.row_width(i);
            for (j, (&n, &o)) in new.data().iter().zip(old.data()).enumerate() {
                let touched = match &grads.touched_rows[i] {
                    None => true,
                    Some(rows) => rows.contains(&((j / w) as u32)),
                };
                let want = if !touched {
                    o
                } else {
                    match kind {
                        OptimizerKind::Sgd => o - 0.5 * (g[j] + 0.1 * o),
                        OptimizerKind::Adagrad => {
                            let gg = g[j] + 0.1 * o;
                            o - 0.5 * gg / ((gg * gg).sqrt() + 1e-10)
                        }
                        OptimizerKind::Adam => {
                            let decayed = o - 0.5 * 0.1 * o;
                            let (m, v) = (0.1 * g[j] / 0.1, 0.001 * g[j] * g[j] / 0.001);
                            decayed - 0.5 * m / (v.sqrt() + 1e-8)
                        }
                    }
                };
                assert!(
                    (n - want).abs() < 1e-12,
                    "{kind:?} {}[{j}]: {n} vs {want}",
                    model.params[i].name
                );
            }
        }
    }
}

#[test]
fn clipping_bounds_the_step() {
    let (_, p0, grads) = setup();
    let norm = grads.norm();
    assert!(norm > 0.0);
    let mut p = p0.clone();
    let cfg = OptimizerConfig {
        clip_norm: Some(norm / 4.0),
        ..OptimizerConfig::new(OptimizerKind::Sgd, 1.0)
    };
    let reported = Optimizer::new(cfg, &p)
        .step(&mut p, &grads)
        .expect("norm reported when clipping");
    assert!((reported - norm).abs() < 1e-12);
    let moved: f64 = p
        .values
        .iter()
        .zip(&p0.values)
        .flat_map(|(a, b)| a.data().iter().zip(b.data()).map(|(x, y)| (x - y).powi(2)))
        .sum::<f64>()
        .sqrt();
    assert!(
        (moved - norm / 4.0).abs() < 1e-9,
        "step length {moved} vs {}",
        norm / 4.0
    );
}

#[test]
fn checkpoint_round_trips_and_rejects_mismatches() {
    let cfg = ModelConfig {
        vocab: 6,
        hidden: 3,
        classes: 5,
    };
    let model = build_model("treelstm", &cfg).unwrap();
    let params = Params::<f32>::init(&model, 9);
    let mut vocab = Vocab::new();
    for w in ["a", "b", "c d", "\"quoted\"", "é"] {
        vocab.add(w);
    }
    let dir = std::env::temp_dir().join(format!("ramus-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.safetensors");
    checkpoint::save(&path, &model, &params, &vocab).unwrap();
    let (info, bytes) = checkpoint::read_info(&path).unwrap();
    assert_eq!(info.model, "treelstm");
    assert_eq!(info.vocab, vocab);
    assert_eq!(info.settings.get("hidden").map(String::as_str), Some("3"));
    let back = checkpoint::load_params(&path, &bytes, &model).unwrap();
    assert_eq!(back, params);
    // tensor names are the reference model's
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    assert_eq!(
        names,
        ["U_f", "U_iou", "W_iou", "W_out", "b_f", "b_iou", "b_out", "emb"]
    );
    // a model of another size is refused with the tensor named
    let other = build_model("treelstm", &ModelConfig { hidden: 4, ..cfg }).unwrap();
    let err = checkpoint::load_params(&path, &bytes, &other)
        .unwrap_err()
        .to_string();
    assert!(err.contains("emb") && err.contains("shape"), "{err}");
    // garbage is refused
    std::fs::write(dir.join("bad"), b"not a checkpoint").unwrap();
    assert!(checkpoint::read_info(&dir.join("bad")).is_err());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn inference_needs_no_labels_but_training_does() {
    let (model, params, _) = setup();
    let p32: Params<f32> = params.cast();
    let mut g = InputGraph::new();
    let a = g.push_vertex(&[], 1, -1).unwrap();
    let b = g.push_vertex(&[], 2, -1).unwrap();
    g.push_vertex(&[a, b], 0, -1).unwrap();
    let batch = Batch::new(&model, vec![&g], BatchingPolicy::Cavs).unwrap();
    let mut engine = CpuEngine::new();
    let out = engine.forward(&model, &p32, &batch, Mode::Infer).unwrap();
    assert_eq!(out.predictions().len(), 1);
    let err = engine
        .forward(&model, &p32, &batch, Mode::Train)
        .unwrap_err()
        .to_string();
    assert!(err.contains("without a label"), "{err}");
}
