//! The engine conformance suite: every model of the zoo × every engine
//! that claims to support it (the support table, asked of the engines'
//! code) × CPU and CUDA, against the CPU reference (`CpuTrainer`):
//!
//! * training engines: the loss and the gradient of one SGD step (the
//!   gradient recovered from the update, `p₀ − p₁` at rate 1, as the
//!   contract exposes no gradients), then `STEPS` AdamW steps submitted
//!   at once (each step's loss, then through `state()` the parameters,
//!   both optimizer moments and the step count), then a step after
//!   `restore()` of the reference's state into a fresh engine;
//! * inference engines: the scores of every root;
//! * every (model, engine) the table says is not supported: building the
//!   engine (or, where it refuses only then, its first step) fails naming
//!   the op (else the model) that the table's reason names.
//!
//! CUDA cases skip with one notice where no driver is found. One test per
//! model (`conformance!`), so that a failure names its model and the
//! models run in parallel.

use ramus_conformance::close::{
    assert_close, assert_close_value, assert_scores_close, epsilon, Tolerance,
};
use ramus_conformance::engines::{
    reference_infer, reference_trainer, Device, InferKind, TrainKind,
};
use ramus_conformance::gpu;
use ramus_conformance::zoo::{batch, Case};
use ramus_core::{Model, Params};
use ramus_exec::{InferEngine, OptimizerConfig, OptimizerKind, TrainEngine, TrainState};
use ramus_graph::InputGraph;

/// Training steps of the trajectory, and graphs per batch.
const STEPS: usize = 3;
const BATCH: usize = 4;
const DATA_SEED: u64 = 17;
const PARAM_SEED: u64 = 5;
const DROPOUT_SEED: u64 = 9;

/// How close an engine must come to the CPU reference.
#[derive(Clone, Copy, Debug)]
struct Tolerances {
    /// The first step's loss (one forward pass).
    loss: Tolerance,
    /// Losses of the later steps (after updates that differed by rounding).
    trajectory_loss: Tolerance,
    /// Gradients, and parameters and first moments after the trajectory.
    tensor: Tolerance,
    /// Second moments (squares of gradients: twice their relative error).
    second_moment: Tolerance,
}

/// `cpu batched` is the reference's own engine driven through other calls
/// of the contract (`submit` of every step at once, `restore`): the same
/// kernels in the same order, so no difference at all.
const SAME_KERNELS: Tolerances = Tolerances {
    loss: Tolerance::EXACT,
    trajectory_loss: Tolerance::EXACT,
    tensor: Tolerance::EXACT,
    second_moment: Tolerance::EXACT,
};

/// CUDA engines in f32 against the CPU engine in f32: the same operations
/// with sums in another order (blocked matrix products, atomic gradient
/// sums, warp reductions). A sum of n terms differs by up to about
/// n·ε·Σ|terms| (ε = 2⁻²³ ≈ 1.2e-7); the widest sums here (a gradient
/// over a batch's rows, a few hundred terms) stay near 1e-5 of the
/// tensor's largest element, and 2e-4 leaves room for the few steps of
/// growth through the recursion. These are the bounds the per-engine
/// tests already held the CUDA engines to (`ramus-cuda/tests/engine.rs`,
/// `persistent.rs`): losses 1e-4 (one pass) and 1e-3 after updates,
/// tensors 2e-4 of their largest element.
const F32_REORDERED: Tolerances = Tolerances {
    loss: Tolerance::element(1e-4),
    trajectory_loss: Tolerance::element(1e-3),
    tensor: Tolerance::tensor(2e-4),
    second_moment: Tolerance::tensor(4e-4),
};

/// Scores of the CPU compiled engine: its level loop computes the same
/// expressions with its own dot products (another order than the batched
/// engine's matrix products); the bound `ramus-nn/tests/infer_engines.rs`
/// held it to.
const CPU_COMPILED_SCORES: Tolerance = Tolerance::element(1e-4);
/// Scores of the CUDA inference engines: reordered f32 sums as above
/// through a whole tree's recursion; the bound of `ramus-cuda/tests/infer.rs`.
const CUDA_SCORES: Tolerance = Tolerance::element(1e-3);

macro_rules! conformance {
    ($($test:ident: $model:literal,)*) => {
        /// The models the suite runs, one test each.
        const SUITE: &[&str] = &[$($model),*];
        $(
            #[test]
            fn $test() {
                check_model($model);
            }
        )*
    };
}

