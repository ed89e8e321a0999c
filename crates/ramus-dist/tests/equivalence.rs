//! N ranks with batches of B graphs take the steps of one run with batches
//! of N·B: the CPU engine trained data-parallel over a local group (one
//! thread a rank), against the CPU engine alone, in f64 so that only the
//! order of sums differs. Every rank must end with the same parameters,
//! and those must be the single run's.

use std::time::Duration;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use ramus_conformance::close::{assert_close, assert_close_value, Tolerance};
use ramus_conformance::zoo::{batch, with_nan_pixel, Case};
use ramus_cpu::CpuTrainer;
use ramus_dist::{local_group, Shard};
use ramus_exec::data_parallel::{Collective, DataParallel, StepPlan};
use ramus_exec::{OptimizerConfig, OptimizerKind, TrainEngine, TrainState};
use ramus_graph::InputGraph;

/// f64 sums of a few hundred terms in another order.
const REORDERED_F64: Tolerance = Tolerance::element(1e-11);

struct Run {
    losses: Vec<f64>,
    state: TrainState<f64>,
}

fn config(kind: OptimizerKind) -> OptimizerConfig {
    OptimizerConfig {
        eps: 1e-4,
        weight_decay: 0.1,
        ..OptimizerConfig::new(kind, 1e-3)
    }
}

fn single(case: &Case, order: &[usize], batch_size: usize, config: OptimizerConfig) -> Run {
    let mut engine = CpuTrainer::new(case.model.clone(), case.params(5).cast::<f64>(), config);
    let losses = order
        .chunks(batch_size)
        .map(|chunk| {
            let graphs: Vec<&InputGraph> = chunk.iter().map(|&i| &case.graphs[i]).collect();
            engine.train_step(&batch(&case.model, &graphs)).unwrap()
        })
        .collect();
    Run {
        losses,
        state: engine.state().unwrap(),
    }
}

/// How the ranks of a test run train.
#[derive(Clone, Copy)]
struct Ranks {
    world: usize,
    per_rank: usize,
    /// Synchronized batch normalisation.
    sync_bn: bool,
}

