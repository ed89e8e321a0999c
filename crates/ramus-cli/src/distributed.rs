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
use std::sync::Arc;
use std::time::{Duration, Instant};

use ramus_core::{Model, Params};
use ramus_cuda::nccl::{self, NcclGroup};
use ramus_cuda::persistent::{PersistentOptions, PersistentTrainer};
use ramus_cuda::{CudaDevice, CudaEngine, CudaEngineOptions, CudaTrainer};
use ramus_cuda::{SwapConfig, SwapMode, SwapTrainer};
use ramus_dist::rendezvous::exchange_id;
use ramus_dist::World;
use ramus_exec::data_parallel::{Collective, DataParallel};
use ramus_exec::{OptimizerConfig, TrainEngine};

use crate::device::{Device, TrainEngineChoice};
use crate::output::noteln;
use crate::result::AnyResult;

/// How long the other workers get to stop after one failed.
const GRACE: Duration = Duration::from_secs(5);

/// Where and how a `ramus train` command line runs: `--gpus`, `--nodes`,
/// `--node-rank`, `--master`, `--device`.
pub(crate) struct Launch<'a> {
    pub gpus: usize,
    pub nodes: usize,
    pub node_rank: usize,
    pub master: Option<&'a str>,
    pub device: Device,
}

impl Launch<'_> {
    /// The ranks of the whole run.
    fn ranks(&self) -> usize {
        self.gpus * self.nodes
    }

    /// Node 0's address and port: `--master`, or on one machine a free
    /// local port.
    fn master(&self) -> AnyResult<(String, u16)> {
        let Some(master) = self.master else {
            if self.nodes > 1 {
                return Err(format!(
                    "--nodes {}: give --master ADDRESS:PORT, node 0's address where the \
                     workers meet",
                    self.nodes
                )
                .into());
            }
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| format!("--gpus: no free local port for the rendezvous: {e}"))?
                .port();
            return Ok(("127.0.0.1".into(), port));
        };
        let bad = || format!("--master {master}: expected ADDRESS:PORT, e.g. 10.0.0.1:29500");
        let (addr, port) = master.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        if addr.is_empty() || port == 0 {
            return Err(bad().into());
        }
        Ok((addr.to_string(), port))
    }

    /// Refuses flags that contradict each other.
    fn check(&self) -> AnyResult {
        if self.gpus == 0 || self.nodes == 0 {
            return Err("--gpus and --nodes must be at least 1".into());
        }
        if self.node_rank >= self.nodes {
            return Err(format!(
                "--node-rank {} must be below --nodes {}",
                self.node_rank, self.nodes
            )
            .into());
        }
        if self.nodes == 1 && self.master.is_some() {
            return Err("--master names node 0 of a run on several machines: give --nodes".into());
        }
        Ok(())
    }
}

/// This process's place in a run of several ranks, if a launcher started
/// it as one; refuses `--gpus` and `--nodes` that contradict it.
pub(crate) fn world(l: &Launch<'_>) -> AnyResult<Option<World>> {
    let world = World::from_env().map_err(|e| e.to_string())?;
    if let Some(w) = &world {
        if l.ranks() > 1 && l.ranks() != w.size {
            return Err(format!(
                "--gpus {} --nodes {} make {} ranks, but the launcher started {} (WORLD_SIZE): \
                 leave --gpus and --nodes out under torchrun, srun or mpirun",
                l.gpus,
                l.nodes,
                l.ranks(),
                w.size
            )
            .into());
        }
    }
    Ok(world)
}

