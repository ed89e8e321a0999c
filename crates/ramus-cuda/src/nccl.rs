//! NCCL for data-parallel training: a communicator over one GPU per rank,
//! joined through the id rank 0 hands out at the rendezvous
//! (`ramus_dist::rendezvous`), as a [`Collective`] that sums gradient
//! buffers in device memory on the stream that wrote them (the engine's
//! main stream, or the side stream its overlapped sums run on).
//!
//! The library is loaded at run time through `cudarc` like the rest of
//! CUDA, so Ramus builds and runs without it; [`check_library`] turns a
//! missing `libnccl` into one line naming the names looked for and the
//! places a pip-installed NCCL lives.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{result as driver, sys as cu, CudaEvent, CudaStream};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;
use ramus_exec::data_parallel::{Collective, GradBuffer};
use ramus_exec::{ExecError, Result as ExecResult};

use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};
use crate::pinned::PinnedBuffer;
use crate::pool::{DevicePool, DeviceView, PoolBuffer, PoolConfig};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// Fails with one line when `libnccl` cannot be loaded: the names tried
/// (on `LD_LIBRARY_PATH` and the system's library paths) and, where a
/// pip wheel (`nvidia-nccl-cu13`) holds the library, how to use it.
pub fn check_library() -> Result<()> {
    // SAFETY: loads the library by name to see whether it exists; no
    // symbol is called.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    let wheels = wheel_libraries();
    let hint = match wheels.first() {
        Some(found) => format!(
            "; a pip-installed NCCL is at {found}: add its directory to LD_LIBRARY_PATH with a \
             libnccl.so link to it (`ln -s {found} DIR/libnccl.so`)"
        ),
        None => "; install NCCL (a system package, or `pip install nvidia-nccl-cu13` and its \
                 lib directory on LD_LIBRARY_PATH)"
            .into(),
    };
    let names = cudarc::get_lib_name_candidates("nccl");
    Err(CudaError::Nccl(format!(
        "libnccl not found: looked for {} … {} ({} names) on LD_LIBRARY_PATH ({}) and the \
         system library paths{hint}",
        names.first().map_or("", String::as_str),
        names.last().map_or("", String::as_str),
        names.len(),
        std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| "unset".into())
    )))
}

/// `libnccl.so.2` files of pip's `nvidia-nccl-*` wheels under the usual
/// Python package directories: the system's, conda's, and the `lib` beside
/// every `bin` directory on `PATH` (a virtual environment's).
pub fn wheel_libraries() -> Vec<String> {
    let mut roots: Vec<std::path::PathBuf> = Vec::new();
    let mut bases: Vec<std::path::PathBuf> = ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"]
        .iter()
        .map(std::path::PathBuf::from)
        .collect();
    if let Some(path) = std::env::var_os("PATH") {
        bases.extend(
            std::env::split_paths(&path)
                .filter(|p| p.ends_with("bin"))
                .filter_map(|p| p.parent().map(|venv| venv.join("lib"))),
        );
    }
    for base in &bases {
        if let Ok(entries) = std::fs::read_dir(base) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if name.starts_with("python3") {
                    roots.push(e.path().join("dist-packages"));
                    roots.push(e.path().join("site-packages"));
                }
            }
        }
    }
    roots.sort();
    roots.dedup();
    roots
        .into_iter()
        .map(|r| r.join("nvidia/nccl/lib/libnccl.so.2"))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect()
}

/// A new NCCL unique id (rank 0 makes it and hands it out).
pub fn new_id() -> Result<Vec<u8>> {
    check_library()?;
    let id = nccl::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

fn nccl_err(call: &str, e: nccl::NcclError) -> CudaError {
    CudaError::Nccl(format!("{call}: {e:?}"))
}

/// One rank's NCCL communicator. Device buffers are summed on the stream
/// that wrote them (so that the sums follow the backward pass and come
/// before the update without any host wait), host values through the
/// engine's main stream.
pub struct NcclGroup {
    comm: Arc<Comm>,
    device: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    staging: PinnedBuffer,
    pool: Arc<DevicePool>,
    scratch: Option<PoolBuffer<u32>>,
    watch: Arc<Watch>,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

/// What the group and its watchdog share: when a collective last
/// finished, and why the watchdog aborted the communicator.
struct Watch {
    started: Instant,
    /// Milliseconds from `started` to the last collective that finished.
    beat_ms: AtomicU64,
    /// Set (with the reason) once the communicator is aborted.
    aborted: Mutex<Option<String>>,
    stop: AtomicBool,
}

impl Watch {
    fn beat(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.beat_ms.store(ms, Ordering::Relaxed);
    }

    fn idle(&self) -> Duration {
        let now = self.started.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.beat_ms.load(Ordering::Relaxed)))
    }

    fn reason(&self) -> Option<String> {
        self.aborted.lock().ok().and_then(|r| r.clone())
    }
}

