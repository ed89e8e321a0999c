//! Setting a [`PersistentEngine`] up: the program and register plan, the
//! first kernel (or a bridge while it compiles), the device opened on
//! another thread meanwhile, the memory check, and the parameters uploaded.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use ramus_codegen::persistent::KERNEL_NAME;
use ramus_core::vpps::{DeviceLimits, WIDE_PRODUCT_ITEMS};
use ramus_core::{Model, Params};
use ramus_exec::memory::{DeviceNeed, DeviceRoom, Fitted};
use ramus_exec::OptimizerConfig;

use super::compile::{check_opened, prefetch_candidates, start_compiles, EarlyCompiles};
use super::options::{
    choice_key, items_option, model_err, rule_of, PersistentOptions, EPILOGUE_ENV, HOST_ENV,
    HOST_PRODUCT_ITEMS, TRACE_ENV, WIDE_ENV,
};
use super::sizes;
use super::variant::{
    build_variant, variant_scheduler, Tuning, Variant, VariantBuild, VariantChoice,
};
use super::{AwaitedKernel, PersistentEngine};
use crate::cache::KernelCache;
use crate::device::{CudaDevice, DeviceFacts};
use crate::error::{InCall, Result};
use crate::memory::{model_fits, run_check, DeviceCheck};
use crate::persistent::program::PersistentProgram;
use crate::persistent::PersistentKernel;
use crate::pinned::PinnedBuffer;
use crate::pool::{DevicePool, PoolBuffer, PoolConfig};
use crate::rtc::{supported_archs, CompileTarget, LoadedModule, NvrtcCompiler};

impl PersistentEngine {
    /// Sets the engine up for `model` with initial `params` and `optimizer`
    /// (refusing a model whose parameters cannot fit the device; see
    /// [`with_check`](Self::with_check)).
    pub fn new(
        model: &Model,
        params: &Params<f32>,
        optimizer: OptimizerConfig,
        options: &PersistentOptions,
    ) -> Result<Self> {
        Self::with_check(model, params, optimizer, options, &model_fits)
    }

    /// [`new`](Self::new), asking `check` whether what the run will
    /// allocate fits the device ([`sizes::need`]; within
    /// [`PersistentOptions::memory_budget`] before the kernels compile,
    /// within the free memory once the device is open), before the pool
    /// holds anything: a refusal is [`CudaError::DoesNotFit`](crate::error::CudaError::DoesNotFit). The pool
    /// then reserves what the check found fits, its buffer sized for the
    /// largest batch.
    pub fn with_check(
        model: &Model,
        params: &Params<f32>,
        optimizer: OptimizerConfig,
        options: &PersistentOptions,
        check: DeviceCheck<'_>,
    ) -> Result<Self> {
        let started = Instant::now();
        check_optimizer(&optimizer)?;
        // the CUDA context is created on a thread of its own while this one
        // plans the kernel and, where it must be compiled, compiles a bridge
        let opening = open_on_thread(options.device);
        let mut phases = Vec::new();
        let mut mark = |phase: &'static str| phases.push((phase, started.elapsed().as_secs_f64()));
        let SetupPlan {
            compiler,
            cache_dir,
            prog,
            planned:
                Planned {
                    build,
                    first_choice,
                    tuning,
                    host_items,
                },
            mut need,
        } = plan_setup(model, &optimizer, options, &mut mark)?;
        // a run over the budget is refused before anything compiles
        let opening = check_budget(check, &need, options.memory_budget, opening)?;
        let mut early = start_compiles(
            &prog,
            &build,
            first_choice,
            &compiler,
            cache_dir.as_deref(),
            options.bridge != Some(false) && build.trace.is_none(),
        );
        mark("bridge compile");
        let (device, context_seconds) = join_device(opening, options.device)?;
        mark("device");
        let pooled = need.parts_bytes();
        let budget = options.memory_budget;
        let (fitted, bridge) = check_opened(&device, &mut need, &mut early, check, budget)?;
        let cache = KernelCache::with_compiler(&device, compiler, cache_dir);
        let pool = reserve_pool(&device, pooled, &fitted, budget);
        adopt_early(&cache, &mut early)?;
        prefetch_candidates(&cache, &prog, &build, tuning.as_ref());
        mark("prefetch");
        let (first, awaited) = first_variant(
            &device,
            &cache,
            &pool,
            (prog.as_ref(), &build),
            first_choice,
            (early, bridge),
        )?;
        check_params(model, params)?;
        // parameters, zero gradients and moments, then room for batches
        mark("kernel");
        let (buffer, transfer) = upload_params(&device, &pool, &prog, params, fitted.train_batch)?;
        let barriers = pool.alloc::<u32>(1024)?;
        let copy_stream = device.new_stream()?;
        transfer.wait()?;
        mark("upload");
        Ok(PersistentEngine {
            device,
            cache,
            pool,
            prog,
            variants: vec![first],
            active: 0,
            tuning,
            build,
            last_kernel_seconds: None,
            blas: None,
            optimizer,
            step_lrs: VecDeque::new(),
            steps: 0,
            buffer,
            barriers,
            copy_stream,
            slots: Vec::new(),
            transfer,
            pending: VecDeque::new(),
            host_items,
            defer_updates: false,
            prepared: VecDeque::new(),
            traced_launches: 0,
            rng: ChaCha8Rng::seed_from_u64(0),
            fingerprint: crate::program::fingerprint(model),
            setup_seconds: started.elapsed().as_secs_f64(),
            context_seconds,
            kernel_ready_seconds: awaited.is_none().then(|| started.elapsed().as_secs_f64()),
            created: started,
            awaited,
            bridge_batches: (0, 0.0),
            setup_phases: phases,
        })
    }
}

