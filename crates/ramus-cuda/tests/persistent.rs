//! The persistent training kernel (VPPS) on the device, instruction by
//! instruction: weight matrices distributed over the register partitions of
//! every CTA (several `rpw` and CTAs-per-SM choices, widths that are not
//! multiples of 32, a matrix of fewer rows than a partition), scripts with
//! signal/wait barriers between dependent levels, and the optimizer update
//! written back to the master copy — all against the same arithmetic on the
//! host; then whole models trained by the persistent engine against the
//! CPU engine's trajectory. Skips with a notice where no CUDA driver is found.

mod common;

use ramus_codegen::persistent::{KernelOptions, UpdateRule};
use ramus_core::vpps::isa::{
    NO_INDEX, OP_MATVEC, OP_MATVEC_T, OP_OUTER, OP_UPDATE, PRODUCT_ITEM_WORDS,
};
use ramus_core::vpps::regplan::{plan, DeviceLimits, MatrixSpec, PlanRequest};
use ramus_core::vpps::{Placement, Scheduler, VppTask, VppTaskGraph};
use ramus_core::{Model, Params};
use ramus_cuda::persistent::{
    MatrixSlots, PersistentEngine, PersistentKernel, PersistentOptions, PersistentTrainer,
    UpdateScalars,
};
use ramus_cuda::{
    default_cache_dir, CudaDevice, DevicePool, KernelCache, PinnedBuffer, PoolConfig,
};
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::random::{grid_dag, random_chain, random_path, random_tree};
use ramus_graph::sequence::{pyramid, tagger_graph, WordInput};
use ramus_graph::InputGraph;
use ramus_nn::sequence_models::{build_sequence_model, SequenceConfig};
use ramus_nn::{build_model_with, ModelConfig, ModelOptions, Trainer};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Host copies of one cached matrix's test vectors and where they live.
struct Case {
    rows: usize,
    cols: usize,
    w: Vec<f32>,
    xs: Vec<Vec<f32>>,
    /// Pool offsets: inputs, products, transposed products.
    x_at: Vec<usize>,
    y_at: Vec<usize>,
    dx_at: Vec<usize>,
    /// A bias the first product adds in its epilogue.
    bias: Vec<f32>,
    bias_at: usize,
}

fn close(got: f32, want: f64, what: &str) {
    let tol = 1e-4 * (1.0 + want.abs());
    assert!(
        (f64::from(got) - want).abs() <= tol,
        "{what}: got {got}, want {want}"
    );
}