/// The communicator, shared by a rank's group and the handles made from
/// it ([`Collective::handle`]); aborted when the last of them goes (unless
/// the watchdog aborted it).
struct Comm {
    raw: sys::ncclComm_t,
    watch: Arc<Watch>,
    /// The stream of the last collective enqueued, and the event a
    /// collective on another stream waits for (see [`NcclGroup::follow`]).
    last_stream: Mutex<Option<u64>>,
    handover: CudaEvent,
}

// SAFETY: the communicator is used by one thread at a time (a rank's
// training loop, through its group or a handle, in turn); NCCL
// communicators may move between threads.
unsafe impl Send for Comm {}
// SAFETY: as above: shared references only reach the raw handle, which
// the owning thread uses in turn.
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.watch.reason().is_some() {
            return; // the watchdog aborted it
        }
        // SAFETY: the communicator was initialised in `join` and no group
        // or handle uses it after this; abort also ends collectives a
        // failed rank left.
        unsafe {
            let _ = nccl::comm_abort(self.raw);
        }
    }
}

/// The communicator handle, moved into the watchdog's thread.
struct CommHandle(sys::ncclComm_t);

// SAFETY: the watchdog only polls the communicator's asynchronous error and
// aborts it, which NCCL allows from another thread while collectives run.
unsafe impl Send for CommHandle {}