/// The thread opening the device (`Err`: none could be started): the device
/// and the seconds opening it took.
type Opening = std::io::Result<std::thread::JoinHandle<Result<(Arc<CudaDevice>, f64)>>>;

/// Opens device `ordinal` on a thread of its own (its CUDA context, with
/// the seconds that took), while set-up plans and compiles on this one.
fn open_on_thread(ordinal: usize) -> Opening {
    std::thread::Builder::new()
        .name("ramus-cuda-open".into())
        .spawn(move || {
            let opened = Instant::now();
            CudaDevice::open(ordinal).map(|d| (d, opened.elapsed().as_secs_f64()))
        })
}

/// The device [`open_on_thread`] opened (or, where no thread could be
/// started, opened here), bound to this thread, and the seconds opening took.
fn join_device(opening: Opening, ordinal: usize) -> Result<(Arc<CudaDevice>, f64)> {
    let (device, context_seconds) = match opening {
        Ok(thread) => thread
            .join()
            .map_err(|_| model_err("the thread opening the device panicked"))??,
        Err(_) => {
            let opened = Instant::now();
            (CudaDevice::open(ordinal)?, opened.elapsed().as_secs_f64())
        }
    };
    // the context was made current on the thread that created it
    device
        .context()
        .bind_to_thread()
        .in_call("cuCtxSetCurrent")?;
    Ok((device, context_seconds))
}

/// What [`plan_variants`] settles: the inputs of every variant, the first
/// choice, the `rpw` search (where one runs) and the host-product
/// threshold.
struct Planned {
    build: VariantBuild,
    first_choice: VariantChoice,
    tuning: Option<Tuning>,
    host_items: usize,
}