conformance! {
    treelstm: "treelstm",
    treelstm_nary: "treelstm-nary",
    treefc: "treefc",
    treegru: "treegru",
    mvrnn: "mvrnn",
    dagrnn: "dagrnn",
    lstm_lm: "lstm-lm",
    bilstm_tagger: "bilstm-tagger",
    bilstm_char_tagger: "bilstm-char-tagger",
    td_rnn: "td-rnn",
    td_lstm: "td-lstm",
    rvnn: "rvnn",
    alexnet: "alexnet",
    vgg: "vgg",
    vgg11: "vgg11",
    vgg13: "vgg13",
    vgg16: "vgg16",
    vgg19: "vgg19",
    resnet: "resnet",
}

#[test]
fn the_suite_runs_every_model_of_the_zoo() {
    let mut suite = SUITE.to_vec();
    let mut zoo = ramus_nn::MODEL_NAMES.to_vec();
    suite.sort_unstable();
    zoo.sort_unstable();
    assert_eq!(suite, zoo, "add the model to `conformance!`");
}

/// Every engine on `name`: what it claims to run against the reference,
/// what it refuses refused with the table's reason.
fn check_model(name: &'static str) {
    let case = Case::new(name, STEPS, BATCH, DATA_SEED).unwrap_or_else(|e| panic!("{e}"));
    let runs_here = |device: Device| device == Device::Cpu || gpu::cuda_available();
    for kind in TrainKind::ALL {
        let what = format!("{name} on {}", kind.label());
        match kind.supports(&case.model) {
            Ok(()) if runs_here(kind.device()) => check_training(kind, &case, &what),
            Err(why) if runs_here(kind.device()) => training_refused(kind, &case, &what, &why),
            _ => {}
        }
    }
    for kind in InferKind::ALL {
        let what = format!("{name} on {} ({kind:?})", kind.label());
        match kind.supports(&case.model) {
            Ok(()) if runs_here(kind.device()) => check_scores(kind, &case, &what),
            // the compiled engines lower before they open a device: their
            // refusals are checked on every machine
            Err(why) => infer_refused(kind, &case, &what, &why),
            Ok(()) => {}
        }
    }
}

fn tolerances(kind: TrainKind) -> Tolerances {
    match kind.device() {
        Device::Cpu => SAME_KERNELS,
        Device::Cuda => F32_REORDERED,
    }
}

fn build(
    kind: TrainKind,
    case: &Case,
    params: &Params<f32>,
    config: OptimizerConfig,
    what: &str,
) -> Box<dyn TrainEngine<f32>> {
    let mut engine = kind
        .build(&case.model, params, config, case.batch_size)
        .unwrap_or_else(|e| panic!("{what}: the table says it runs, but it is refused: {e}"));
    engine.set_seed(DROPOUT_SEED);
    engine
}

fn check_training(kind: TrainKind, case: &Case, what: &str) {
    let tol = tolerances(kind);
    check_gradients(kind, case, what, tol);
    let state = check_trajectory(kind, case, what, tol);
    check_restore(kind, case, what, tol, state);
}

/// One SGD step at rate 1: the loss, and each parameter's gradient as
/// `p₀ − p₁` (buffers: their updated values).
fn check_gradients(kind: TrainKind, case: &Case, what: &str, tol: Tolerances) {
    let model = &case.model;
    let p0 = case.params(PARAM_SEED);
    let sgd = OptimizerConfig::new(OptimizerKind::Sgd, 1.0);
    let mut reference = reference_trainer(model, &p0, sgd);
    reference.set_seed(DROPOUT_SEED);
    let mut engine = build(kind, case, &p0, sgd, what);
    let batches = case.batches();
    let b = batch(model, &batches[0]);
    let want = reference
        .train_step(&b)
        .unwrap_or_else(|e| panic!("{what}: reference step: {e}"));
    let got = engine
        .train_step(&b)
        .unwrap_or_else(|e| panic!("{what}: step: {e}"));
    assert_close_value(&format!("{what}: loss"), want, got, tol.loss);
    let want = reference.state().expect("reference state").params;
    let got = engine
        .state()
        .unwrap_or_else(|e| panic!("{what}: state(): {e}"))
        .params;
    let mut moved = false;
    for (p, spec) in model.params.iter().enumerate() {
        let (w, g) = (want.values[p].data(), got.values[p].data());
        if model.is_buffer(p) {
            assert_close(&format!("{what}: buffer {}", spec.name), w, g, tol.tensor);
            continue;
        }
        let start = p0.values[p].data();
        let delta = |after: &[f32]| -> Vec<f64> {
            start
                .iter()
                .zip(after)
                .map(|(a, b)| *a as f64 - *b as f64)
                .collect()
        };
        let (dw, dg) = (delta(w), delta(g));
        moved |= dw.iter().any(|x| *x != 0.0);
        // each side's update rounds p₁ = p₀ − g to f32: ε/2 of |p₁| each
        let largest = w.iter().chain(g).fold(0f32, |m, x| m.max(x.abs())) as f64;
        let rounding = epsilon::<f32>() * largest;
        assert_close(
            &format!("{what}: gradient of {}", spec.name),
            &dw,
            &dg,
            tol.tensor.plus(rounding),
        );
    }
    assert!(moved, "{what}: the reference step changed no parameter");
}

