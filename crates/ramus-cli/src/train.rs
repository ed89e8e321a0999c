//! `ramus train`: set up the data, model and engine, run the epochs
//! (resumable checkpoints every `--checkpoint-every` batches and at the end
//! of each epoch, and on SIGINT / SIGTERM before exiting), keep the best
//! dev epoch, evaluate on test and save.
//!
//! Checkpoint files (see docs/cli.md, "Checkpoints"): with `--checkpoint-dir
//! DIR`, `DIR/last.safetensors` and `DIR/best.safetensors`; else, with
//! `--save NAME.EXT`, `NAME.last.EXT` and `NAME.best.EXT` beside it; with
//! neither, none.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use ramus_core::{Model, Params};
use ramus_dist::{Shard, World};
use ramus_exec::nonfinite::first_nonfinite;
use ramus_exec::{OnNonFinite, Optimizer, OptimizerConfig, OptimizerKind, TrainState};
use ramus_graph::BatchingPolicy;
use ramus_nn::resume::{self, Best, RunState};
use ramus_nn::schedule::{LrSchedule, ScheduleKind, StepAt};
use ramus_nn::train::{shuffled_order, Pauses, Span, SpanEnd};
use ramus_nn::{checkpoint, DataKind, EvalResult, ModelConfig, ModelOptions, Trainer};
use serde_json::json;

use crate::args::TrainArgs;
use crate::data::Splits;
use crate::metrics::{finite, RunLog};
use crate::model_build::{build, loss_rows};
use crate::output::logln;
use crate::result::AnyResult;
use crate::{data, device, distributed, embeddings, labels, limits, run_config, sequence, vision};

/// Where a run's resumable checkpoints go.
struct CheckpointPaths {
    last: PathBuf,
    best: PathBuf,
}

impl CheckpointPaths {
    /// The paths for `--checkpoint-dir` or beside `--save` (see the module
    /// docs), checked writable; `None` with neither flag.
    fn of(a: &TrainArgs) -> AnyResult<Option<Self>> {
        let (paths, flag) = match (&a.checkpoint_dir, &a.save) {
            (Some(dir), _) => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| format!("--checkpoint-dir {}: {e}", dir.display()))?;
                (
                    CheckpointPaths {
                        last: dir.join("last.safetensors"),
                        best: dir.join("best.safetensors"),
                    },
                    "--checkpoint-dir",
                )
            }
            (None, Some(save)) => (
                CheckpointPaths {
                    last: beside(save, "last"),
                    best: beside(save, "best"),
                },
                "--save",
            ),
            (None, None) => {
                if a.checkpoint_every.is_some() {
                    return Err(
                        "--checkpoint-every needs --checkpoint-dir or --save (where the \
                                checkpoints go)"
                            .into(),
                    );
                }
                return Ok(None);
            }
        };
        for path in [&paths.last, &paths.best] {
            ramus_exec::atomic::check_writable(path, flag)?;
        }
        Ok(Some(paths))
    }
}

/// `NAME.EXT` → `NAME.tag.EXT` (`NAME.tag` without an extension).
fn beside(path: &Path, tag: &str) -> PathBuf {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.{tag}.{}", ext.to_string_lossy()),
        None => format!("{stem}.{tag}"),
    };
    path.with_file_name(name)
}

/// What a resumed run takes from its checkpoint.
struct ResumeFrom {
    path: PathBuf,
    bytes: Vec<u8>,
    state: RunState,
    steps: u64,
    /// The resumed run's flags, recorded in its checkpoints.
    config: run_config::RunConfig,
}

/// The run's arguments: as given, or for `--resume` completed from the
/// checkpoint's record (see [`run_config`]), with its state.
fn resolve(a: TrainArgs) -> AnyResult<(TrainArgs, Option<ResumeFrom>)> {
    let Some(path) = a.resume.clone() else {
        return Ok((a, None));
    };
    let (_, bytes) = checkpoint::read_info(&path)?;
    let (state, steps) = resume::read_state(&path, &bytes)?;
    let (a, config) = run_config::resumed_args(&state.config, &path.display().to_string())?;
    Ok((
        a,
        Some(ResumeFrom {
            path,
            bytes,
            state,
            steps,
            config,
        }),
    ))
}

/// Everything a run trains with.
struct Setup {
    kind: DataKind,
    data: Splits,
    trainer: Trainer<f32>,
    /// The learning rate (the flag's or the model kind's default).
    lr: f64,
    /// Its schedule over the run.
    schedule: LrSchedule,
    /// Optimizer steps an epoch (global steps, on several GPUs).
    steps_per_epoch: usize,
    /// The state the run starts from (fresh, or the checkpoint's).
    run: RunState,
    best: Option<Params<f32>>,
}