/// The variants' inputs for `prog` on a device named `device_name` with
/// `limits`, and the first choice: the options' `rpw`, else the one an
/// earlier search remembered in the kernel cache `cache_dir`, else the
/// search's first candidate (the search then runs).
fn plan_variants(
    prog: &PersistentProgram,
    limits: DeviceLimits,
    device_name: &str,
    optimizer: &OptimizerConfig,
    options: &PersistentOptions,
    cache_dir: Option<&PathBuf>,
) -> Result<Planned> {
    let slots = sizes::matrix_slots(prog)?;
    let rule = rule_of(optimizer.kind);
    let wide_items = items_option(options.wide_items, WIDE_ENV, WIDE_PRODUCT_ITEMS)?;
    let host_items = items_option(options.host_items, HOST_ENV, HOST_PRODUCT_ITEMS)?;
    // the choice of an earlier search for this model, kernel and device
    let choice_file = cache_dir.map(|d| {
        let key = choice_key(
            format!(
                "{}|{:?}|{:?}|{}|{:?}|{:?}|{wide_items}|{host_items}",
                prog.fused_source,
                prog.matrices,
                rule,
                device_name,
                options.ctas_per_sm,
                options.grads_in_registers
            ),
            options.batch_size,
        );
        d.join(format!(
            "vpps-rpw-{:016x}",
            crate::cache::fnv1a64(key.as_bytes())
        ))
    });
    let remembered = choice_file
        .as_ref()
        .and_then(|f| std::fs::read_to_string(f).ok());
    let build = VariantBuild {
        limits,
        ctas_per_sm: options.ctas_per_sm,
        grads_in_registers: options.grads_in_registers,
        rule,
        slots,
        choice_file,
        trace: std::env::var_os(TRACE_ENV).map(PathBuf::from),
        wide_items,
        vector_epilogue: std::env::var(EPILOGUE_ENV).map_or(true, |v| v.trim() != "scalar"),
    };
    let remembered = remembered.and_then(|text| VariantChoice::parse(&text, &build));
    let (first_choice, tuning) = match (options.rpw, remembered) {
        (Some(rpw), _) => (VariantChoice::of(&build, rpw), None),
        (None, Some(choice)) => (choice, None),
        (None, None) => {
            let candidates = VariantChoice::candidates(prog, &build);
            let first = candidates
                .first()
                .copied()
                .unwrap_or(VariantChoice::of(&build, 1));
            let tuning = (candidates.len() > 1).then_some(Tuning {
                candidates,
                at: 0,
                samples: Vec::new(),
                best: None,
            });
            (first, tuning)
        }
    };
    Ok(Planned {
        build,
        first_choice,
        tuning,
        host_items,
    })
}

/// The first variant: where a bridge was compiled early, the bridge kernel
/// (and the kernel proper it stands in for, compiling), else the first
/// choice's kernel built (or loaded) now.
fn first_variant(
    device: &Arc<CudaDevice>,
    cache: &KernelCache,
    pool: &Arc<DevicePool>,
    (prog, build): (&PersistentProgram, &VariantBuild),
    first_choice: VariantChoice,
    early_bridge: (Option<EarlyCompiles>, Option<(LoadedModule, Instant)>),
) -> Result<(Variant, Option<AwaitedKernel>)> {
    Ok(match early_bridge {
        (Some(EarlyCompiles { plan, source, .. }), Some((module, compile_started))) => {
            let kernel = PersistentKernel::bridge(
                device,
                pool,
                plan,
                &module,
                &build.slots,
                compile_started,
            )?;
            let scheduler = Arc::new(variant_scheduler(kernel.plan(), build));
            let awaited = AwaitedKernel {
                choice: first_choice,
                source,
            };
            (Variant { kernel, scheduler }, Some(awaited))
        }
        _ => (
            build_variant(device, cache, pool, prog, build, first_choice)?,
            None,
        ),
    })
}

/// The pool buffer (the parameter region, then room for a batch of
/// `batch_bytes`; see [`sizes::buffer_floats`]) with `params` uploaded and
/// their gradients and moments zeroed, and the staging buffer that did it.
fn upload_params(
    device: &Arc<CudaDevice>,
    pool: &Arc<DevicePool>,
    prog: &PersistentProgram,
    params: &Params<f32>,
    batch_bytes: u64,
) -> Result<(PoolBuffer<f32>, PinnedBuffer)> {
    let capacity = sizes::buffer_floats(prog.params.total, batch_bytes);
    let buffer = pool.alloc::<f32>(capacity)?;
    let mut transfer = PinnedBuffer::new(device)?;
    {
        let host = transfer.host_mut::<f32>(prog.params.total)?;
        host.iter_mut().for_each(|x| *x = 0.0);
        for (p, t) in params.values.iter().enumerate() {
            let at = prog.params.value[p];
            host[at..at + t.data().len()].copy_from_slice(t.data());
        }
    }
    transfer.upload(buffer.view().slice(0..prog.params.total)?, device.stream())?;
    Ok((buffer, transfer))
}

/// The NVRTC compiler for the device of `facts` (its architecture, or the
/// closest one NVRTC supports).
fn compiler_for(facts: &DeviceFacts) -> Result<NvrtcCompiler> {
    let (major, minor) = facts.compute_capability;
    Ok(NvrtcCompiler::for_target(CompileTarget::choose(
        major * 10 + minor,
        &supported_archs()?,
    )?))
}

