//! Data-parallel training over NCCL, one process per GPU (this test binary
//! started again in a child role): after K steps every rank holds the same
//! parameters, and they are those of one GPU trained with batches of
//! N·B. Skips with a notice without two GPUs or without `libnccl`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use ramus_conformance::close::{assert_close, assert_close_value, Tolerance};
use ramus_conformance::zoo::{batch, Case};
use ramus_cuda::nccl::{check_library, new_id, NcclGroup};
use ramus_cuda::persistent::{PersistentOptions, PersistentTrainer};
use ramus_cuda::{CudaDevice, CudaEngine, CudaEngineOptions, CudaTrainer};
use ramus_cuda::{SwapConfig, SwapMode, SwapTrainer};
use ramus_dist::rendezvous::exchange_id;
use ramus_dist::{Shard, World};
use ramus_exec::data_parallel::{Collective, DataParallel, SplitStep, StepPlan};
use ramus_exec::{Batch, OptimizerConfig, OptimizerKind, TrainEngine};
use ramus_graph::InputGraph;

const ROLE: &str = "RAMUS_TEST_DATA_PARALLEL_ROLE";
const GRAPHS: usize = 37;
const PER_RANK: usize = 4;
/// Steps submitted together, as the trainer's windows.
const WINDOW: usize = 3;

/// f32 sums in another order (NCCL's ring against one GPU's kernels).
const REORDERED: Tolerance = Tolerance::tensor(2e-4);

fn config(kind: &str) -> OptimizerConfig {
    let kind = match kind {
        "sgd" => OptimizerKind::Sgd,
        _ => OptimizerKind::Adam,
    };
    OptimizerConfig {
        eps: 1e-4,
        weight_decay: 0.1,
        ..OptimizerConfig::new(kind, 1e-2)
    }
}

/// The model `kind` trains and its epoch's order: a Tree-LSTM, or (kind
/// `resnet-sync`) a ResNet on 33 images, whose last global step of one
/// image leaves every rank but the first without rows.
fn case(kind: &str) -> (Case, Vec<usize>) {
    let (name, graphs) = match kind {
        "resnet-sync" => ("resnet", 33),
        _ => ("treelstm", GRAPHS),
    };
    let case = Case::new(name, graphs, 1, 17).unwrap();
    let mut order: Vec<usize> = (0..graphs).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(3));
    (case, order)
}

fn trainer(case: &Case, ordinal: usize, kind: &str) -> CudaTrainer {
    let options = CudaEngineOptions {
        device: ordinal,
        ..CudaEngineOptions::default()
    };
    let engine = CudaEngine::new(&case.model, &options).unwrap();
    CudaTrainer::new(engine, case.model.clone(), case.params(5), config(kind)).unwrap()
}

/// Parameters, flattened, then the losses: what a rank writes.
fn save(path: &Path, params: &[f32], losses: &[f64]) {
    let mut bytes: Vec<u8> = (params.len() as u64).to_le_bytes().to_vec();
    bytes.extend(params.iter().flat_map(|x| x.to_le_bytes()));
    bytes.extend(losses.iter().flat_map(|x| x.to_le_bytes()));
    std::fs::write(path, bytes).unwrap();
}