/// `STEPS` AdamW steps, submitted at once to the engine and one by one to
/// the reference; returns the reference's state after them.
fn check_trajectory(kind: TrainKind, case: &Case, what: &str, tol: Tolerances) -> TrainState<f32> {
    let model = &case.model;
    let p0 = case.params(PARAM_SEED);
    let config = adamw();
    let mut reference = reference_trainer(model, &p0, config);
    reference.set_seed(DROPOUT_SEED);
    let mut engine = build(kind, case, &p0, config, what);
    let graphs = case.batches();
    let batches: Vec<_> = graphs.iter().map(|g| batch(model, g)).collect();
    let want: Vec<f64> = batches
        .iter()
        .map(|b| reference.train_step(b).expect("reference step"))
        .collect();
    let mut outcomes = engine
        .submit(&batches)
        .unwrap_or_else(|e| panic!("{what}: submit: {e}"));
    outcomes.extend(
        engine
            .finish()
            .unwrap_or_else(|e| panic!("{what}: finish: {e}")),
    );
    assert_eq!(
        outcomes.len(),
        STEPS,
        "{what}: one outcome per submitted step"
    );
    for (step, (w, got)) in want.iter().zip(outcomes).enumerate() {
        let got = got.unwrap_or_else(|e| panic!("{what}: step {step} not applied: {e:?}"));
        let t = if step == 0 {
            tol.loss
        } else {
            tol.trajectory_loss
        };
        assert_close_value(&format!("{what}: loss of step {step}"), *w, got, t);
    }
    let want = reference.state().expect("reference state");
    let got = engine
        .state()
        .unwrap_or_else(|e| panic!("{what}: state(): {e}"));
    compare_states(
        model,
        &format!("{what} after {STEPS} steps"),
        &want,
        &got,
        tol,
    );
    want
}

/// The reference's state restored into a fresh engine, then one more step
/// on both: the engine continues from the restored parameters, moments and
/// step count.
fn check_restore(
    kind: TrainKind,
    case: &Case,
    what: &str,
    tol: Tolerances,
    state: TrainState<f32>,
) {
    let model = &case.model;
    let config = adamw();
    let mut reference = reference_trainer(model, &case.params(PARAM_SEED), config);
    reference.restore(state.clone()).expect("reference restore");
    let mut engine = build(kind, case, &case.params(PARAM_SEED + 1), config, what);
    engine
        .restore(state)
        .unwrap_or_else(|e| panic!("{what}: restore(): {e}"));
    let graphs = case.batches();
    let b = batch(model, &graphs[0]);
    let want = reference.train_step(&b).expect("reference step");
    let got = engine
        .train_step(&b)
        .unwrap_or_else(|e| panic!("{what}: step after restore: {e}"));
    let what = format!("{what} after restore");
    assert_close_value(&format!("{what}: loss"), want, got, tol.trajectory_loss);
    let want = reference.state().expect("reference state");
    let got = engine
        .state()
        .unwrap_or_else(|e| panic!("{what}: state(): {e}"));
    compare_states(model, &what, &want, &got, tol);
}

/// The trajectory's optimizer, chosen so that the trajectory is well
/// conditioned. Adam's step `lr·m̂/(√v̂ + ε)` has slope `lr/ε` at a zero
/// gradient: at lr 1e-2 and the default ε 1e-8 it multiplies a
/// gradient's rounding by 10⁶, so an element whose true gradient is near
/// zero steps +lr on one engine and −lr on another. lr 1e-3 and ε 1e-4
/// bound that factor to 10; on the CPU, f32 against f64 after `STEPS`
/// steps then differs by at most 2e-5 of a tensor's largest element over
/// the whole zoo (VGG-19 the most), a tenth of `F32_REORDERED`'s bound.
/// The weight decay is large enough to move parameters by more than
/// that bound.
fn adamw() -> OptimizerConfig {
    OptimizerConfig {
        weight_decay: 0.1,
        eps: 1e-4,
        ..OptimizerConfig::new(OptimizerKind::Adam, 1e-3)
    }
}