/// With `--gpus N` (N > 1) or `--nodes M` (M > 1) outside a launcher: runs
/// this command as this machine's N workers and waits for them; `Ok(true)`
/// when they all succeeded. `Ok(false)`: train in this process.
pub(crate) fn launch(l: &Launch<'_>) -> AnyResult<bool> {
    l.check()?;
    if l.ranks() <= 1 || World::from_env().map_err(|e| e.to_string())?.is_some() {
        return Ok(false);
    }
    let (addr, port) = l.master()?;
    if l.device != Device::Cuda {
        return Err(format!("--gpus {} trains on GPUs: add --device cuda", l.gpus).into());
    }
    let library_path = nccl_library_path()?;
    // the workers share this machine's cores (as torchrun limits OpenMP)
    let threads = std::env::var_os("RAYON_NUM_THREADS").is_none().then(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / l.gpus).max(1).to_string()
    });
    let exe = std::env::current_exe().map_err(|e| format!("--gpus: this program's path: {e}"))?;
    // Ctrl-C reaches the workers too: they pause together and rank 0
    // saves; the launcher waits for them instead of dying first
    let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&interrupted))
            .map_err(|e| format!("--gpus: signal handler: {e}"))?;
    }
    let mut workers: Vec<Child> = Vec::with_capacity(l.gpus);
    for local in 0..l.gpus {
        let rank = l.node_rank * l.gpus + local;
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args_os().skip(1))
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", l.ranks().to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", port.to_string());
        if let Some(path) = &library_path {
            cmd.env("LD_LIBRARY_PATH", path);
        }
        if let Some(threads) = &threads {
            cmd.env("RAYON_NUM_THREADS", threads);
        }
        // NVLink multicast (NVLS) stays off unless asked for: on hosts
        // whose GPUs are shared it can take them out of service
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        match cmd.spawn() {
            Ok(child) => workers.push(child),
            Err(e) => {
                stop(&mut workers);
                return Err(format!("--gpus: starting worker {rank}: {e}").into());
            }
        }
    }
    wait(workers, l.node_rank * l.gpus, l.ranks(), &interrupted)?;
    Ok(true)
}