fn data_parallel(case: &Case, order: &[usize], ranks: Ranks, config: OptimizerConfig) -> Vec<Run> {
    let Ranks {
        world, per_rank, ..
    } = ranks;
    let group = local_group::<f64>(world, Duration::from_secs(60));
    std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(r, rank)| {
                s.spawn(move || {
                    let model = &case.model;
                    let mut engine = CpuTrainer::new(model.clone(), case.params(5).cast(), config);
                    if ranks.sync_bn {
                        let handle = rank.handle().unwrap();
                        engine.engine_mut().sync_batch_norm(handle);
                    }
                    let mut dp = DataParallel::new(engine, Box::new(rank));
                    let shard = Shard::new(r, world).unwrap();
                    let global = order.chunks(world * per_rank);
                    let losses = shard
                        .batches(order, per_rank)
                        .unwrap()
                        .iter()
                        .zip(global)
                        .map(|(part, step)| {
                            let of = |ids: &[usize]| -> Vec<&InputGraph> {
                                ids.iter().map(|&i| &case.graphs[i]).collect()
                            };
                            let plan = StepPlan::of(model, &of(step)).unwrap();
                            let graphs = of(part);
                            let b = (!graphs.is_empty()).then(|| batch(model, &graphs));
                            dp.step_shard(b.as_ref(), &plan).unwrap()
                        })
                        .collect();
                    Run {
                        losses,
                        state: dp.state().unwrap(),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `graphs` graphs of model `name` in a shuffled order, trained by
/// `world` ranks of `per_rank` graphs and by one engine of
/// `world × per_rank`.
fn check(name: &'static str, graphs: usize, world: usize, per_rank: usize) {
    let ranks = Ranks {
        world,
        per_rank,
        sync_bn: false,
    };
    check_ranks(name, graphs, ranks);
}

/// [`check`] with `ranks`; with synchronized batch norm the running
/// statistics too must be the single run's.
fn check_ranks(name: &'static str, graphs: usize, ranks: Ranks) {
    let Ranks {
        world, per_rank, ..
    } = ranks;
    let case = Case::new(name, graphs, 1, 17).unwrap();
    let mut order: Vec<usize> = (0..graphs).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(3));
    for kind in [OptimizerKind::Sgd, OptimizerKind::Adam] {
        let what = format!("{name}, {world} ranks × {per_rank}, {kind:?}");
        let want = single(&case, &order, world * per_rank, config(kind));
        let runs = data_parallel(&case, &order, ranks, config(kind));
        for (r, got) in runs.iter().enumerate() {
            assert_eq!(got.losses.len(), want.losses.len(), "{what}: steps");
            for (step, (w, g)) in want.losses.iter().zip(&got.losses).enumerate() {
                assert_close_value(
                    &format!("{what}: rank {r} loss {step}"),
                    *w,
                    *g,
                    REORDERED_F64,
                );
            }
            assert_eq!(
                got.state.optimizer.steps(),
                want.state.optimizer.steps(),
                "{what}: rank {r} optimizer steps"
            );
            for (p, spec) in case.model.params.iter().enumerate() {
                let g = got.state.params.values[p].data();
                let w = want.state.params.values[p].data();
                let label = format!("{what}: rank {r} {}", spec.name);
                if case.model.is_buffer(p) && !ranks.sync_bn {
                    continue;
                }
                assert_close(&label, w, g, REORDERED_F64);
                // every rank holds the same sums: the replicas are identical
                assert_eq!(
                    g,
                    runs[0].state.params.values[p].data(),
                    "{label} vs rank 0"
                );
            }
        }
        let moved = (0..case.model.params.len()).any(|p| {
            want.state.params.values[p].data() != case.params(5).cast::<f64>().values[p].data()
        });
        assert!(moved, "{what}: training moved no parameter");
    }
}

#[test]
fn tree_lstm_on_two_and_four_ranks() {
    // 19 graphs: full global steps, then a short one where some ranks get none
    check("treelstm", 19, 2, 4);
    check("treelstm", 19, 4, 2);
}

#[test]
fn tagger_with_embedding_rows_on_three_ranks() {
    // each rank touches other rows of the embedding tables
    check("bilstm-char-tagger", 14, 3, 2);
}

#[test]
fn language_model_whose_ranks_have_different_row_counts() {
    // sentences of different lengths: a rank's loss averages other counts
    check("lstm-lm", 12, 2, 3);
}

#[test]
fn cnn_without_batch_norm() {
    check("alexnet", 9, 2, 2);
}

/// Synchronized batch norm: ranks normalise with the statistics of every
/// rank's images, so N ranks of B take the steps of one run of N·B, its
/// running statistics included. 9 images, 2 ranks of 2: the last step's
/// one image leaves rank 1 without rows, which sums zeros in its stead.
#[test]
fn resnet_with_synchronized_batch_norm() {
    let ranks = Ranks {
        world: 2,
        per_rank: 2,
        sync_bn: true,
    };
    check_ranks("resnet", 9, ranks);
    check_ranks("resnet", 7, Ranks { world: 3, ..ranks });
}

/// The training loop's epochs on N ranks (each its shard, the last global
/// batch short) take the single run's steps, and evaluation sharded over
/// the ranks gives the single run's accuracies.
#[test]
fn trainer_epochs_and_sharded_evaluation_match_one_rank() {
    use ramus_nn::train::{rng, Trainer};
    let case = Case::new("treelstm", 23, 1, 17).unwrap();
    let (world, per_rank, epochs) = (3, 2, 2);
    let cfg = config(OptimizerKind::Adam);
    let train = |engine: Box<dyn TrainEngine<f64>>, batch_size: usize| {
        let mut trainer = Trainer::with_engine(engine);
        let mut shuffle = rng(11);
        for _ in 0..epochs {
            trainer
                .train_epoch(&case.graphs, batch_size, &mut shuffle, |_, _, _| {})
                .unwrap();
        }
        let eval = trainer.evaluate(&case.graphs, 5).unwrap();
        (trainer.state().unwrap(), eval)
    };
    let single = CpuTrainer::new(case.model.clone(), case.params(5).cast(), cfg);
    let (want, want_eval) = train(Box::new(single), world * per_rank);
    let ranks = local_group::<f64>(world, Duration::from_secs(60));
    let runs: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let train = &train;
                let case = &case;
                s.spawn(move || {
                    let engine = CpuTrainer::new(case.model.clone(), case.params(5).cast(), cfg);
                    train(
                        Box::new(DataParallel::new(engine, Box::new(rank))),
                        per_rank,
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (state, eval)) in runs.iter().enumerate() {
        for (p, spec) in case.model.params.iter().enumerate() {
            let label = format!("rank {r} of {world}, {} after {epochs} epochs", spec.name);
            let (w, g) = (want.params.values[p].data(), state.params.values[p].data());
            assert_close(&label, w, g, REORDERED_F64);
        }
        assert_eq!(eval.root_accuracy, want_eval.root_accuracy, "rank {r}");
        assert_eq!(eval.node_accuracy, want_eval.node_accuracy, "rank {r}");
        assert_eq!(eval.graphs, want_eval.graphs);
        assert_close_value("dev loss", want_eval.loss, eval.loss, REORDERED_F64);
    }
}

/// A run paused on two ranks mid-epoch and resumed on one (its run state
/// rebased): the epoch's first steps took two ranks' batches, the rest one
/// rank's, and the parameters are those of one rank taking exactly those
/// batches.
#[test]
fn a_run_paused_on_two_ranks_goes_on_on_one() {
    use ramus_nn::resume::RunState;
    use ramus_nn::train::{rng, shuffled_order, EpochProgress, Pauses, Span, SpanEnd, Trainer};
    let case = Case::new("treelstm", 23, 1, 17).unwrap();
    let (world, per_rank, pause) = (2, 3, 2);
    let cfg = config(OptimizerKind::Adam);
    let order = shuffled_order(case.graphs.len(), &mut rng(11));
    let engine = || CpuTrainer::new(case.model.clone(), case.params(5).cast(), cfg);
    // one rank taking `pause` batches of world·per_rank, then per_rank
    let split = pause * world * per_rank;
    let mut single = engine();
    let first = order[..split].chunks(world * per_rank);
    for chunk in first.chain(order[split..].chunks(per_rank)) {
        let graphs: Vec<&InputGraph> = chunk.iter().map(|&i| &case.graphs[i]).collect();
        single.train_step(&batch(&case.model, &graphs)).unwrap();
    }
    let want = single.state().unwrap();
    let ranks = local_group::<f64>(world, Duration::from_secs(60));
    let mut paused: Vec<(TrainState<f64>, EpochProgress)> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let (engine, order, graphs) = (&engine, &order, &case.graphs);
                s.spawn(move || {
                    let dp = DataParallel::new(engine(), Box::new(rank));
                    let mut trainer = Trainer::with_engine(Box::new(dp));
                    let span = Span {
                        data: graphs,
                        order,
                        batch_size: per_rank,
                        rates: None,
                    };
                    let pauses = Pauses {
                        every: Some(pause),
                        requested: &|| false,
                    };
                    let mut at = EpochProgress::default();
                    let end = trainer.train_span(&span, &mut at, &pauses, |_, _, _| {});
                    assert_eq!(end.unwrap(), SpanEnd::Checkpoint);
                    (trainer.state().unwrap(), at)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (state, progress) = paused.swap_remove(0);
    assert_eq!(progress.batches, pause);
    let mut run = RunState {
        epochs_done: 0,
        progress,
        shuffle: rng(11),
        dropout: rng(11),
        best: None,
        config: Default::default(),
        data: String::new(),
        ranks: world,
        plateau: Default::default(),
    };
    assert_eq!(run.rebase(1, per_rank, order.len()), Some(split));
    assert_eq!(run.rebase(1, per_rank, order.len()), None);
    let mut resumed = engine();
    resumed.restore(state).unwrap();
    let mut trainer = Trainer::with_engine(Box::new(resumed));
    let span = Span {
        data: &case.graphs,
        order: &order[run.progress.skip..],
        batch_size: per_rank,
        rates: None,
    };
    let end = trainer.train_span(&span, &mut run.progress, &Pauses::default(), |_, _, _| {});
    assert_eq!(end.unwrap(), SpanEnd::EpochDone);
    assert_eq!(
        run.progress.batches,
        (order.len() - split).div_ceil(per_rank)
    );
    let got = trainer.state().unwrap();
    for (p, spec) in case.model.params.iter().enumerate() {
        let (w, g) = (want.params.values[p].data(), got.params.values[p].data());
        assert_close(spec.name.as_str(), w, g, REORDERED_F64);
    }
}

/// Batch norm on two ranks: each rank's running statistics follow its own
/// batches; an evaluation first makes them their mean over the ranks, so
/// that every rank holds the same model, and the sharded evaluation equals
/// one engine's evaluation of that model.
#[test]
fn batch_norm_statistics_are_averaged_before_an_evaluation() {
    use ramus_nn::train::{evaluate, EpochProgress, Pauses, Span, Trainer};
    let case = Case::new("resnet", 4, 2, 17).unwrap();
    let (world, per_rank) = (2, 2);
    let cfg = config(OptimizerKind::Adam);
    let order: Vec<usize> = (0..case.graphs.len()).rev().collect();
    let engine = || CpuTrainer::new(case.model.clone(), case.params(5).cast(), cfg);
    let ranks = local_group::<f64>(world, Duration::from_secs(60));
    type Rank = (
        TrainState<f64>,
        TrainState<f64>,
        ramus_nn::train::EvalResult,
    );
    let runs: Vec<Rank> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let (engine, order, graphs) = (&engine, &order, &case.graphs);
                s.spawn(move || {
                    let dp = DataParallel::new(engine(), Box::new(rank));
                    let mut trainer = Trainer::with_engine(Box::new(dp));
                    let span = Span {
                        data: graphs,
                        order,
                        batch_size: per_rank,
                        rates: None,
                    };
                    let mut at = EpochProgress::default();
                    let pauses = Pauses::default();
                    trainer
                        .train_span(&span, &mut at, &pauses, |_, _, _| {})
                        .unwrap();
                    let before = trainer.state().unwrap();
                    let eval = trainer.evaluate(graphs, 3).unwrap();
                    (before, trainer.state().unwrap(), eval)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let buffers: Vec<usize> = (0..case.model.params.len())
        .filter(|&p| case.model.is_buffer(p))
        .collect();
    assert!(!buffers.is_empty(), "the ResNet has running statistics");
    let values = |s: &TrainState<f64>, p: usize| s.params.values[p].data().to_vec();
    let (b0, b1) = (&runs[0].0, &runs[1].0);
    assert!(
        buffers.iter().any(|&p| values(b0, p) != values(b1, p)),
        "the ranks' statistics differ before they are averaged"
    );
    for &p in &buffers {
        let mean: Vec<f64> = values(b0, p)
            .iter()
            .zip(values(b1, p))
            .map(|(a, b)| (a + b) / 2.0)
            .collect();
        for (r, run) in runs.iter().enumerate() {
            let name = format!("rank {r}: {}", case.model.params[p].name);
            assert_close(&name, &mean, run.1.params.values[p].data(), REORDERED_F64);
        }
    }
    for p in 0..case.model.params.len() {
        assert_eq!(values(&runs[0].1, p), values(&runs[1].1, p), "param {p}");
    }
    let mut alone = engine();
    alone.restore(runs[0].1.clone()).unwrap();
    let want = evaluate::<f64>(&mut alone, Default::default(), &case.graphs, 3).unwrap();
    for (_, _, eval) in &runs {
        assert_eq!(eval.root_accuracy, want.root_accuracy);
        assert_close_value("eval loss", want.loss, eval.loss, REORDERED_F64);
    }
}

/// A stop asked of one rank only (a signal that reached rank 0): the ranks
/// agree on it every `AGREE_EVERY` windows and all pause at the same batch,
/// instead of one pausing while the others wait for it at their next step.
#[test]
fn a_stop_asked_of_one_rank_pauses_every_rank_at_the_same_batch() {
    use ramus_nn::train::{EpochProgress, Pauses, Span, SpanEnd, Trainer, AGREE_EVERY};
    let case = Case::new("treelstm", 40, 1, 17).unwrap();
    let (world, per_rank) = (2, 2);
    let cfg = config(OptimizerKind::Sgd);
    let order: Vec<usize> = (0..case.graphs.len()).collect();
    let engine = || CpuTrainer::new(case.model.clone(), case.params(5).cast(), cfg);
    let ranks = local_group::<f64>(world, Duration::from_secs(60));
    let runs: Vec<(SpanEnd, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(r, rank)| {
                let (engine, order, graphs) = (&engine, &order, &case.graphs);
                s.spawn(move || {
                    let dp = DataParallel::new(engine(), Box::new(rank));
                    let mut trainer = Trainer::with_engine(Box::new(dp));
                    let span = Span {
                        data: graphs,
                        order,
                        batch_size: per_rank,
                        rates: None,
                    };
                    let asked = move || r == 0;
                    let pauses = Pauses {
                        every: None,
                        requested: &asked,
                    };
                    let mut at = EpochProgress::default();
                    let end = trainer.train_span(&span, &mut at, &pauses, |_, _, _| {});
                    (end.unwrap(), at.batches)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, &(end, batches)) in runs.iter().enumerate() {
        assert_eq!(end, SpanEnd::Requested, "rank {r}");
        assert_eq!(batches, AGREE_EVERY, "rank {r}");
    }
}

/// Gradient accumulation: K batches of B graphs a step take the steps of
/// one engine with batches of K·B, alone (a group of one) and on two
/// ranks (K·2·B), with each batch's rows weighing as in the big batch
/// (the language model's batches have other numbers of rows), the last
/// step of each epoch short.
#[test]
fn accumulated_batches_take_the_steps_of_one_big_batch() {
    use ramus_exec::data_parallel::Alone;
    use ramus_nn::train::{rng, Trainer};
    for name in ["treelstm", "lstm-lm", "bilstm-char-tagger"] {
        let case = Case::new(name, 23, 1, 17).unwrap();
        let (k, per_batch, epochs) = (3, 2, 2);
        let cfg = config(OptimizerKind::Adam);
        let train = |engine: Box<dyn TrainEngine<f64>>, batch_size: usize, accumulate: usize| {
            let mut trainer = Trainer::with_engine(engine);
            trainer.accumulate = accumulate;
            let mut shuffle = rng(11);
            let losses: Vec<f64> = (0..epochs)
                .map(|_| {
                    trainer
                        .train_epoch(&case.graphs, batch_size, &mut shuffle, |_, _, _| {})
                        .unwrap()
                })
                .collect();
            (trainer.state().unwrap(), losses)
        };
        let engine = || CpuTrainer::new(case.model.clone(), case.params(5).cast(), cfg);
        let check =
            |what: &str, want: &(TrainState<f64>, Vec<f64>), got: &(TrainState<f64>, Vec<f64>)| {
                assert_eq!(
                    got.0.optimizer.steps(),
                    want.0.optimizer.steps(),
                    "{name}, {what}: steps"
                );
                for (p, spec) in case.model.params.iter().enumerate() {
                    let label = format!("{name}, {what}: {}", spec.name);
                    let (w, g) = (
                        want.0.params.values[p].data(),
                        got.0.params.values[p].data(),
                    );
                    assert_close(&label, w, g, REORDERED_F64);
                }
                for (e, (w, g)) in want.1.iter().zip(&got.1).enumerate() {
                    assert_close_value(
                        &format!("{name}, {what}: epoch {e} loss"),
                        *w,
                        *g,
                        REORDERED_F64,
                    );
                }
            };
        let want = train(Box::new(engine()), k * per_batch, 1);
        let alone = train(
            Box::new(DataParallel::new(engine(), Box::new(Alone))),
            per_batch,
            k,
        );
        check("alone", &want, &alone);
        let want = train(Box::new(engine()), 2 * k * per_batch, 1);
        let ranks = local_group::<f64>(2, Duration::from_secs(60));
        let runs: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|rank| {
                    let (train, engine) = (&train, &engine);
                    s.spawn(move || {
                        train(
                            Box::new(DataParallel::new(engine(), Box::new(rank))),
                            per_batch,
                            k,
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, run) in runs.iter().enumerate() {
            check(&format!("rank {r} of 2"), &want, run);
        }
    }
}

/// Under gradient accumulation each batch's forward pass blends its
/// statistics into the running ones, as the CUDA engines (and PyTorch)
/// do: at a learning rate of 0, one step of two batches leaves the running
/// statistics of two steps of one batch each.
#[test]
fn accumulated_batches_each_blend_their_running_statistics() {
    use ramus_exec::data_parallel::Alone;
    let case = Case::new("resnet", 8, 1, 17).unwrap();
    let of = |ids: std::ops::Range<usize>| -> Vec<&InputGraph> {
        ids.map(|i| &case.graphs[i]).collect()
    };
    let (first, second) = (batch(&case.model, &of(0..4)), batch(&case.model, &of(4..8)));
    let cfg = OptimizerConfig::new(OptimizerKind::Sgd, 0.0);
    let engine = || CpuTrainer::new(case.model.clone(), case.params(5).cast::<f64>(), cfg);
    let mut steps = engine();
    steps.train_step(&first).unwrap();
    steps.train_step(&second).unwrap();
    let mut dp = DataParallel::new(engine(), Box::new(Alone));
    let plan = StepPlan::of(&case.model, &of(0..8)).unwrap();
    let earlier = StepPlan {
        last: false,
        ..plan.clone()
    };
    dp.step(Some(&first), &earlier).unwrap();
    dp.step_shard(Some(&second), &plan).unwrap();
    let (want, got) = (steps.state().unwrap(), dp.state().unwrap());
    let start = case.params(5).cast::<f64>();
    let buffers: Vec<usize> = (0..case.model.params.len())
        .filter(|&p| case.model.is_buffer(p))
        .collect();
    for &p in &buffers {
        let name = &case.model.params[p].name;
        let w = want.params.values[p].data();
        assert_ne!(w, start.values[p].data(), "{name} did not move");
        assert_eq!(w, got.params.values[p].data(), "{name}");
    }
    // a step skipped as not finite (a NaN pixel in its second batch) puts
    // back the statistics of before its first
    let broken = with_nan_pixel(&case.graphs[4]);
    let mut nan = of(5..8);
    nan.insert(0, &broken);
    let before = dp.state().unwrap();
    dp.step(Some(&first), &earlier).unwrap();
    let skipped = dp.step_shard(Some(&batch(&case.model, &nan)), &plan);
    assert!(skipped.is_err(), "a NaN pixel gave {skipped:?}");
    let after = dp.state().unwrap();
    for &p in &buffers {
        let name = &case.model.params[p].name;
        let (b, a) = (
            before.params.values[p].data(),
            after.params.values[p].data(),
        );
        assert_eq!(b, a, "{name} after a skipped step");
    }
}
