//! `ramus train` on several GPUs: `--gpus N` starts N worker processes of
//! this same command on this machine (one per GPU), and a process started
//! by `torchrun`, `srun` or `mpirun` finds its rank in the variables they
//! set (`ramus_dist::world`). Every worker trains its shard of each global
//! batch on GPU `LOCAL_RANK`; rank 0 hands out NCCL's id at the rendezvous
//! on `MASTER_ADDR:MASTER_PORT`, and only rank 0 logs and writes
//! checkpoints. If a worker fails, the launcher stops the others and says
//! which rank failed.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use ramus_core::{Model, Params};
use ramus_cuda::nccl::{self, NcclGroup};
use ramus_cuda::{CudaEngine, CudaEngineOptions, CudaTrainer};
use ramus_dist::rendezvous::exchange_id;
use ramus_dist::World;
use ramus_exec::data_parallel::DataParallel;
use ramus_exec::{OptimizerConfig, TrainEngine};

use crate::device::{Device, TrainEngineChoice};
use crate::output::noteln;
use crate::result::AnyResult;

/// How long the other workers get to stop after one failed.
const GRACE: Duration = Duration::from_secs(5);

/// This process's place in a run of several ranks, if a launcher started
/// it as one; refuses `--gpus` that contradicts it.
pub(crate) fn world(gpus: usize) -> AnyResult<Option<World>> {
    let world = World::from_env().map_err(|e| e.to_string())?;
    if let Some(w) = &world {
        if gpus > 1 && gpus != w.size {
            return Err(format!(
                "--gpus {gpus}, but the launcher started {} ranks (WORLD_SIZE): leave --gpus out \
                 under torchrun, srun or mpirun",
                w.size
            )
            .into());
        }
    }
    Ok(world)
}

/// With `--gpus N` (N > 1) outside a launcher: runs this command as N
/// workers and waits for them; `Ok(true)` when they all succeeded.
/// `Ok(false)`: train in this process.
pub(crate) fn launch(gpus: usize, device: Device) -> AnyResult<bool> {
    if gpus <= 1 || World::from_env().map_err(|e| e.to_string())?.is_some() {
        return Ok(false);
    }
    if device != Device::Cuda {
        return Err(format!("--gpus {gpus} trains on GPUs: add --device cuda").into());
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("--gpus: no free local port for the rendezvous: {e}"))?
        .port();
    let library_path = nccl_library_path()?;
    // the workers share this machine's cores (as torchrun limits OpenMP)
    let threads = std::env::var_os("RAYON_NUM_THREADS").is_none().then(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / gpus).max(1).to_string()
    });
    let exe = std::env::current_exe().map_err(|e| format!("--gpus: this program's path: {e}"))?;
    let mut workers: Vec<Child> = Vec::with_capacity(gpus);
    for rank in 0..gpus {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args_os().skip(1))
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", gpus.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
        if let Some(path) = &library_path {
            cmd.env("LD_LIBRARY_PATH", path);
        }
        if let Some(threads) = &threads {
            cmd.env("RAYON_NUM_THREADS", threads);
        }
        match cmd.spawn() {
            Ok(child) => workers.push(child),
            Err(e) => {
                stop(&mut workers);
                return Err(format!("--gpus: starting worker {rank}: {e}").into());
            }
        }
    }
    wait(workers)?;
    Ok(true)
}

/// Waits for every worker; the first that fails stops the others.
fn wait(mut workers: Vec<Child>) -> AnyResult {
    let mut done = vec![false; workers.len()];
    while done.iter().any(|d| !d) {
        for (rank, child) in workers.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) if status.success() => done[rank] = true,
                Ok(Some(status)) => {
                    stop(&mut workers);
                    return Err(format!(
                        "--gpus: rank {rank} of {} failed ({status}); the other ranks were stopped",
                        done.len()
                    )
                    .into());
                }
                Ok(None) => {}
                Err(e) => return Err(format!("--gpus: waiting for rank {rank}: {e}").into()),
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Gives running workers `GRACE` to end, then kills them.
fn stop(workers: &mut [Child]) {
    let deadline = Instant::now() + GRACE;
    for child in workers.iter_mut() {
        while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        if matches!(child.try_wait(), Ok(None)) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `LD_LIBRARY_PATH` for the workers when `libnccl` is not on the library
/// path but a pip wheel holds it: a directory of ours with the
/// `libnccl.so` link the loader looks for, first on the path.
fn nccl_library_path() -> AnyResult<Option<String>> {
    if nccl::check_library().is_ok() {
        return Ok(None);
    }
    let Some(found) = nccl::wheel_libraries().into_iter().next() else {
        return Err(nccl::check_library()
            .err()
            .map_or_else(|| "libnccl not found".into(), |e| e.to_string())
            .into());
    };
    let dir = std::env::temp_dir().join(format!("ramus-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let link: PathBuf = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&found, &link).map_err(|e| format!("{}: {e}", link.display()))?;
    noteln!("NCCL: {found}");
    let rest = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    Ok(Some(format!("{}:{rest}", dir.display())))
}

/// `--dist-timeout` as a duration; refuses one no one can mean.
pub(crate) fn timeout(seconds: f64) -> AnyResult<Duration> {
    if !(seconds.is_finite() && seconds >= 1.0) {
        return Err(format!("--dist-timeout must be at least 1 second, got {seconds}").into());
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// What a worker trains with.
pub(crate) struct WorkerEngine<'a> {
    pub world: &'a World,
    pub model: &'a Model,
    pub choice: TrainEngineChoice,
    pub swapping: bool,
    pub budget: Option<u64>,
    /// `--dist-timeout`.
    pub timeout: Duration,
}

/// The batched CUDA engine on GPU `LOCAL_RANK`, joined to the other ranks
/// through NCCL, as one rank of a data-parallel run.
pub(crate) fn engine(
    w: WorkerEngine<'_>,
    (params, config): (Params<f32>, OptimizerConfig),
) -> AnyResult<Box<dyn TrainEngine<f32>>> {
    let world = w.world;
    if w.choice == TrainEngineChoice::Persistent || w.swapping {
        return Err(
            "training on several GPUs runs the batched engine: --engine persistent and the swap \
             path train on one GPU"
                .into(),
        );
    }
    let rank = |e: String| format!("rank {} of {}: {e}", world.rank, world.size);
    let mut options = CudaEngineOptions {
        device: world.local_rank,
        ..CudaEngineOptions::default()
    };
    options.pool.max_bytes = w.budget;
    let engine = CudaEngine::new(w.model, &options)
        .map_err(|e| rank(format!("GPU {}: {e}", world.local_rank)))?;
    let trainer = CudaTrainer::new(engine, w.model.clone(), params, config)
        .map_err(|e| rank(e.to_string()))?;
    let mut made = None;
    let id = exchange_id(
        world,
        || match nccl::new_id() {
            Ok(id) => id,
            Err(e) => {
                made = Some(e.to_string());
                Vec::new()
            }
        },
        w.timeout,
    )
    .map_err(|e| rank(e.to_string()))?;
    if let Some(e) = made {
        return Err(rank(e).into());
    }
    let mut group = NcclGroup::join(trainer.device(), world.rank, world.size, &id)
        .map_err(|e| rank(e.to_string()))?;
    group.watch(w.timeout);
    Ok(Box::new(DataParallel::new(trainer, Box::new(group))))
}