/// Builds the model for `a` and `data` (settings recorded for `eval`).
fn model_for(a: &TrainArgs, kind: DataKind, data: &Splits, hidden: usize) -> AnyResult<Model> {
    let cfg = ModelConfig {
        vocab: data.vocab.len(),
        hidden,
        classes: data.classes,
    };
    let mut model = build_for(a, kind, &cfg, data.chars())?;
    if !data.class_names.is_empty() {
        model.settings.insert(
            "class_names".into(),
            serde_json::to_string(&data.class_names)?,
        );
    }
    if let (DataKind::Tagged { chars: true }, Some(t)) = (kind, &data.tagged) {
        model
            .settings
            .insert(sequence::CHAR_VOCAB_SETTING.into(), t.chars.to_json());
    }
    Ok(model)
}

/// `a.model` with `a`'s options for `cfg` (and `chars` characters).
fn build_for(a: &TrainArgs, kind: DataKind, cfg: &ModelConfig, chars: usize) -> AnyResult<Model> {
    let vision_cfg = a.vision.config(&a.model, kind)?;
    let opts = ModelOptions { dropout: a.dropout };
    let seq_cfg = a.sequence.config(&a.model, chars)?;
    let mut model = build(&a.model, cfg, vision_cfg.as_ref(), seq_cfg.as_ref(), &opts)?;
    if let Some(at) = a.loss_at.as_deref() {
        model.head.rows = loss_rows(at).map_err(|e| format!("--loss-at {e}"))?;
        // recorded so that `ramus eval` reports the loss the model trained on
        model.settings.insert("loss_at".into(), at.into());
    }
    Ok(model)
}

/// Reads the splits of a model that reads text. The pyramids of a
/// time-delay network are refused before they are built when they cannot
/// fit: the vocabulary and class count are not known before the data is
/// read, but a pyramid's activations do not depend on them, so a model of
/// one word and one class costs them.
fn load_text(a: &TrainArgs, kind: DataKind, hidden: usize) -> AnyResult<Splits> {
    let one = ModelConfig {
        vocab: 1,
        hidden,
        classes: 1,
    };
    let reader = match kind {
        DataKind::SentencePyramid => Some(build_for(a, kind, &one, 0)?),
        _ => None,
    };
    let mut guard = a.host.build_guard(reader.as_ref().map(|m| (m, a.device)));
    data::load_splits(a.data.as_deref(), kind, &mut guard, split_words(a, kind))
}

/// Every split's words for pretrained vectors of trees and sentences
/// ([`embeddings::read`] keeps those the file has), else the training
/// split's.
fn split_words(a: &TrainArgs, kind: DataKind) -> data::SplitWords {
    let text = matches!(
        kind,
        DataKind::Trees | DataKind::Sentences | DataKind::SentencePyramid
    );
    match a.embeddings.is_some() && text {
        true => data::SplitWords::All,
        false => data::SplitWords::Train,
    }
}