#[test]
fn register_cached_products_gradients_and_updates_match_the_host() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let device = CudaDevice::open(0).expect("device");
    let pool = DevicePool::new(&device, PoolConfig::default());
    let cache = KernelCache::for_device(&device, default_cache_dir()).expect("cache");
    let limits = DeviceLimits::hopper(device.sm_count() as usize);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    // 200 columns: a partial last register chunk; 5 rows: fewer than a partition
    let shapes = [(300, 200), (64, 256), (5, 256)];
    // (rpw, CTAs per SM, rule, vectors per matrix, items from which a
    // product runs as a tiled GEMM): the register path, then the GEMM path
    // with one tile, and with several tiles and a split outer reduction.
    // (rpw 3 with gradients at 2 CTAs per SM spills since the kernel has
    // the GEMM path: the build refuses it, the engine falls back)
    for (rpw, ctas_per_sm, rule, vectors, wide_items) in [
        (1, 2, UpdateRule::Sgd, 3, u32::MAX),
        (2, 1, UpdateRule::Adam, 3, u32::MAX),
        (3, 1, UpdateRule::Sgd, 3, u32::MAX),
        (1, 2, UpdateRule::Sgd, 3, 1),
        (2, 1, UpdateRule::Adam, 300, 32),
    ] {
        let matrices: Vec<MatrixSpec> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(rows, cols))| MatrixSpec {
                param: i,
                rows,
                cols,
            })
            .collect();
        let req = PlanRequest {
            rpw,
            ctas_per_sm: Some(ctas_per_sm),
            grads_in_registers: Some(true),
        };
        let rp = plan(&matrices, &limits, &req).expect("plan");
        // parameters: values, two moment buffers and a gradient per matrix
        let mut params_host = Vec::new();
        let mut slots = Vec::new();
        let mut cases = Vec::new();
        // parameters first, then the test vectors: one pool for everything
        let mut pool_len: usize = shapes.iter().map(|&(r, c)| 4 * r * c).sum();
        let mut alloc = |n: usize| {
            let at = pool_len;
            pool_len += n;
            at
        };
        for &(rows, cols) in &shapes {
            let w: Vec<f32> = (0..rows * cols)
                .map(|_| rng.random_range(-0.5..0.5))
                .collect();
            let value = params_host.len();
            params_host.extend_from_slice(&w);
            let first_moment = params_host.len();
            params_host.extend(std::iter::repeat_n(0.0, rows * cols));
            let second_moment = params_host.len();
            params_host.extend(std::iter::repeat_n(0.0, rows * cols));
            let gradient = params_host.len();
            params_host.extend(std::iter::repeat_n(0.0, rows * cols));
            slots.push(MatrixSlots {
                value,
                first_moment,
                second_moment,
                gradient,
            });
            let xs: Vec<Vec<f32>> = (0..vectors)
                .map(|_| (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect())
                .collect();
            let x_at = (0..vectors).map(|_| alloc(cols)).collect();
            let y_at = (0..vectors).map(|_| alloc(rows)).collect();
            let dx_at = (0..vectors).map(|_| alloc(cols)).collect();
            let bias: Vec<f32> = (0..rows).map(|_| rng.random_range(-1.0..1.0)).collect();
            let bias_at = alloc(rows);
            cases.push(Case {
                rows,
                cols,
                w,
                xs,
                x_at,
                y_at,
                dx_at,
                bias,
                bias_at,
            });
        }
        // level 0: y = W x; level 1: dx = Wᵀ y and G += y xᵀ; level 2: update
        let mut g = VppTaskGraph::default();
        let mut outers = Vec::new();
        for (m, c) in cases.iter().enumerate() {
            let holders = Placement::Holders { matrix: m as u16 };
            for v in 0..c.xs.len() {
                let (x, y, dx) = (c.x_at[v] as u32, c.y_at[v] as u32, c.dx_at[v] as u32);
                let load = (c.rows * c.cols) as u64;
                let mv = g
                    .push(VppTask {
                        op: OP_MATVEC,
                        arg: m as u16,
                        // the first vector's product adds a bias
                        operands: vec![x, y, if v == 0 { c.bias_at as u32 } else { NO_INDEX }],
                        deps: vec![],
                        load,
                        placement: holders,
                    })
                    .expect("task");
                g.push(VppTask {
                    op: OP_MATVEC_T,
                    arg: m as u16,
                    operands: vec![y, dx, NO_INDEX],
                    deps: vec![mv],
                    load,
                    placement: holders,
                })
                .expect("task");
                outers.push(
                    g.push(VppTask {
                        op: OP_OUTER,
                        arg: m as u16,
                        operands: vec![y, x, NO_INDEX],
                        deps: vec![mv],
                        load,
                        placement: holders,
                    })
                    .expect("task"),
                );
            }
        }
        g.push(VppTask {
            op: OP_UPDATE,
            arg: 0,
            operands: vec![],
            deps: outers,
            load: 1,
            placement: Placement::Every,
        })
        .expect("task");
        let mut scheduler = Scheduler::new(&rp);
        scheduler.holder_item = PRODUCT_ITEM_WORDS;
        scheduler.wide_items = (wide_items != u32::MAX).then_some(wide_items as usize);
        let schedule = scheduler.schedule(&g).expect("schedule");
        assert_eq!(schedule.levels, 3, "three dependent levels");

        // the vector epilogue, where it spills the scalar one (as the
        // engine builds its variants)
        let build = |vector_epilogue| {
            let options = KernelOptions {
                vector_epilogue,
                ..rule.into()
            };
            PersistentKernel::build(&device, &cache, &pool, rp.clone(), options, "", &slots)
        };
        let kernel = build(true)
            .or_else(|_| build(false))
            .expect("kernel builds without spilling");
        let stream = device.stream().clone();
        let mut staging = PinnedBuffer::new(&device).expect("staging");
        let mut pool_host = vec![0f32; pool_len];
        pool_host[..params_host.len()].copy_from_slice(&params_host);
        for c in &cases {
            for (x, &at) in c.xs.iter().zip(&c.x_at) {
                pool_host[at..at + c.cols].copy_from_slice(x);
            }
            pool_host[c.bias_at..c.bias_at + c.rows].copy_from_slice(&c.bias);
        }
        let pool_buf = pool.alloc::<f32>(pool_len).expect("pool");
        let packed = &schedule.packed;
        let script_buf = pool.alloc::<u32>(packed.words.len()).expect("script");
        let barrier_buf = pool.alloc::<u32>(packed.barriers.max(1)).expect("barriers");
        let view = |n: usize, b: &ramus_cuda::PoolBuffer<f32>| b.view().slice(0..n).expect("view");
        let pool_view = view(pool_len, &pool_buf);
        let script_view = script_buf
            .view()
            .slice(0..packed.words.len())
            .expect("view");
        staging
            .upload_slice(&pool_host, pool_view, &stream)
            .expect("upload");
        staging
            .upload_slice(&packed.words, script_view, &stream)
            .expect("upload");
        let (lr, wd, b1, b2, eps) = (0.05f32, 0.01f32, 0.9f32, 0.999f32, 1e-8f32);
        let scalars = UpdateScalars {
            lr,
            weight_decay: wd,
            beta1: b1,
            beta2: b2,
            eps,
            inv_bias_correction1: 1.0 / (1.0 - b1),
            inv_bias_correction2: 1.0 / (1.0 - b2),
            clip: 1.0,
            fault_at: u32::MAX,
        };
        kernel
            .launch(
                pool_view,
                script_view,
                packed,
                barrier_buf.view(),
                &scalars,
                false,
            )
            .expect("launch");
        let pool_out = staging
            .download_to_vec(pool_view, &stream)
            .expect("download");

        let label = format!(
            "rpw {rpw}, {ctas_per_sm} CTAs/SM, {rule:?}, {vectors} vectors, GEMM from {wide_items}"
        );
        for (m, c) in cases.iter().enumerate() {
            let mut grad = vec![0f64; c.rows * c.cols];
            for v in 0..c.xs.len() {
                let x = &c.xs[v];
                let y: Vec<f64> = (0..c.rows)
                    .map(|r| {
                        let dot: f64 = (0..c.cols)
                            .map(|k| f64::from(c.w[r * c.cols + k]) * f64::from(x[k]))
                            .sum();
                        dot + if v == 0 { f64::from(c.bias[r]) } else { 0.0 }
                    })
                    .collect();
                for r in 0..c.rows {
                    close(
                        pool_out[c.y_at[v] + r],
                        y[r],
                        &format!("{label}: W{m} x{v} row {r}"),
                    );
                }
                for k in 0..c.cols {
                    let dx: f64 = (0..c.rows)
                        .map(|r| f64::from(c.w[r * c.cols + k]) * y[r])
                        .sum();
                    close(
                        pool_out[c.dx_at[v] + k],
                        dx,
                        &format!("{label}: W{m}ᵀ y{v} col {k}"),
                    );
                }
                for r in 0..c.rows {
                    for k in 0..c.cols {
                        grad[r * c.cols + k] += y[r] * f64::from(x[k]);
                    }
                }
            }
            let s = slots[m];
            for (i, &g) in grad.iter().enumerate() {
                let w = f64::from(c.w[i]);
                let (lr, wd) = (f64::from(lr), f64::from(wd));
                let want = match rule {
                    UpdateRule::Sgd => w - lr * (g + wd * w),
                    UpdateRule::Adam => {
                        // first step from zero moments: m̂ = g, v̂ = g²
                        let decayed = w - lr * wd * w;
                        decayed - lr * g / (g.abs() + f64::from(eps))
                    }
                    UpdateRule::Adagrad => unreachable!("not in this test"),
                };
                let got = pool_out[s.value + i];
                let what = format!("{label}: updated W{m}[{i}]");
                if rule == UpdateRule::Adam && g.abs() < 1e-4 {
                    // Adam's first step is lr · g / (|g| + eps): for a
                    // gradient near zero (a sum that cancels) its value
                    // follows the rounding of g; only the step's bound holds
                    let step = (f64::from(got) - (w - lr * wd * w)).abs();
                    assert!(step <= lr * (1.0 + 1e-4), "{what}: step {step} beyond lr");
                } else {
                    close(got, want, &what);
                }
            }
        }
    }
}