impl NcclGroup {
    /// Joins the communicator of `world` ranks as `rank`, with the `id`
    /// rank 0 made, on `device`'s main stream.
    pub fn join(device: &Arc<CudaDevice>, rank: usize, world: usize, id: &[u8]) -> Result<Self> {
        check_library()?;
        if id.len() != ID_BYTES {
            return Err(CudaError::Nccl(format!(
                "an NCCL id has {ID_BYTES} bytes, got {}",
                id.len()
            )));
        }
        let mut internal = [0 as std::ffi::c_char; ID_BYTES];
        internal
            .iter_mut()
            .zip(id)
            .for_each(|(c, &b)| *c = b as std::ffi::c_char);
        let unique = sys::ncclUniqueId { internal };
        let mut comm = std::mem::MaybeUninit::uninit();
        let (nranks, me) = (to_int(world)?, to_int(rank)?);
        device
            .context()
            .bind_to_thread()
            .in_call("cuCtxSetCurrent")?;
        // SAFETY: `comm` is written by NCCL before it is read; the id is
        // the 128 bytes rank 0's ncclGetUniqueId returned.
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), nranks, unique, me)
                .map_err(|e| nccl_err("ncclCommInitRank", e))?;
            comm.assume_init()
        };
        let watch = Arc::new(Watch {
            started: Instant::now(),
            beat_ms: AtomicU64::new(0),
            aborted: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        Ok(NcclGroup {
            comm: Arc::new(Comm {
                raw: comm,
                watch: watch.clone(),
                last_stream: Mutex::new(None),
                handover: device.new_event()?,
            }),
            device: device.clone(),
            stream: device.stream().clone(),
            rank,
            world,
            staging: PinnedBuffer::new(device)?,
            pool: DevicePool::new(device, PoolConfig::default()),
            scratch: None,
            watch,
            watchdog: None,
        })
    }

    /// Another handle on this rank's communicator, on the same stream,
    /// with scratch memory of its own (see [`Collective::handle`]).
    fn another(&self) -> Result<NcclGroup> {
        Ok(NcclGroup {
            comm: self.comm.clone(),
            device: self.device.clone(),
            stream: self.stream.clone(),
            rank: self.rank,
            world: self.world,
            staging: PinnedBuffer::new(&self.device)?,
            pool: DevicePool::new(&self.device, PoolConfig::default()),
            scratch: None,
            watch: self.watch.clone(),
            watchdog: None,
        })
    }

    /// Watches the communicator from a thread of its own: when NCCL reports
    /// an asynchronous error (a rank died, the network broke) or no
    /// collective has finished for `timeout` (a rank hangs), it aborts the
    /// communicator, which ends the kernels waiting on it, says why on
    /// standard error, and every later call of this group fails with the
    /// reason. So no rank waits for ever.
    pub fn watch(&mut self, timeout: Duration) {
        let watch = self.watch.clone();
        watch.beat();
        let comm = CommHandle(self.comm.raw);
        let (rank, world) = (self.rank, self.world);
        let poll = (timeout / 20).clamp(Duration::from_millis(50), Duration::from_secs(1));
        self.watchdog = Some(std::thread::spawn(move || {
            let comm = comm;
            while !watch.stop.load(Ordering::Relaxed) {
                std::thread::sleep(poll);
                let mut error = sys::ncclResult_t::ncclSuccess;
                // SAFETY: reads the communicator's asynchronous error; the
                // communicator lives until the group's drop joins this thread.
                unsafe { sys::ncclCommGetAsyncError(comm.0, &mut error) };
                let why = if error != sys::ncclResult_t::ncclSuccess {
                    format!("NCCL reports {error:?} (a rank failed or the network broke)")
                } else if watch.idle() > timeout {
                    format!(
                        "no collective finished for {:.0} s (--dist-timeout): another rank \
                         failed or hangs",
                        timeout.as_secs_f64()
                    )
                } else {
                    continue;
                };
                let why = format!("NCCL rank {rank} of {world}: {why}; communicator aborted");
                eprintln!("{why}");
                if let Ok(mut aborted) = watch.aborted.lock() {
                    *aborted = Some(why);
                }
                // SAFETY: aborting ends this rank's NCCL kernels; the group
                // no longer uses the communicator (its calls check
                // `aborted` first, its drop does not abort it again).
                unsafe {
                    let _ = nccl::comm_abort(comm.0);
                }
                return;
            }
        }));
    }

    /// Fails with the watchdog's reason once it aborted the communicator.
    fn check(&self) -> ExecResult<()> {
        match self.watch.reason() {
            Some(why) => Err(ExecError::Device(why)),
            None => Ok(()),
        }
    }

    /// The error of a failed call: the watchdog's reason when it aborted
    /// the communicator (the call failed because of it), else `e`.
    fn failure(&self, e: CudaError) -> ExecError {
        match self.watch.reason() {
            Some(why) => ExecError::Device(why),
            None => ExecError::Device(format!("NCCL rank {} of {}: {e}", self.rank, self.world)),
        }
    }

    /// `words` u32 words of scratch device memory.
    fn scratch(&mut self, words: usize) -> Result<DeviceView<u32>> {
        if self.scratch.as_ref().is_none_or(|s| s.len() < words) {
            self.scratch = Some(self.pool.alloc::<u32>(words.max(64))?);
        }
        match &self.scratch {
            Some(s) => s.view().slice(0..words),
            None => Err(CudaError::Nccl("scratch missing".into())),
        }
    }

    /// `host` replaced by its sum over the ranks, each rank's scaled by its
    /// `scale` first: uploaded to the scratch buffer, summed, copied back.
    fn sum_host(&mut self, host: &mut [f32], scale: f64) -> Result<()> {
        let buf: DeviceView<f32> = self.scratch(host.len())?.reinterpret();
        let stream = self.stream.clone();
        self.staging.upload_slice(host, buf, &stream)?;
        let on = stream.cu_stream() as u64;
        self.scaled_sum(on, &[(buf.device_ptr(), host.len())], scale as f32)?;
        host.copy_from_slice(&self.staging.download_to_vec(buf, &stream)?);
        Ok(())
    }

    /// Makes a collective about to be enqueued on `stream` follow the
    /// communicator's previous one when that went on another stream: the
    /// ranks pair collectives by the order they run in, which two streams
    /// could otherwise change (a bucket's sum on the side stream, a
    /// synchronized batch norm's on the main one).
    fn follow(&self, stream: u64) -> Result<()> {
        let mut last =
            self.comm.last_stream.lock().map_err(|_| {
                CudaError::Nccl("the communicator's stream order was poisoned".into())
            })?;
        if let Some(previous) = last.filter(|&p| p != stream) {
            let event = self.comm.handover.cu_event();
            // SAFETY: both streams belong to this rank's context and live
            // as long as the engine that hands them to the group; the
            // event lives with the communicator.
            unsafe {
                driver::event::record(event, previous as cu::CUstream).in_call("cuEventRecord")?;
                driver::stream::wait_event(
                    stream as cu::CUstream,
                    event,
                    cu::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
                .in_call("cuStreamWaitEvent")?;
            }
        }
        *last = Some(stream);
        Ok(())
    }

    /// In-place all-reduce of `count` elements of `dtype` at `ptr`, on
    /// the group's stream.
    fn all_reduce(&self, ptr: u64, count: usize, dtype: sys::ncclDataType_t) -> Result<()> {
        let op = sys::ncclRedOp_t::ncclSum;
        let stream = self.stream.cu_stream() as u64;
        self.follow(stream)?;
        // SAFETY: `ptr` holds `count` elements of `dtype` on this rank's
        // device, written on `self.stream`, which the reduction follows.
        unsafe {
            nccl::all_reduce(
                ptr as *const _,
                ptr as *mut _,
                count,
                dtype,
                op,
                self.comm.raw,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| nccl_err("ncclAllReduce", e))?;
        Ok(())
    }

    /// Sums each `(ptr, count)` buffer (f32) pre-multiplied by `scale` on
    /// this rank, on `stream`: one NCCL group, so the reductions launch
    /// together.
    fn scaled_sum(&self, stream: u64, buffers: &[(u64, usize)], scale: f32) -> Result<()> {
        self.follow(stream)?;
        let mut op = std::mem::MaybeUninit::uninit();
        let mut scalar = scale;
        // SAFETY: the scalar is read at the call (host-immediate); the op
        // is destroyed after the group that uses it is enqueued; each
        // buffer holds `count` floats on this rank's device, written on
        // `stream`, which the reductions follow.
        unsafe {
            nccl::reduce_op_create_pre_mul_sum(
                op.as_mut_ptr(),
                &mut scalar as *mut f32 as *mut _,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclScalarResidence_t::ncclScalarHostImmediate,
                self.comm.raw,
            )
            .map_err(|e| nccl_err("ncclRedOpCreatePreMulSum", e))?;
            let op = op.assume_init();
            let reduced = (|| {
                nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
                let enqueued = buffers.iter().try_for_each(|&(ptr, count)| {
                    nccl::all_reduce(
                        ptr as *const _,
                        ptr as *mut _,
                        count,
                        sys::ncclDataType_t::ncclFloat32,
                        op,
                        self.comm.raw,
                        stream as sys::cudaStream_t,
                    )
                    .map(|_| ())
                    .map_err(|e| nccl_err("ncclAllReduce", e))
                });
                let ended = nccl::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
                enqueued.and(ended.map(|_| ()))
            })();
            nccl::reduce_op_destroy(op, self.comm.raw)
                .map_err(|e| nccl_err("ncclRedOpDestroy", e))?;
            reduced?;
        }
        Ok(())
    }
}

fn to_int(n: usize) -> Result<std::ffi::c_int> {
    std::ffi::c_int::try_from(n).map_err(|_| CudaError::Nccl(format!("{n} ranks")))
}

impl Drop for NcclGroup {
    /// Stops the watchdog (a handle has none); the communicator goes with
    /// the last group or handle on it.
    fn drop(&mut self) {
        if let Some(watchdog) = self.watchdog.take() {
            self.watch.stop.store(true, Ordering::Relaxed);
            let _ = watchdog.join();
        }
    }
}

impl Collective<f32> for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn handle(&self) -> Option<Box<dyn Collective<f32>>> {
        match self.another() {
            Ok(group) => Some(Box::new(group)),
            Err(e) => {
                eprintln!("NCCL rank {}: no second handle: {e}", self.rank);
                None
            }
        }
    }

    fn world(&self) -> usize {
        self.world
    }

    fn sum_scalars(&mut self, values: &mut [f64]) -> ExecResult<()> {
        self.check()?;
        let words: Vec<u32> = values
            .iter()
            .flat_map(|v| {
                let b = v.to_bits();
                [b as u32, (b >> 32) as u32]
            })
            .collect();
        let run = |g: &mut Self| -> Result<Vec<u32>> {
            let buf = g.scratch(words.len())?;
            let stream = g.stream.clone();
            g.staging.upload_slice(&words, buf, &stream)?;
            g.all_reduce(
                buf.device_ptr(),
                values.len(),
                sys::ncclDataType_t::ncclFloat64,
            )?;
            g.staging.download_to_vec(buf, &stream)
        };
        let summed = run(self).map_err(|e| self.failure(e))?;
        for (v, pair) in values.iter_mut().zip(summed.chunks(2)) {
            *v = f64::from_bits(pair[0] as u64 | (pair[1] as u64) << 32);
        }
        self.check()?;
        self.watch.beat();
        Ok(())
    }

    fn sum_buffers(&mut self, buffers: Vec<GradBuffer<'_, f32>>, scale: f64) -> ExecResult<()> {
        self.check()?;
        let mut device = Vec::with_capacity(buffers.len());
        let mut on = None;
        for b in buffers {
            match b {
                GradBuffer::Device(d) if on.is_some_and(|s| s != d.stream) => {
                    return Err(self.failure(CudaError::Nccl(
                        "gradient buffers of one sum on different streams".into(),
                    )));
                }
                GradBuffer::Device(d) => {
                    on = Some(d.stream);
                    device.push((d.ptr, d.len));
                }
                GradBuffer::Host(host) => {
                    // through the scratch buffer (batch norm's statistics
                    // before an evaluation: small, and rare)
                    self.sum_host(host, scale).map_err(|e| self.failure(e))?;
                    self.watch.beat();
                }
            }
        }
        if let Some(stream) = on {
            self.scaled_sum(stream, &device, scale as f32)
                .map_err(|e| self.failure(e))?;
        }
        Ok(())
    }
}