/// Reads the data, builds the model, its parameters (fresh or resumed)
/// and the engine; prints the `data:` and `model:` lines.
fn setup(a: &TrainArgs, from: Option<&ResumeFrom>, world: Option<&World>) -> AnyResult<Setup> {
    let kind = data::data_kind_of(&a.model)?;
    let policy: BatchingPolicy = a.policy.parse()?;
    let vision_cfg = a.vision.config(&a.model, kind)?;
    let (optimizer, lr) = vision::optimizer_defaults(kind, a.optimizer.as_deref(), a.lr);
    let opt: OptimizerKind = optimizer.parse()?;
    let hidden = a.hidden.unwrap_or(match kind {
        DataKind::Images => vision::DEFAULT_CNN_WIDTH,
        _ => vision::DEFAULT_HIDDEN,
    });
    if a.batch_size == 0 || hidden == 0 {
        return Err("--batch-size and --hidden must be at least 1".into());
    }
    // hyper-parameters no one can mean are refused before any work
    let mut oc = OptimizerConfig::new(opt, lr);
    oc.weight_decay = a.weight_decay;
    oc.clip_norm = a.clip;
    oc.validate()?;
    ModelOptions { dropout: a.dropout }.validate()?;
    let engine_choice = device::engine_for_nonfinite(a.engine, a.on_nonfinite)?;
    let mut data = load_data(a, kind, hidden, vision_cfg.as_ref())?;
    let vectors = match &a.embeddings {
        Some(path) => Some(embeddings::read(
            path,
            &mut data,
            split_words(a, kind),
            a.quiet,
        )?),
        None => None,
    };
    let model = model_for(a, kind, &data, hidden)?;
    a.structure.fit_splits(&model, kind, &mut data)?;
    let need = limits::Training {
        model: &model,
        optimizer: opt,
        data: &data,
        batch_size: a.batch_size,
        hidden,
        class_source: labels::source(&data, kind, a.classes),
        device: a.device,
    };
    need.check_host(a.host)?;
    let at = Start {
        model: &model,
        data: &data,
        vectors: vectors.as_ref(),
        from,
    };
    let (mut run, params, restored, best) = starting_point(a, &at, oc)?;
    let ranks = world.map_or(1, |w| w.size);
    match from {
        Some(_) => rebase(&mut run, ranks, a.batch_size, data.train.len()),
        None => run.ranks = ranks,
    }
    let swap = device::swap_mode(a.device, &a.model, a.device_memory_budget, a.swap)?;
    let engine = training_engine(a, (engine_choice, world), &need, (params, oc), swap)?;
    let mut trainer = Trainer::with_engine(engine);
    trainer.policy = policy;
    trainer.on_nonfinite = a.on_nonfinite;
    trainer.accumulate = a.accumulate;
    trainer.check_nonfinite_policy()?;
    start(&mut trainer, a.seed, restored.map(|o| (o, &run)))?;
    if let Some(scales) = a.rates.lr_scales(trainer.model(), lr)? {
        trainer.engine.set_lr_scales(&scales)?;
    }
    let ranks = world.map_or(1, |w| w.size);
    let batches = data.train.len().div_ceil(a.batch_size * ranks);
    let steps_per_epoch = batches.div_ceil(a.accumulate.max(1)).max(1);
    let schedule = a.rates.schedule(lr, a.epochs * steps_per_epoch)?;
    logln!(
        "model: {} hidden {} | optimizer {} lr {}{} | batch {} | engine {}{} ({} host threads){}",
        a.model,
        hidden,
        optimizer,
        lr,
        describe_rates(a, &schedule),
        a.batch_size,
        trainer.engine.name(),
        match world {
            Some(w) => format!(" on {} GPUs (NCCL)", w.size),
            None => String::new(),
        },
        rayon::current_num_threads(),
        match swap {
            ramus_cuda::SwapMode::Off => String::new(),
            mode => format!(" | swap {mode}"),
        }
    );
    Ok(Setup {
        kind,
        data,
        trainer,
        lr,
        schedule,
        steps_per_epoch,
        run,
        best,
    })
}

/// The schedule and the embedding tables' rates for the `model:` line
/// (nothing for a constant rate without them).
fn describe_rates(a: &TrainArgs, schedule: &LrSchedule) -> String {
    let mut s = String::new();
    if schedule.kind != ScheduleKind::Constant {
        s += &format!(" ({})", schedule.kind.name());
    }
    if schedule.warmup > 0 {
        s += &format!(" warm-up {} steps", schedule.warmup);
    }
    if a.rates.freeze_embeddings {
        s += " | word embeddings frozen";
    }
    if let Some(lr) = a.rates.embedding_lr {
        s += &format!(" | embedding lr {lr}");
    }
    s
}

/// What [`starting_point`] starts from: the model, the data, the vectors
/// of `--embeddings` and the checkpoint of `--resume`.
struct Start<'a> {
    model: &'a Model,
    data: &'a Splits,
    vectors: Option<&'a ramus_graph::vectors::WordVectors>,
    from: Option<&'a ResumeFrom>,
}

/// Where a run starts: a fresh run state and parameters from the seed
/// (the embedding table from `--embeddings`), or the checkpoint's, with
/// its optimizer state and best epoch's parameters.
fn starting_point(
    a: &TrainArgs,
    start: &Start<'_>,
    oc: OptimizerConfig,
) -> AnyResult<StartingPoint> {
    let Start {
        model,
        data,
        vectors,
        from,
    } = *start;
    let fingerprint = resume::fingerprint(&[&data.train, &data.dev, &data.test], &data.vocab);
    Ok(match from {
        None => {
            let run = RunState {
                epochs_done: 0,
                progress: Default::default(),
                shuffle: ramus_nn::train::rng(a.seed),
                dropout: ramus_nn::train::rng(a.seed),
                best: None,
                plateau: Default::default(),
                config: run_config::current()?,
                data: fingerprint,
                ranks: 1,
            };
            let mut params = Params::<f32>::init(model, a.seed);
            if let (Some(path), Some(vectors)) = (&a.embeddings, vectors) {
                embeddings::apply(path, vectors, model, &mut params)?;
            }
            (run, params, None, None)
        }
        Some(from) => {
            if from.state.data != fingerprint {
                return Err(format!(
                    "--resume {}: the data differs from the run's ({}): resume on the same \
                     data",
                    from.path.display(),
                    data.source
                )
                .into());
            }
            let r = resume::load(&from.path, &from.bytes, model, oc, &from.state, from.steps)?;
            let run = RunState {
                config: from.config.clone(),
                ..from.state.clone()
            };
            (run, r.params, Some(r.optimizer), r.best)
        }
    })
}