/// Random graphs for `model`: chains for the language model, grid DAGs for
/// the DAG-RNN, trees (with a single vertex and a deep path) otherwise.
fn model_graphs(model: &str, count: usize, seed: u64) -> Vec<InputGraph> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (v, c) = (40, 5);
    (0..count)
        .map(|i| {
            let leaves = 1 + rng.random_range(0..12);
            let g = match model {
                "lstm-lm" => random_chain(&mut rng, 1 + (i * 7) % 23, v),
                "dagrnn" => grid_dag(&mut rng, 1 + i % 7, 1 + (i * 3) % 10, v, c),
                "treelstm" | "treegru" if i % 5 == 3 => random_path(&mut rng, 60, v, c),
                "treelstm" | "treegru" => random_tree(&mut rng, leaves, &[1, 2, 3, 6], v, c),
                _ if i % 5 == 3 => random_tree(&mut rng, 40, &[2], v, c),
                _ => random_tree(&mut rng, leaves, &[2], v, c),
            };
            g.expect("valid random graph")
        })
        .collect()
}

fn close_all(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 2e-4 * scale,
            "{what}[{i}]: CPU {x} vs persistent {y} (scale {scale})"
        );
    }
}

/// Several training steps of the persistent engine against the CPU engine
/// with the host optimizer: the same loss at every step, the same
/// parameters after the last.
fn follows_the_cpu_trajectory(
    name: &str,
    config: OptimizerConfig,
    batch: usize,
    grads_in_registers: Option<bool>,
) {
    let options = PersistentOptions {
        grads_in_registers,
        ..PersistentOptions::default()
    };
    follows_the_cpu_with(name, config, batch, options);
}