/// Parameters, both moments and the step count of two training states.
fn compare_states(
    model: &Model,
    what: &str,
    want: &TrainState<f32>,
    got: &TrainState<f32>,
    tol: Tolerances,
) {
    let (wo, go) = (&want.optimizer, &got.optimizer);
    assert_eq!(go.steps(), wo.steps(), "{what}: optimizer steps");
    for (p, spec) in model.params.iter().enumerate() {
        let name = &spec.name;
        let (w, g) = (want.params.values[p].data(), got.params.values[p].data());
        assert_close(&format!("{what}: parameter {name}"), w, g, tol.tensor);
        if model.is_buffer(p) {
            continue;
        }
        let (w, g) = (wo.first_moments()[p].data(), go.first_moments()[p].data());
        assert_close(&format!("{what}: first moment of {name}"), w, g, tol.tensor);
        let (w, g) = (wo.second_moments()[p].data(), go.second_moments()[p].data());
        assert_close(
            &format!("{what}: second moment of {name}"),
            w,
            g,
            tol.second_moment,
        );
    }
}

/// The table says `kind` does not train the case's model: building it,
/// or else its first step, fails with the table's reason.
fn training_refused(kind: TrainKind, case: &Case, what: &str, why: &str) {
    let named = named_in(why, case.name).unwrap_or_else(|| {
        panic!("{what}: the table's reason names neither an op nor the model: {why}")
    });
    let params = case.params(PARAM_SEED);
    let err = match kind.build(&case.model, &params, adamw(), case.batch_size) {
        Err(e) => e,
        Ok(mut engine) => {
            let graphs = case.batches();
            match engine.train_step(&batch(&case.model, &graphs[0])) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("{what}: the table says no ({why}), but the engine trains it"),
            }
        }
    };
    assert!(
        err.contains(&named),
        "{what}: refused with `{err}`, the table says `{why}`"
    );
}

/// What a refusal must name, as the table's reason `why` names it: the op
/// (`` op `…` ``, its signature), else the model (`` `name` ``). The
/// engine's own message may place it differently (the node, the pass).
fn named_in(why: &str, model: &str) -> Option<String> {
    if let Some(start) = why.find("op `") {
        let rest = &why[start + 4..];
        let end = rest.find('`')?;
        return Some(format!("op `{}`", &rest[..end]));
    }
    let model = format!("`{model}`");
    why.contains(&model).then_some(model)
}

/// Every root's scores against the reference's, twice (an engine's second
/// batch reuses what its first set up).
fn check_scores(kind: InferKind, case: &Case, what: &str) {
    let params = case.params(PARAM_SEED);
    let graphs: Vec<&InputGraph> = case.graphs.iter().collect();
    let want = reference_infer(&case.model, &params)
        .infer(&graphs)
        .unwrap_or_else(|e| panic!("{what}: reference: {e}"));
    let mut engine = kind
        .build(&case.model, &params)
        .unwrap_or_else(|e| panic!("{what}: the table says it runs, but it is refused: {e}"));
    let tol = match kind.device() {
        Device::Cpu => CPU_COMPILED_SCORES,
        Device::Cuda => CUDA_SCORES,
    };
    for round in 0..2 {
        let got = engine
            .infer(&graphs)
            .unwrap_or_else(|e| panic!("{what}: round {round}: {e}"));
        assert_scores_close(&format!("{what} round {round}"), &want, &got, tol);
    }
}

/// The table says `kind` does not run the case's model: building it fails
/// with the table's reason.
fn infer_refused(kind: InferKind, case: &Case, what: &str, why: &str) {
    let named = named_in(why, case.name).unwrap_or_else(|| {
        panic!("{what}: the table's reason names neither an op nor the model: {why}")
    });
    let params = case.params(PARAM_SEED);
    let built = kind.build(&case.model, &params).map(drop);
    match built {
        Ok(()) => panic!("{what}: the table says no ({why}), but the engine builds"),
        Err(err) => assert!(
            err.contains(&named),
            "{what}: refused with `{err}`, the table says `{why}`"
        ),
    }
}