/// A run resumed on `ranks` ranks that was saved on another number: the
/// rest of its epoch in steps of the new size, said.
fn rebase(run: &mut RunState, ranks: usize, batch_size: usize, len: usize) {
    let saved_on = run.ranks;
    if let Some(skip) = run.rebase(ranks, batch_size, len) {
        logln!(
            "resuming on {ranks} GPU(s) a run saved on {saved_on}: {} graphs a step instead of \
             {}; the epoch goes on from graph {skip} of its {len}",
            ranks * batch_size,
            saved_on * batch_size
        );
    }
}

/// A run's state, parameters, restored optimizer and best parameters.
type StartingPoint = (
    RunState,
    Params<f32>,
    Option<Optimizer<f32>>,
    Option<Params<f32>>,
);

/// The splits of `a.data` (images for `vision`, else text or trees), their
/// labels settled; prints the `data:` line.
fn load_data(
    a: &TrainArgs,
    kind: DataKind,
    hidden: usize,
    vision: Option<&ramus_nn::VisionConfig>,
) -> AnyResult<Splits> {
    let mut data = match vision {
        Some(v) => data::load_image_splits(
            a.data.as_deref(),
            v.image,
            a.vision.images.unwrap_or(vision::DEFAULT_TRAIN_IMAGES),
        )?,
        None => load_text(a, kind, hidden)?,
    };
    labels::settle(&mut data, kind, a.classes)?;
    logln!(
        "data: {} ({} train / {} dev / {} test, {})",
        data.source,
        data.train.len(),
        data.dev.len(),
        data.test.len(),
        data.describe()
    );
    Ok(data)
}

/// The training engine `choice` asks for (the persistent one, checked
/// before it allocates), else the batched engine of `a.device`, checked
/// against the device memory once built; in a run on several GPUs, this
/// rank's engine joined to the others.
fn training_engine(
    a: &TrainArgs,
    (choice, world): (device::TrainEngineChoice, Option<&World>),
    need: &limits::Training<'_>,
    (params, oc): (Params<f32>, OptimizerConfig),
    swap: ramus_cuda::SwapMode,
) -> AnyResult<Box<dyn ramus_exec::TrainEngine<f32>>> {
    let budget = a.device_memory_budget;
    device::check_sync_bn(a.sync_bn, need.model, world.is_some())?;
    let asked = a.swap.filter(|&m| m != ramus_cuda::SwapMode::Off);
    device::refuse_persistent_swap(asked, choice == device::TrainEngineChoice::Persistent)?;
    if let Some(world) = world {
        let w = distributed::WorkerEngine {
            world,
            model: need.model,
            choice,
            swap,
            budget,
            timeout: distributed::timeout(a.dist_timeout)?,
            batch_size: a.batch_size,
            sync_bn: a.sync_bn,
            bucket_bytes: distributed::bucket_bytes(a.bucket_mb)?,
        };
        return distributed::engine(w, (params, oc));
    }
    // checked before it allocated
    let persistent = device::persistent_trainer(choice, need, &params, oc, budget)?;
    device::refuse_persistent_swap(asked, persistent.is_some())?;
    // steps of several batches, or per-parameter rates on the persistent
    // engine: its updates split out of its kernel
    let multipliers = a.rates.freeze_embeddings || a.rates.embedding_lr.is_some();
    if a.accumulate > 1 || (multipliers && persistent.is_some()) {
        let (model, device) = (need.model, a.device);
        let engine = device::accumulating(device, model, (params, oc), budget, (persistent, swap))?;
        need.check_device(engine.as_ref(), budget, swap != ramus_cuda::SwapMode::Off)?;
        return Ok(engine);
    }
    Ok(match persistent {
        Some(persistent) => Box::new(persistent),
        None => {
            let engine = device::engine(a.device, need.model, (params, oc), budget, swap)?;
            need.check_device(engine.as_ref(), budget, swap != ramus_cuda::SwapMode::Off)?;
            engine
        }
    })
}