/// [`follows_the_cpu_trajectory`] with `options` (a test cache directory
/// added).
fn follows_the_cpu_with(
    name: &str,
    config: OptimizerConfig,
    batch: usize,
    options: PersistentOptions,
) {
    follows_the_cpu_at(name, 24, config, batch, options);
}

/// [`follows_the_cpu_with`] for the model with `hidden` units.
fn follows_the_cpu_at(
    name: &str,
    hidden: usize,
    config: OptimizerConfig,
    batch: usize,
    options: PersistentOptions,
) {
    if !common::cuda_ready("skipping") {
        return;
    }
    let cfg = ModelConfig {
        vocab: 40,
        hidden,
        classes: 5,
    };
    let model = build_model_with(name, &cfg, &ModelOptions { dropout: 0.0 }).expect("model");
    let data = model_graphs(name, 4 * batch, 8);
    let options = PersistentOptions {
        cache_dir: Some(
            std::env::temp_dir().join(format!("ramus-persistent-{}", std::process::id())),
        ),
        ..options
    };
    compare_steps(name, &model, config, &data, batch, &options);
}

/// A Tree-LSTM of `hidden` units over 40 words and 5 classes, without
/// dropout, and its initial parameters.
fn small_treelstm(hidden: usize) -> (Model, Params<f32>) {
    let cfg = ModelConfig {
        vocab: 40,
        hidden,
        classes: 5,
    };
    let model = build_model_with("treelstm", &cfg, &ModelOptions { dropout: 0.0 }).expect("model");
    let params = Params::init(&model, 5);
    (model, params)
}