/// Waits for this machine's workers (ranks `first`, `first + 1`, ... of
/// `ranks`); the first that fails stops the others, unless the run was
/// `interrupted` (the workers then end on their own, rank 0 after saving).
fn wait(
    mut workers: Vec<Child>,
    first: usize,
    ranks: usize,
    interrupted: &std::sync::atomic::AtomicBool,
) -> AnyResult {
    use std::sync::atomic::Ordering;
    let mut failed = None;
    let mut done = vec![false; workers.len()];
    while done.iter().any(|d| !d) {
        for (local, child) in workers.iter_mut().enumerate() {
            if done[local] {
                continue;
            }
            let rank = first + local;
            match child.try_wait() {
                Ok(Some(status)) if status.success() => done[local] = true,
                Ok(Some(status)) if interrupted.load(Ordering::SeqCst) => {
                    done[local] = true;
                    failed.get_or_insert(status);
                }
                Ok(Some(status)) => {
                    stop(&mut workers);
                    return Err(format!(
                        "--gpus: rank {rank} of {ranks} failed ({status}); this machine's other \
                         ranks were stopped"
                    )
                    .into());
                }
                Ok(None) => {}
                Err(e) => return Err(format!("--gpus: waiting for rank {rank}: {e}").into()),
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    match failed {
        Some(status) => Err(format!("--gpus: interrupted; the workers ended ({status})").into()),
        None => Ok(()),
    }
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

/// `--bucket-mb` in bytes: at least one.
pub(crate) fn bucket_bytes(mib: f64) -> AnyResult<usize> {
    let bytes = mib * (1u64 << 20) as f64;
    if !(bytes.is_finite() && bytes >= 1.0) {
        return Err(format!("--bucket-mb must be more than 0, got {mib}").into());
    }
    Ok(bytes as usize)
}

/// What a worker trains with.
pub(crate) struct WorkerEngine<'a> {
    pub world: &'a World,
    pub model: &'a Model,
    pub choice: TrainEngineChoice,
    /// The swap path's mode (`Off`: the plain batched engine).
    pub swap: SwapMode,
    pub budget: Option<u64>,
    /// `--dist-timeout`.
    pub timeout: Duration,
    /// `--batch-size` (a rank's): the persistent engine tunes for it.
    pub batch_size: usize,
    /// `--sync-bn`.
    pub sync_bn: bool,
    /// `--bucket-mb` in bytes.
    pub bucket_bytes: usize,
}

/// The batched or persistent CUDA engine on GPU `LOCAL_RANK`, joined to
/// the other ranks through NCCL, as one rank of a data-parallel run.
pub(crate) fn engine(
    w: WorkerEngine<'_>,
    (params, config): (Params<f32>, OptimizerConfig),
) -> AnyResult<Box<dyn TrainEngine<f32>>> {
    let world = w.world;
    let rank = |e: String| format!("rank {} of {}: {e}", world.rank, world.size);
    let gpu = |e: String| rank(format!("GPU {}: {e}", world.local_rank));
    if w.sync_bn && w.choice == TrainEngineChoice::Persistent {
        return Err("--sync-bn: the persistent engine runs no batch norm".into());
    }
    if w.choice == TrainEngineChoice::Persistent {
        let options = PersistentOptions {
            device: world.local_rank,
            batch_size: Some(w.batch_size),
            memory_budget: w.budget,
            ..PersistentOptions::default()
        };
        let mut trainer = PersistentTrainer::new(w.model, &params, config, &options)
            .map_err(|e| gpu(format!("--engine persistent: {e}")))?;
        trainer.split_updates().map_err(|e| rank(e.to_string()))?;
        let group = join(world, trainer.persistent().device(), w.timeout)?;
        return Ok(Box::new(DataParallel::new(trainer, Box::new(group))));
    }
    let mut options = CudaEngineOptions {
        device: world.local_rank,
        bucket_bytes: Some(w.bucket_bytes),
        ..CudaEngineOptions::default()
    };
    options.pool.max_bytes = w.budget;
    if w.swap != SwapMode::Off {
        let swap = SwapConfig::with_mode(w.swap);
        let mut trainer = SwapTrainer::new(w.model.clone(), &options, swap, params, config)
            .map_err(|e| gpu(format!("--swap {}: {e}", w.swap.name())))?;
        let group = join(world, trainer.engine().device(), w.timeout)?;
        if w.sync_bn {
            let handle = sync_handle(&group, world)?;
            trainer
                .sync_batch_norm(handle)
                .map_err(|e| rank(format!("--sync-bn: {e}")))?;
        }
        return Ok(Box::new(DataParallel::new(trainer, Box::new(group))));
    }
    let engine = CudaEngine::new(w.model, &options).map_err(|e| gpu(e.to_string()))?;
    let mut trainer = CudaTrainer::new(engine, w.model.clone(), params, config)
        .map_err(|e| rank(e.to_string()))?;
    let group = join(world, trainer.device(), w.timeout)?;
    if w.sync_bn {
        let handle = sync_handle(&group, world)?;
        trainer
            .sync_batch_norm(handle)
            .map_err(|e| rank(format!("--sync-bn: {e}")))?;
    }
    Ok(Box::new(DataParallel::new(trainer, Box::new(group))))
}

/// A second handle on `group` for synchronized batch norm.
fn sync_handle(group: &NcclGroup, world: &World) -> AnyResult<Box<dyn Collective<f32>>> {
    group.handle().ok_or_else(|| {
        format!(
            "rank {} of {}: --sync-bn: no second handle on the NCCL communicator",
            world.rank, world.size
        )
        .into()
    })
}

/// This rank's NCCL communicator on `device`: the id from rank 0 at the
/// rendezvous, the watchdog armed with `timeout`.
fn join(world: &World, device: &Arc<CudaDevice>, timeout: Duration) -> AnyResult<NcclGroup> {
    let rank = |e: String| format!("rank {} of {}: {e}", world.rank, world.size);
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
        timeout,
    )
    .map_err(|e| rank(e.to_string()))?;
    if let Some(e) = made {
        return Err(rank(e).into());
    }
    let mut group =
        NcclGroup::join(device, world.rank, world.size, &id).map_err(|e| rank(e.to_string()))?;
    group.watch(timeout);
    Ok(group)
}