/// Starts `trainer`'s dropout stream from `seed`, or, resumed, makes the
/// checkpoint's optimizer state and the run's dropout stream its own.
fn start(
    trainer: &mut Trainer<f32>,
    seed: u64,
    resumed: Option<(Optimizer<f32>, &RunState)>,
) -> AnyResult {
    match resumed {
        Some((optimizer, run)) => {
            let state = trainer.state()?;
            trainer.engine.restore(TrainState {
                optimizer,
                dropout: run.dropout.clone(),
                ..state
            })?;
        }
        None => trainer.engine.set_seed(seed),
    }
    Ok(())
}

/// SIGINT / SIGTERM ask the run to stop at the next batch boundary; a
/// second SIGINT ends it at once.
fn stop_flag() -> AnyResult<Arc<AtomicBool>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let flag = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register_conditional_shutdown(SIGINT, 130, Arc::clone(&flag))?;
    for signal in [SIGINT, SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&flag))?;
    }
    Ok(flag)
}

/// Says when the first step is done, counted from `start`: set-up, data,
/// engine, and on several GPUs the rendezvous and the communicator.
fn first_step_done(start: Instant) {
    logln!(
        "first step done {:.2} s after start",
        start.elapsed().as_secs_f64()
    );
}

/// A run under way: its setup, checkpoint paths and stop flag.
struct Run<'a> {
    a: &'a TrainArgs,
    s: Setup,
    paths: Option<CheckpointPaths>,
    stop: Option<Arc<AtomicBool>>,
    log: Option<RunLog>,
    /// When the command started, until its first step is done and said.
    started: Option<Instant>,
}