fn load(path: &Path) -> (Vec<f32>, Vec<f64>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let params = bytes[8..8 + 4 * n]
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let losses = bytes[8 + 4 * n..]
        .chunks(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (params, losses)
}

fn flat(state: &ramus_exec::TrainState<f32>) -> Vec<f32> {
    state
        .params
        .values
        .iter()
        .flat_map(|t| t.data().iter().copied())
        .collect()
}

/// Child role: rank `RANK` of `WORLD` on GPU `RANK`, trains its shards and
/// writes its parameters and losses; with kind `hang`, rank 0 waits on a
/// collective that rank 1 never joins and writes the error it gets.
#[test]
fn child_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let v: Vec<&str> = role.split(' ').collect();
    let (rank, world, port): (usize, usize, u16) = (
        v[0].parse().unwrap(),
        v[1].parse().unwrap(),
        v[2].parse().unwrap(),
    );
    let (kind, out) = (v[3], PathBuf::from(v[4]));
    let w = World {
        rank,
        size: world,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    };
    let id = exchange_id(&w, || new_id().unwrap(), Duration::from_secs(60)).unwrap();
    if kind == "hang" {
        let device = CudaDevice::open(rank).unwrap();
        let mut group = NcclGroup::join(&device, rank, world, &id).unwrap();
        group.watch(Duration::from_secs(3));
        if rank > 0 {
            std::thread::sleep(Duration::from_secs(120));
            return;
        }
        let started = std::time::Instant::now();
        let err = group.sum_scalars(&mut [1.0]).unwrap_err();
        let took = started.elapsed().as_secs_f64();
        std::fs::write(&out, format!("{took:.1} {err}")).unwrap();
        return;
    }
    let (case, order) = case(kind);
    let shards = Shards {
        case: &case,
        order: &order,
        rank,
        world,
    };
    let (params, losses) = if kind == "persistent" {
        let options = PersistentOptions {
            device: rank,
            ..PersistentOptions::default()
        };
        let mut trainer =
            PersistentTrainer::new(&case.model, &case.params(5), config(kind), &options).unwrap();
        trainer.split_updates().unwrap();
        let group = NcclGroup::join(trainer.persistent().device(), rank, world, &id).unwrap();
        shards.train(DataParallel::new(trainer, Box::new(group)))
    } else if kind == "swap" {
        // op by op, every tensor freed after its last use
        let options = CudaEngineOptions {
            device: rank,
            ..CudaEngineOptions::default()
        };
        let swap = SwapConfig::with_mode(SwapMode::Naive);
        let (model, params) = (case.model.clone(), case.params(5));
        let trainer = SwapTrainer::new(model, &options, swap, params, config(kind)).unwrap();
        let group = NcclGroup::join(trainer.engine().device(), rank, world, &id).unwrap();
        shards.train(DataParallel::new(trainer, Box::new(group)))
    } else {
        let mut trainer = trainer(&case, rank, kind);
        let group = NcclGroup::join(trainer.device(), rank, world, &id).unwrap();
        if kind == "resnet-sync" {
            trainer.sync_batch_norm(group.handle().unwrap()).unwrap();
        }
        shards.train(DataParallel::new(trainer, Box::new(group)))
    };
    save(&out, &params, &losses);
}

/// A rank's shards of the case's batches.
struct Shards<'a> {
    case: &'a Case,
    order: &'a [usize],
    rank: usize,
    world: usize,
}

impl Shards<'_> {
    /// Trains `dp` on this rank's shards, submitted a window of steps at a
    /// time as the trainer does (the steps overlap, the persistent engine
    /// prepares each window at once): its parameters and step losses.
    fn train<E: SplitStep<f32>>(&self, mut dp: DataParallel<f32, E>) -> (Vec<f32>, Vec<f64>) {
        let shard = Shard::new(self.rank, self.world).unwrap();
        let global: Vec<&[usize]> = self.order.chunks(PER_RANK * self.world).collect();
        let parts = shard.batches(self.order, PER_RANK).unwrap();
        let of = |ids: &[usize]| -> Vec<&InputGraph> {
            ids.iter().map(|&i| &self.case.graphs[i]).collect()
        };
        let mut outcomes = Vec::new();
        for (steps, window) in global.chunks(WINDOW).zip(parts.chunks(WINDOW)) {
            let plans = steps.iter().map(|s| StepPlan::of(&self.case.model, &of(s)));
            dp.set_step_plans(plans.collect::<Result<_, _>>().unwrap())
                .unwrap();
            let batches: Vec<Option<Batch>> = window
                .iter()
                .map(|part| (!part.is_empty()).then(|| batch(&self.case.model, &of(part))))
                .collect();
            if batches.iter().all(Option::is_some) {
                let all: Vec<Batch> = batches.into_iter().flatten().collect();
                outcomes.extend(dp.submit(&all).unwrap());
                continue;
            }
            for b in &batches {
                outcomes.extend(match b {
                    Some(b) => dp.submit(std::slice::from_ref(b)).unwrap(),
                    None => dp.submit_idle().unwrap(),
                });
            }
        }
        outcomes.extend(dp.finish().unwrap());
        let losses = outcomes.into_iter().map(|o| o.unwrap()).collect();
        (flat(&dp.state().unwrap()), losses)
    }
}

/// `world` ranks of this test binary in the child role, writing to
/// `dir/RANK`, with `env` set in each.
fn spawn_ranks(world: usize, kind: &str, dir: &Path, env: &[(&str, &str)]) -> Vec<Child> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    (0..world)
        .map(|r| {
            let out = dir.join(r.to_string());
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "child_role", "--nocapture", "--test-threads=1"])
                .env(ROLE, format!("{r} {world} {port} {kind} {}", out.display()))
                .env("NCCL_NVLS_ENABLE", "0")
                .envs(env.iter().copied())
                .spawn()
                .unwrap()
        })
        .collect()
}

fn ready(world: usize) -> bool {
    if !common::cuda_ready("skipping data-parallel tests") {
        return false;
    }
    if let Err(e) = CudaDevice::probe(world - 1) {
        eprintln!("skipping data-parallel test on {world} GPUs: {e}");
        return false;
    }
    if let Err(e) = check_library() {
        eprintln!("skipping data-parallel tests: {e}");
        return false;
    }
    true
}