/// An empty kernel cache directory of this process, named for `test`.
fn fresh_cache_dir(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ramus-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Trains `model` on `data` in batches of `batch` with the CPU engine and
/// the persistent engine (`options`): the same loss at every step, the same
/// parameters after the last.
fn compare_steps(
    name: &str,
    model: &Model,
    config: OptimizerConfig,
    data: &[InputGraph],
    batch: usize,
    options: &PersistentOptions,
) {
    let params: Params<f32> = Params::init(model, 5);
    let mut cpu = Trainer::new(model.clone(), params.clone(), config);
    // the kernels proper (a bridge kernel trains only where a test asks)
    let options = PersistentOptions {
        bridge: options.bridge.or(Some(false)),
        ..options.clone()
    };
    let mut gpu = PersistentEngine::new(model, &params, config, &options)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    if let Some(want) = options.grads_in_registers {
        assert_eq!(gpu.register_plan().grads_in_registers, want);
    }
    for (step, chunk) in data.chunks(batch).enumerate() {
        let refs: Vec<&InputGraph> = chunk.iter().collect();
        let a = cpu.train_batch(&refs).expect("cpu step");
        let b = gpu.train_batch(model, &refs).expect("persistent step").loss;
        assert!(
            (a - b).abs() <= 1e-3 * a.abs().max(1.0),
            "{name} step {step}: loss CPU {a} vs persistent {b}"
        );
    }
    let trained = gpu.params(model).expect("parameters come back");
    let cpu_params = cpu.state().expect("cpu state").params;
    for (p, spec) in model.params.iter().enumerate() {
        close_all(
            cpu_params.values[p].data(),
            trained.values[p].data(),
            &format!("{name}: updated {}", spec.name),
        );
    }
}

#[test]
fn persistent_training_follows_the_cpu_for_every_token_model() {
    for name in [
        "treelstm",
        "treefc",
        "treelstm-nary",
        "treegru",
        "dagrnn",
        "lstm-lm",
    ] {
        follows_the_cpu_trajectory(name, OptimizerConfig::new(OptimizerKind::Sgd, 0.1), 6, None);
    }
}

/// Products as tiled GEMMs over the holders (wide levels): every product
/// of every model that way, then a Tree-LSTM whose batches have levels
/// both wider and narrower than the default threshold, with Adam.
#[test]
fn persistent_training_with_wide_products_follows_the_cpu() {
    let every_product = PersistentOptions {
        wide_items: Some(1),
        ..PersistentOptions::default()
    };
    for name in ["treelstm", "treegru", "treelstm-nary", "dagrnn", "lstm-lm"] {
        let sgd = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
        follows_the_cpu_with(name, sgd, 6, every_product.clone());
    }
    let mut adam = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    adam.weight_decay = 1e-3;
    follows_the_cpu_with("treelstm", adam, 40, PersistentOptions::default());
}

/// Levels' products as cuBLAS GEMMs between launches (host work): with
/// register gradients (handed to the pool between launches, beside wide
/// outer products adding into it) and without, every model with SGD, and
/// the Tree-LSTM with Adam.
#[test]
fn persistent_training_with_host_products_follows_the_cpu() {
    for (host_items, wide_items, in_registers) in
        [(8, None, true), (8, None, false), (16, Some(4), true)]
    {
        let options = PersistentOptions {
            host_items: Some(host_items),
            wide_items,
            grads_in_registers: Some(in_registers),
            ..PersistentOptions::default()
        };
        for name in ["treelstm", "treegru", "treelstm-nary", "dagrnn", "lstm-lm"] {
            let sgd = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
            follows_the_cpu_with(name, sgd, 12, options.clone());
        }
    }
    let mut adam = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    adam.weight_decay = 1e-3;
    let options = PersistentOptions {
        host_items: Some(8),
        ..PersistentOptions::default()
    };
    follows_the_cpu_with("treelstm", adam, 16, options);
}

/// One CTA per SM, where row copies and child sums load several elements
/// per thread before storing them: levels wide enough that instructions
/// cover more than one element per thread (hidden 64, 64 graphs a batch),
/// with instructions that end inside a thread's elements. A first version
/// left the elements past the end unmarked and stored garbage there.
#[test]
fn row_copies_loading_ahead_follow_the_cpu() {
    let one_cta = PersistentOptions {
        ctas_per_sm: Some(1),
        ..PersistentOptions::default()
    };
    for name in ["treelstm", "treegru", "treelstm-nary", "dagrnn", "lstm-lm"] {
        let sgd = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
        follows_the_cpu_at(name, 64, sgd, 64, one_cta.clone());
    }
}

/// Rows of 16 registers (hidden 512) at two CTAs per SM with the gradients
/// through cuBLAS, the Tree-LSTM's choice at h 512: held-row products load
/// one vector at a time there (the only plans where they do).
#[test]
fn wide_rows_at_two_ctas_per_sm_follow_the_cpu() {
    let two_ctas = PersistentOptions {
        ctas_per_sm: Some(2),
        grads_in_registers: Some(false),
        rpw: Some(2),
        ..PersistentOptions::default()
    };
    for name in ["treelstm", "treegru"] {
        let sgd = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
        follows_the_cpu_at(name, 512, sgd, 4, two_ctas.clone());
    }
}

/// Gradients not in registers (VPPS §III-C2): the outer products go to
/// cuBLAS after the kernel, a second launch updates the matrices.
#[test]
fn persistent_training_with_cublas_gradients_follows_the_cpu() {
    follows_the_cpu_trajectory(
        "treelstm",
        OptimizerConfig::new(OptimizerKind::Sgd, 0.1),
        6,
        Some(false),
    );
    let mut adam = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    adam.weight_decay = 1e-3;
    follows_the_cpu_trajectory("treegru", adam, 4, Some(false));
}

#[test]
fn persistent_adam_and_adagrad_follow_the_cpu() {
    let mut adam = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    adam.weight_decay = 1e-3;
    follows_the_cpu_trajectory("treelstm", adam, 5, None);
    follows_the_cpu_trajectory(
        "treelstm",
        OptimizerConfig::new(OptimizerKind::Adagrad, 0.05),
        1,
        None,
    );
}

/// Whole epochs through the trainer: the persistent engine (overlapped
/// steps, each loss a batch late) reaches the CPU engine's epoch losses,
/// parameters and evaluation, and its loss falls.
#[test]
fn the_trainer_runs_epochs_on_the_persistent_engine() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let (model, params) = small_treelstm(24);
    let data = model_graphs("treelstm", 60, 9);
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    let mut cpu = Trainer::new(model.clone(), params.clone(), config);
    // a cold cache: the first windows train on a bridge kernel, a batch at
    // a time, until the kernel proper takes over
    let dir = fresh_cache_dir("trainer");
    let options = PersistentOptions {
        cache_dir: Some(dir.clone()),
        bridge: Some(true),
        ..PersistentOptions::default()
    };
    let engine = PersistentTrainer::new(&model, &params, config, &options).expect("engine");
    let mut gpu = Trainer::with_engine(Box::new(engine));
    let mut losses = Vec::new();
    for epoch in 0..4u64 {
        let mut r1 = ramus_nn::train::rng(epoch);
        let mut r2 = ramus_nn::train::rng(epoch);
        let a = cpu
            .train_epoch(&data, 8, &mut r1, |_, _, _| {})
            .expect("cpu epoch");
        let b = gpu
            .train_epoch(&data, 8, &mut r2, |_, _, _| {})
            .expect("persistent epoch");
        assert!(
            (a - b).abs() <= 1e-3 * a.abs().max(1.0),
            "epoch {epoch}: CPU {a} vs persistent {b}"
        );
        losses.push(b);
    }
    assert!(losses[3] < losses[0], "the loss falls: {losses:?}");
    let cpu_params = cpu.state().expect("cpu state").params;
    let gpu_params = gpu.state().expect("persistent state").params;
    for (p, spec) in model.params.iter().enumerate() {
        close_all(
            cpu_params.values[p].data(),
            gpu_params.values[p].data(),
            &format!("trainer: {}", spec.name),
        );
    }
    let (x, y) = (
        cpu.evaluate(&data, 16).expect("cpu eval"),
        gpu.evaluate(&data, 16).expect("persistent eval"),
    );
    assert!(
        (x.loss - y.loss).abs() <= 1e-3 * x.loss.abs().max(1.0),
        "eval {} vs {}",
        x.loss,
        y.loss
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// On a cold cache the first batches train on a bridge kernel (the kernel
/// compiled quickly) while the kernels proper compile: its steps follow the
/// CPU as theirs do, and the kernel proper takes over where the bridge left
/// the weights. (Run with `CUDA_CACHE_DISABLE=1`: NVRTC's own cache can
/// have the kernel proper ready before the first batch.)
#[test]
fn a_bridge_kernel_trains_until_the_kernel_proper_takes_over() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let (model, params) = small_treelstm(24);
    let data = model_graphs("treelstm", 48, 12);
    let dir = fresh_cache_dir("bridge");
    let options = PersistentOptions {
        cache_dir: Some(dir.clone()),
        bridge: Some(true),
        ..PersistentOptions::default()
    };
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.01);
    let mut cpu = Trainer::new(model.clone(), params.clone(), config);
    let mut gpu = PersistentEngine::new(&model, &params, config, &options).expect("engine");
    assert!(
        gpu.kernel_report().bridge,
        "a cold cache starts on a bridge kernel"
    );
    assert_eq!(gpu.kernel_ready_seconds(), None);
    assert!(gpu.tuning(), "the kernel is still being chosen");
    let mut on_bridge = Vec::new();
    for (step, chunk) in data.chunks(6).enumerate() {
        if step == 4 {
            gpu.wait_for_kernel().expect("the kernel proper builds");
            assert!(!gpu.kernel_report().bridge);
            assert!(gpu.kernel_ready_seconds().is_some());
        }
        let refs: Vec<&InputGraph> = chunk.iter().collect();
        let a = cpu.train_batch(&refs).expect("cpu step");
        let b = gpu
            .train_batch(&model, &refs)
            .expect("persistent step")
            .loss;
        on_bridge.push(gpu.kernel_report().bridge);
        assert!(
            (a - b).abs() <= 1e-3 * a.abs().max(1.0),
            "step {step} (bridge: {}): loss CPU {a} vs persistent {b}",
            gpu.kernel_report().bridge
        );
    }
    if !on_bridge[0] {
        println!(
            "notice: the kernel proper was ready at the first batch (NVRTC's own cache?), \
             so no step ran on the bridge; run with CUDA_CACHE_DISABLE=1"
        );
    }
    assert!(!on_bridge[4..].iter().any(|&b| b), "{on_bridge:?}");
    assert!(
        !gpu.compiled_rpws().is_empty(),
        "the search's candidates are no bridges"
    );
    let trained = gpu.params(&model).expect("parameters come back");
    let cpu_params = cpu.state().expect("cpu state").params;
    for (p, spec) in model.params.iter().enumerate() {
        close_all(
            cpu_params.values[p].data(),
            trained.values[p].data(),
            &format!("bridge: updated {}", spec.name),
        );
    }
    println!("bridge steps: {on_bridge:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The profile-guided `rpw` search: valid variants are compiled and timed
/// on the first batches, the best is kept and remembered in the kernel
/// cache, so a second engine starts with it (no search, kernel cached).
#[test]
fn the_rpw_search_settles_and_is_remembered() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let (model, params) = small_treelstm(64);
    let data = model_graphs("treelstm", 8, 4);
    let refs: Vec<&InputGraph> = data.iter().collect();
    let dir = fresh_cache_dir("rpw");
    let options = PersistentOptions {
        cache_dir: Some(dir.clone()),
        ..PersistentOptions::default()
    };
    let config = OptimizerConfig::new(OptimizerKind::Sgd, 0.01);
    let mut first = PersistentEngine::new(&model, &params, config, &options).expect("engine");
    assert!(first.tuning(), "a fresh cache starts a search");
    // on a bridge kernel first (the default), while the candidates compile
    let started = std::time::Instant::now();
    let mut batches = 0;
    while first.tuning() && started.elapsed().as_secs() < 120 {
        first.submit(&model, &refs).expect("step");
        batches += 1;
    }
    first.latest().expect("last step");
    assert!(
        !first.tuning(),
        "the search settles within {batches} batches"
    );
    let tried = first.compiled_rpws();
    let chosen = first.register_plan().rpw;
    assert!(
        tried.contains(&chosen) && tried[0] == 1,
        "tried {tried:?}, chose {chosen}"
    );
    // two CTAs per SM with register gradients fit at h 64, so the
    // candidates that would keep two CTAs per SM repeat plans (skipped),
    // and each rpw is timed twice: gradients in registers, then in memory
    let mut distinct = tried.clone();
    distinct.dedup();
    assert_eq!(tried.len(), 2 * distinct.len(), "tried {tried:?}");
    println!("rpw search: tried {tried:?}, chose {chosen} after {batches} batches");
    let second = PersistentEngine::new(&model, &params, config, &options).expect("engine");
    assert!(!second.tuning(), "the choice is remembered");
    assert_eq!(second.register_plan().rpw, chosen);
    assert_eq!(second.compiled_rpws(), vec![chosen]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Tagger graphs of `lengths` words; with `spell`, about every third word
/// is spelled out (for the character tagger).
fn tagger_graphs(
    rng: &mut ChaCha8Rng,
    lengths: &[usize],
    vocab: u32,
    chars: u32,
    spell: bool,
) -> Vec<InputGraph> {
    lengths
        .iter()
        .map(|&n| {
            let spelled: Vec<Vec<u32>> = (0..n)
                .map(|_| {
                    (0..rng.random_range(1..4))
                        .map(|_| rng.random_range(0..chars))
                        .collect()
                })
                .collect();
            let words: Vec<WordInput<'_>> = spelled
                .iter()
                .enumerate()
                .map(|(i, cs)| {
                    if spell && i % 3 == 1 {
                        WordInput::Chars(cs)
                    } else {
                        WordInput::Token(rng.random_range(0..vocab))
                    }
                })
                .collect();
            let tags: Vec<i32> = (0..n).map(|_| rng.random_range(0..5)).collect();
            tagger_graph(&words, &tags).expect("tagger graph")
        })
        .collect()
}

/// The VPPS benchmark models (BiLSTM taggers with and without characters,
/// TD-RNN, TD-LSTM, RvNN) follow the CPU trajectory on the persistent engine.
#[test]
fn persistent_training_follows_the_cpu_for_the_vpps_benchmark_models() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let cfg = ModelConfig {
        vocab: 40,
        hidden: 16,
        classes: 5,
    };
    let seq = SequenceConfig {
        mlp: 12,
        char_embed: 8,
        chars: 9,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let lengths = [1, 3, 7, 12, 5, 2, 9, 4];
    let taggers = tagger_graphs(&mut rng, &lengths, 30, 9, false);
    let spelled = tagger_graphs(&mut rng, &lengths, 30, 9, true);
    let pyramids: Vec<InputGraph> = [1, 3, 6, 9, 2, 5, 7, 4]
        .iter()
        .map(|&n| {
            let toks: Vec<u32> = (0..n).map(|_| rng.random_range(0..30)).collect();
            pyramid(&toks, rng.random_range(0..5)).expect("pyramid")
        })
        .collect();
    let trees = model_graphs("treefc", 8, 13);
    for (name, data) in [
        ("bilstm-tagger", &taggers),
        ("bilstm-char-tagger", &spelled),
        ("td-rnn", &pyramids),
        ("td-lstm", &pyramids),
        ("rvnn", &trees),
    ] {
        let model =
            build_sequence_model(name, &cfg, &seq, &ModelOptions { dropout: 0.0 }).expect("model");
        let config = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
        compare_steps(name, &model, config, data, 4, &PersistentOptions::default());
    }
}