/// `opening`, once `check` found that `need` fits the memory `budget`
/// (whatever the device has free), where one is set; a refusal first waits
/// for the thread opening the device to be done with the driver.
fn check_budget(
    check: DeviceCheck<'_>,
    need: &DeviceNeed,
    budget: Option<u64>,
    opening: Opening,
) -> Result<Opening> {
    if let Some(budget) = budget {
        let room = DeviceRoom {
            free: u64::MAX,
            budget: Some(budget),
        };
        if let Err(e) = run_check(check, need, room) {
            if let Ok(thread) = opening {
                let _ = thread.join();
            }
            return Err(e);
        }
    }
    Ok(opening)
}

/// The engine's pool, reserving what the check found fits (`pooled` bytes
/// and the `fitted` batch's; at least the default) in one chunk and taking
/// at most `max_bytes`.
fn reserve_pool(
    device: &Arc<CudaDevice>,
    pooled: u64,
    fitted: &Fitted,
    max_bytes: Option<u64>,
) -> Arc<DevicePool> {
    let checked = pooled + fitted.train_batch + fitted.train_extra;
    DevicePool::new(
        device,
        PoolConfig {
            initial_bytes: PoolConfig::default().initial_bytes.max(checked),
            max_bytes,
        },
    )
}

/// Hands the kernels proper compiling since before the device was open to
/// `cache` (where no thread could compile one early, the lookup compiles it).
fn adopt_early(cache: &KernelCache, early: &mut Option<EarlyCompiles>) -> Result<()> {
    if let Some(e) = early.as_mut() {
        for (source, compiling) in e.kernel_proper.drain(..) {
            cache.adopt(&source, &[KERNEL_NAME], compiling)?;
        }
    }
    Ok(())
}

/// Errors unless `params` has a tensor for each of `model`'s parameters.
fn check_params(model: &Model, params: &Params<f32>) -> Result<()> {
    if params.values.len() != model.params.len() {
        return Err(model_err(format!(
            "{} parameter tensors for a model of {}",
            params.values.len(),
            model.params.len()
        )));
    }
    Ok(())
}

/// What set-up plans before the device is open (while it opens on another
/// thread): the compiler, the kernel cache's directory, the program, the
/// variants' plan and what the run will allocate.
struct SetupPlan {
    compiler: NvrtcCompiler,
    cache_dir: Option<PathBuf>,
    prog: Arc<PersistentProgram>,
    planned: Planned,
    need: DeviceNeed,
}

/// Plans set-up for `model` from the device's properties alone (see
/// [`SetupPlan`]), `mark`ing each phase's end.
fn plan_setup(
    model: &Model,
    optimizer: &OptimizerConfig,
    options: &PersistentOptions,
    mark: &mut dyn FnMut(&'static str),
) -> Result<SetupPlan> {
    let facts = CudaDevice::probe(options.device)?;
    mark("probe");
    let compiler = compiler_for(&facts)?;
    let cache_dir = options
        .cache_dir
        .clone()
        .or_else(crate::cache::default_cache_dir);
    mark("nvrtc");
    // the support table's check (`crate::persistent::support`), first
    let prog = Arc::new(crate::persistent::checked_program(model)?);
    let limits = DeviceLimits::hopper(facts.sm_count as usize);
    let planned = plan_variants(
        &prog,
        limits,
        &facts.name,
        optimizer,
        options,
        cache_dir.as_ref(),
    )?;
    mark("program");
    let choices = planned
        .tuning
        .as_ref()
        .map_or_else(|| vec![planned.first_choice], |t| t.candidates.clone());
    let need = sizes::need(model, &prog, &planned.build, &choices, planned.host_items)?;
    Ok(SetupPlan {
        compiler,
        cache_dir,
        prog,
        planned,
        need,
    })
}

/// Errors for what the persistent engine's update cannot do yet.
fn check_optimizer(optimizer: &OptimizerConfig) -> Result<()> {
    if optimizer.clip_norm.is_some() {
        return Err(model_err(
            "the persistent engine does not clip gradients yet; train without --clip",
        ));
    }
    Ok(())
}