impl Run<'_> {
    /// Saves the run's state to the last checkpoint (if there is one).
    fn save_last(&mut self) -> AnyResult {
        let Some(paths) = &self.paths else {
            return Ok(());
        };
        let t = &mut self.s.trainer;
        let state = t.state()?;
        self.s.run.dropout = state.dropout;
        resume::save(
            &paths.last,
            t.model(),
            &state.params,
            &self.s.data.vocab,
            (&self.s.run, &state.optimizer, self.s.best.as_ref()),
        )?;
        Ok(())
    }

    /// With `--patience P`: whether `P` epochs have passed since the best
    /// dev epoch (which the run state keeps, so a resumed run counts on),
    /// said in the log and the metrics.
    fn patience_ran_out(&mut self, epoch: usize) -> AnyResult<bool> {
        let (Some(patience), Some(best)) = (self.a.patience, self.s.run.best) else {
            return Ok(false);
        };
        if epoch < best.epoch + patience || epoch == self.a.epochs {
            return Ok(false);
        }
        logln!(
            "early stop after epoch {epoch}: no better dev accuracy for {patience} epoch(s) \
             (best: epoch {})",
            best.epoch
        );
        if let Some(log) = &mut self.log {
            let record = json!({"epoch": epoch, "best_epoch": best.epoch, "patience": patience});
            log.record("early_stop", record)?;
        }
        Ok(true)
    }

    /// The plateau schedule takes epoch `epoch`'s dev accuracy `acc` (its
    /// state is the run's, saved with it); a decay is said in the log and
    /// the metrics.
    fn plateau(&mut self, epoch: usize, acc: f64) -> AnyResult {
        let ScheduleKind::Plateau { patience, .. } = self.s.schedule.kind else {
            return Ok(());
        };
        if !self.s.run.plateau.observe(acc, patience) {
            return Ok(());
        }
        let next = StepAt {
            step: epoch * self.s.steps_per_epoch,
            epoch: epoch + 1,
        };
        let lr = self.s.schedule.rate(next, &self.s.run.plateau);
        logln!("  no better dev accuracy for {patience} epoch(s): learning rate now {lr:.4e}");
        if let Some(log) = &mut self.log {
            log.record("lr_decay", json!({"epoch": epoch, "lr": lr}))?;
        }
        Ok(())
    }

    fn stopping(&self) -> bool {
        self.stop.as_ref().is_some_and(|f| f.load(Ordering::SeqCst))
    }

    /// Whether to stop between two epochs: on several GPUs, if any rank
    /// was asked to (all ranks ask together, so all stop or none).
    fn stop_agreed(&mut self) -> AnyResult<bool> {
        let mut any = [f64::from(u8::from(self.stopping()))];
        self.s.trainer.engine.sum_over_ranks(&mut any)?;
        Ok(any[0] > 0.0)
    }

    /// The message a stopped run exits with.
    fn stopped(&self) -> AnyResult {
        let Some(last) = self.paths.as_ref().map(|p| p.last.display().to_string()) else {
            return Err("interrupted (rank 0 saved the checkpoint)".into());
        };
        Err(format!(
            "interrupted: saved {0} (epoch {1}, batch {2}); continue with `ramus train --resume {0}`",
            last,
            self.s.run.epochs_done + 1,
            self.s.run.progress.batches
        )
        .into())
    }

    /// A pause within an epoch, on every rank: the ranks' running
    /// statistics averaged, rank 0's checkpoint written; `stopping`: the
    /// other ranks wait for that checkpoint before they end.
    fn pause(&mut self, stopping: bool) -> AnyResult {
        self.s.trainer.engine.sync_buffers()?;
        self.save_last()?;
        if stopping {
            self.s.trainer.engine.sum_over_ranks(&mut [0.0])?;
        }
        Ok(())
    }

    /// Trains epoch `epoch` from where the run state says it is; `Ok(false)`
    /// if a signal stopped it (its state saved).
    /// The learning rate of the epoch's batch `i` (from 0): its step's.
    fn rates(&self, epoch: usize) -> impl Fn(usize) -> f64 + use<> {
        let (schedule, plateau) = (self.s.schedule, self.s.run.plateau);
        let first_step = (epoch - 1) * self.s.steps_per_epoch;
        let k = self.a.accumulate.max(1);
        move |i: usize| {
            let at = StepAt {
                step: first_step + i / k,
                epoch,
            };
            schedule.rate(at, &plateau)
        }
    }

    fn epoch(&mut self, epoch: usize, style: &ProgressStyle) -> AnyResult<bool> {
        let data = &self.s.data;
        let t0 = Instant::now();
        let mut shuffle = self.s.run.shuffle.clone();
        let order = shuffled_order(data.train.len(), &mut shuffle);
        // after a resume on another number of GPUs: what they left
        let order = &order[self.s.run.progress.skip.min(order.len())..];
        // on several GPUs: this rank's share of the epoch
        let (rank, world) = self.s.trainer.engine.ranks();
        let mine = match world {
            1 => order.len(),
            _ => Shard::new(rank, world)?
                .batches(order, self.a.batch_size)?
                .iter()
                .map(|part| part.len())
                .sum(),
        };
        let bar = if self.a.quiet || rank > 0 {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(mine as u64)
        };
        bar.set_style(style.clone());
        bar.set_prefix(epoch.to_string());
        bar.set_position(self.s.run.progress.graphs as u64);
        let stop = self.stop.clone();
        let requested = move || stop.as_ref().is_some_and(|f| f.load(Ordering::SeqCst));
        let pauses = Pauses {
            // every rank pauses there (rank 0 writes): the ranks meet at
            // each checkpoint to average their running statistics
            every: self.a.checkpoint_every,
            requested: &requested,
        };
        let seen_before = self.s.run.progress.graphs;
        let mut started = self.started.take();
        let rate = self.rates(epoch);
        let mut log_failed: Option<String> = None;
        loop {
            let span = Span {
                data: &self.s.data.train,
                order,
                batch_size: self.a.batch_size,
                rates: Some(&rate),
            };
            let end = self.s.trainer.train_span(
                &span,
                &mut self.s.run.progress,
                &pauses,
                |batch, seen, loss| {
                    if let Some(t) = started.take() {
                        bar.suspend(|| first_step_done(t));
                    }
                    // the batch's step took this rate (batches count from 1)
                    let lr = rate(batch - 1);
                    bar.set_position(seen as u64);
                    bar.set_message(format!("{loss:.4} lr {lr:.3e}"));
                    if let Some(log) = self.log.as_mut().filter(|l| l.logs_step(batch)) {
                        let step = json!({"epoch": epoch, "batch": batch, "graphs": seen,
                            "loss": finite(loss), "lr": lr});
                        if let Err(e) = log.record("step", step) {
                            log_failed.get_or_insert(e.to_string());
                        }
                    }
                },
            );
            if let Some(e) = log_failed.take() {
                return Err(e.into());
            }
            let end = end.map_err(|e| format!("epoch {epoch}: {e}"))?;
            match end {
                SpanEnd::EpochDone => break,
                SpanEnd::Checkpoint => self.pause(false)?,
                SpanEnd::Requested => {
                    bar.finish_and_clear();
                    self.pause(true)?;
                    return Ok(false);
                }
            }
        }
        bar.finish_and_clear();
        let secs = t0.elapsed().as_secs_f64();
        let loss = self.s.run.progress.mean_loss();
        // every rank's graphs
        let mut seen = [(mine - seen_before) as f64];
        self.s.trainer.engine.sum_over_ranks(&mut seen)?;
        // the rate of the epoch's last step
        let lr = rate(self.s.run.progress.batches.max(1) - 1);
        self.end_epoch(epoch, loss, seen[0] / secs, lr)?;
        self.s.run.shuffle = shuffle;
        Ok(true)
    }

    /// An epoch's report, dev evaluation and best model; then the epoch is
    /// done in the run state and its end saved.
    fn end_epoch(&mut self, epoch: usize, loss: f64, per_sec: f64, lr: f64) -> AnyResult {
        let kind = self.s.kind;
        let trainer = &mut self.s.trainer;
        let reports = [
            trainer.engine.memory_report(),
            trainer.engine.timing_report(),
        ];
        for report in reports.iter().flatten() {
            logln!("  {report}");
        }
        let dev = trainer.evaluate(&self.s.data.dev, 64)?;
        if let Some(log) = &mut self.log {
            let [memory, timing] = reports;
            let record = json!({"epoch": epoch, "train_loss": finite(loss),
                "dev_loss": finite(dev.loss), "dev_root_accuracy": dev.root_accuracy,
                "dev_node_accuracy": dev.node_accuracy, "graphs_per_s": finite(per_sec),
                "lr": lr, "skipped": self.s.run.progress.skipped,
                "device_memory_room": trainer.engine.device_memory_room(),
                "memory": memory, "timing": timing});
            log.record("epoch", record)?;
        }
        logln!(
            "epoch {epoch}: train loss {loss:.4} | dev loss {:.4} {} | lr {lr:.4e} | {:.0} {}/s{}",
            dev.loss,
            vision::accuracy(kind, &dev),
            per_sec,
            vision::unit(kind).0,
            match self.a.on_nonfinite {
                OnNonFinite::SkipBatch => format!(
                    " | {} non-finite batches skipped",
                    self.s.run.progress.skipped
                ),
                OnNonFinite::Stop => String::new(),
            }
        );
        // keep the parameters of the epoch with the best dev accuracy, if finite
        let acc = selection_accuracy(kind, &dev);
        let params = trainer.state()?.params;
        self.plateau(epoch, acc)?;
        let trainer = &mut self.s.trainer;
        if let Some(why) = nonfinite_model(trainer.model(), &params, dev.loss) {
            logln!("  epoch {epoch}'s model is not kept: {why}");
        } else if self.s.run.best.is_none_or(|b| acc > b.score) {
            self.s.run.best = Some(Best { score: acc, epoch });
            if let Some(paths) = &self.paths {
                checkpoint::save(&paths.best, trainer.model(), &params, &self.s.data.vocab)?;
            }
            self.s.best = Some(params);
        }
        self.s.run.epochs_done = epoch;
        self.s.run.progress = Default::default();
        Ok(())
    }
}