fn check(world: usize, kind: &str) {
    check_with(world, kind, &[]);
}

/// [`check`] with `env` set in every rank's process.
fn check_with(world: usize, kind: &str, env: &[(&str, &str)]) {
    if !ready(world) {
        return;
    }
    let dir = std::env::temp_dir().join(format!(
        "ramus-dp-{}-{world}-{kind}-{}",
        std::process::id(),
        env.len()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let children = spawn_ranks(world, kind, &dir, env);
    for (r, mut c) in children.into_iter().enumerate() {
        let status = c.wait().unwrap();
        assert!(status.success(), "rank {r} of {world} failed: {status}");
    }
    // one GPU with batches of N·B over the same order
    let (case, order) = case(kind);
    let mut single = trainer(&case, 0, kind);
    let want_losses: Vec<f64> = order
        .chunks(world * PER_RANK)
        .map(|chunk| {
            let graphs: Vec<&InputGraph> = chunk.iter().map(|&i| &case.graphs[i]).collect();
            single.train_step(&batch(&case.model, &graphs)).unwrap()
        })
        .collect();
    let want = single.state().unwrap();
    let (first, _) = load(&dir.join("0"));
    for r in 0..world {
        let (params, losses) = load(&dir.join(format!("{r}")));
        let what = format!("{world} GPUs, {kind}, rank {r}");
        assert_eq!(params, first, "{what}: parameters differ from rank 0's");
        for (step, (w, g)) in want_losses.iter().zip(&losses).enumerate() {
            assert_close_value(
                &format!("{what}: loss {step}"),
                *w,
                *g,
                Tolerance::element(1e-3),
            );
        }
        let mut at = 0;
        for (p, spec) in case.model.params.iter().enumerate() {
            let w = want.params.values[p].data();
            assert_close(
                &format!("{what}: {}", spec.name),
                w,
                &params[at..at + w.len()],
                REORDERED,
            );
            at += w.len();
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank that never reaches a collective: the other's watchdog aborts the
/// communicator after its timeout and the waiting call fails, saying why.
#[test]
fn a_hung_rank_is_given_up_on_after_the_timeout() {
    if !ready(2) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ramus-dp-hang-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut children = spawn_ranks(2, "hang", &dir, &[]);
    let zero = children[0].wait().unwrap();
    let _ = children[1].kill();
    let _ = children[1].wait();
    assert!(zero.success(), "rank 0: {zero}");
    let report = std::fs::read_to_string(dir.join("0")).unwrap();
    let took: f64 = report.split(' ').next().unwrap().parse().unwrap();
    assert!(
        report.contains("no collective finished for 3 s"),
        "rank 0 reported: {report}"
    );
    assert!(
        (2.5..20.0).contains(&took),
        "gave up after {took} s: {report}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// One GPU as a group of one: the split steps (sums through NCCL, the
/// loss summed on the device, steps overlapping) train as the engine alone.
#[test]
fn a_group_of_one_trains_as_the_engine_alone() {
    check(1, "adam");
    check(1, "persistent");
    check(1, "swap");
    check(1, "resnet-sync");
}

/// Synchronized batch norm: the ranks' statistics (and so their steps
/// and running statistics) are those of one GPU at N·B images, also in the
/// last step, where ranks without an image sum zeros in their stead.
#[test]
fn synchronized_batch_norm_on_two_and_four_gpus_trains_as_one() {
    check(2, "resnet-sync");
    check(4, "resnet-sync");
}

#[test]
fn two_gpus_train_as_one_with_twice_the_batch() {
    check(2, "sgd");
    check(2, "adam");
}

/// Two machines simulated on one: NCCL kept off NVLink and shared memory,
/// so the ranks talk over its socket transport as across a network.
#[test]
fn two_gpus_over_sockets_train_as_one() {
    let sockets = [("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")];
    check_with(2, "adam", &sockets);
}

/// The persistent engine's kernel leaves the gradients in its pool; their
/// sum is updated outside it: the same steps as the batched engine on one
/// GPU at twice the batch.
#[test]
fn the_persistent_engine_on_two_gpus_trains_as_one() {
    check(2, "persistent");
}

/// The swap path's op-by-op steps end in the batched engine's summed
/// update: the same steps as the plain engine on one GPU.
#[test]
fn the_swap_path_on_two_gpus_trains_as_one() {
    check(2, "swap");
}

#[test]
fn four_gpus_train_as_one_with_four_times_the_batch() {
    check(4, "adam");
    check(4, "persistent");
    check(4, "swap");
}