/// `ramus train`.
pub fn run(a: TrainArgs) -> AnyResult {
    let launched = Instant::now();
    distributed::timeout(a.dist_timeout)?;
    distributed::bucket_bytes(a.bucket_mb)?;
    let launch = distributed::Launch {
        gpus: a.gpus,
        nodes: a.nodes,
        node_rank: a.node_rank,
        master: a.master.as_deref(),
        device: a.device,
    };
    if distributed::launch(&launch)? {
        return Ok(());
    }
    let world = distributed::world(&launch)?;
    if world.as_ref().is_some_and(|w| w.rank > 0) {
        crate::output::quiet_log();
    }
    let (a, from) = resolve(a)?;
    if let Some(path) = &a.save {
        ramus_exec::atomic::check_writable(path, "--save")?;
    }
    a.check_counts()?;
    // only rank 0 writes checkpoints
    let paths = match &world {
        Some(w) if w.rank > 0 => None,
        _ => CheckpointPaths::of(&a)?,
    };
    let setup = setup(&a, from.as_ref(), world.as_ref())?;
    if let Some(from) = &from {
        logln!(
            "resuming {}: epoch {}, batch {}",
            from.path.display(),
            setup.run.epochs_done + 1,
            setup.run.progress.batches
        );
    }
    // on several GPUs every rank pauses on a signal (they agree when),
    // rank 0 saves
    let stop = match (&paths, &world) {
        (Some(_), _) | (None, Some(_)) => Some(stop_flag()?),
        (None, None) => None,
    };
    let started = Instant::now();
    let style =
        ProgressStyle::with_template("epoch {prefix} [{bar:30}] {pos}/{len} {per_sec} loss {msg}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> ");
    let log = match (&a.log_dir, &world) {
        (Some(_), Some(w)) if w.rank > 0 => None,
        (Some(dir), _) => Some(RunLog::open(dir, &log_config(&setup)?, a.log_every)?),
        (None, _) => None,
    };
    let mut run = Run {
        a: &a,
        s: setup,
        paths,
        stop,
        log,
        started: Some(launched),
    };
    for epoch in run.s.run.epochs_done + 1..=a.epochs {
        if !run.epoch(epoch, &style)? {
            return run.stopped();
        }
        run.save_last()?;
        if run.stop_agreed()? {
            return run.stopped();
        }
        if run.patience_ran_out(epoch)? {
            break;
        }
    }
    let saves = world.is_none_or(|w| w.rank == 0);
    finish(&a, run.s, (started, saves), run.log)
}

/// What `config.json` of `--log-dir` records: the command's flags (as
/// typed or defaulted) and what they came to.
fn log_config(s: &Setup) -> AnyResult<serde_json::Value> {
    let (rank, ranks) = s.trainer.engine.ranks();
    Ok(json!({
        "flags": run_config::current()?,
        "model": s.trainer.model().name,
        "parameters": s.trainer.model().params.iter().map(|p| p.shape.iter().product::<usize>()).sum::<usize>(),
        "engine": s.trainer.engine.name(),
        "ranks": ranks,
        "rank": rank,
        "data": s.data.source,
        "graphs": {"train": s.data.train.len(), "dev": s.data.dev.len(), "test": s.data.test.len()},
        "lr": s.lr,
        "lr_schedule": s.schedule.kind.name(),
        "ramus": env!("CARGO_PKG_VERSION"),
    }))
}

/// Puts the best dev epoch's parameters in place, evaluates on test and
/// saves.
fn finish(
    a: &TrainArgs,
    s: Setup,
    (started, saves): (Instant, bool),
    mut log: Option<RunLog>,
) -> AnyResult {
    let Setup {
        kind,
        data,
        mut trainer,
        run,
        best,
        ..
    } = s;
    if let (Some(b), Some(params)) = (run.best, best) {
        if b.epoch != a.epochs {
            logln!(
                "using the parameters of epoch {} (best dev {}acc {:.2}%)",
                b.epoch,
                match kind {
                    DataKind::Images => "",
                    DataKind::Tagged { .. } => "tag ",
                    _ => "root ",
                },
                100.0 * b.score
            );
        }
        let state = trainer.state()?;
        trainer.engine.restore(TrainState { params, ..state })?;
    }
    let test = trainer.evaluate(&data.test, 64)?;
    if let Some(log) = &mut log {
        let record = json!({"test_loss": finite(test.loss),
            "test_root_accuracy": test.root_accuracy, "test_node_accuracy": test.node_accuracy,
            "graphs": test.graphs, "seconds": started.elapsed().as_secs_f64()});
        log.record("test", record)?;
    }
    logln!(
        "test: loss {:.4} {} ({} {}) | trained in {:.1} s",
        test.loss,
        vision::accuracy(kind, &test),
        test.graphs,
        vision::unit(kind).1,
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = a.save.as_ref().filter(|_| saves) {
        let params = trainer.state()?.params;
        if let Some(why) = nonfinite_model(trainer.model(), &params, test.loss) {
            return Err(format!(
                "not saving {}: the model is not finite ({why})",
                path.display()
            )
            .into());
        }
        checkpoint::save(path, trainer.model(), &params, &data.vocab)?;
        logln!("saved {}", path.display());
    }
    Ok(())
}

/// Why a trained model must not be kept or saved: a parameter that is not
/// finite, or a non-finite loss on held-out data; `None` if finite.
fn nonfinite_model(model: &Model, params: &Params<f32>, loss: f64) -> Option<String> {
    match first_nonfinite(model, params, None) {
        Some(p) => Some(format!("parameter {p} is not finite")),
        None if !loss.is_finite() => Some(format!("its loss on held-out data is {loss}")),
        None => None,
    }
}

/// The dev accuracy that picks the best epoch: per-token tag accuracy for
/// the taggers, root (sentence / image) accuracy for the rest.
fn selection_accuracy(kind: DataKind, r: &EvalResult) -> f64 {
    match kind {
        DataKind::Tagged { .. } => r.node_accuracy,
        _ => r.root_accuracy,
    }
}
