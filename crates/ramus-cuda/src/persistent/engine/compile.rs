//! Kernel compiles started ahead of need: before the device is open (the
//! first choice's kernel proper and a bridge, [`start_compiles`], then
//! [`check_opened`] once it is), and the `rpw` search's candidates on
//! threads of their own ([`prefetch_candidates`]).

use std::sync::Arc;
use std::time::Instant;

use ramus_codegen::persistent::{kernel_source, KERNEL_NAME};
use ramus_core::vpps::{plan, PlanRequest, RegisterPlan};

use super::variant::{Tuning, VariantBuild, VariantChoice};
use crate::cache::{compile_in_background, KernelCache, Prefetched};
use crate::device::CudaDevice;
use crate::error::{InCall, Result};
use crate::memory::{device_room, local_memory_bytes, run_check, DeviceCheck};
use crate::persistent::program::PersistentProgram;
use crate::rtc::{LoadedModule, NvrtcCompiler};

/// Where the `rpw` search runs (`tuning`), starts compiling the kernels its
/// candidates may build on threads of their own, so that the search finds each compiled when it
/// gets to it: every candidate's first plan, then each one's first plan
/// with the scalar epilogue, then each one's first fallback (a plan that
/// spills falls back, see [`build_variant`](super::variant::build_variant)),
/// as many as the host has cores beside the one preparing batches.
pub(super) fn prefetch_candidates(
    cache: &KernelCache,
    prog: &PersistentProgram,
    build: &VariantBuild,
    tuning: Option<&Tuning>,
) {
    let Some(Tuning { candidates, .. }) = tuning else {
        return;
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let source_of = |request: &PlanRequest, vector_epilogue: bool| {
        plan(&prog.matrices, &build.limits, request).ok().map(|p| {
            let options = build.kernel_options(vector_epilogue);
            (kernel_source(&p, options, &prog.fused_source), p)
        })
    };
    let first_epilogue = build.epilogues()[0];
    let mut sources: Vec<String> = Vec::new();
    let mut scalar: Vec<String> = Vec::new();
    let mut fallbacks: Vec<PlanRequest> = Vec::new();
    for choice in candidates {
        let request = choice.request();
        if let Some((source, p)) = source_of(&request, first_epilogue) {
            fallbacks.extend(choice.fallback(&request, (p.ctas_per_sm, p.grads_in_registers)));
            sources.push(source);
        }
        if first_epilogue {
            scalar.extend(source_of(&request, false).map(|(source, _)| source));
        }
    }
    sources.extend(scalar);
    sources.extend(
        fallbacks
            .iter()
            .filter_map(|r| source_of(r, first_epilogue).map(|(source, _)| source)),
    );
    let mut started = std::collections::HashSet::new();
    for source in sources {
        if started.len() + 1 >= cores {
            break;
        }
        if started.insert(source.clone()) {
            // a compile that cannot start now runs when the variant is built
            let _ = cache.prefetch(&source, &[KERNEL_NAME]);
        }
    }
}

/// Compiles started before the device is open, where the first choice's
/// kernel is not in the cache: the kernel proper for its first plan, with
/// each epilogue it is tried with (`source`: the first), each on a thread
/// of its own (none where no thread could be started; taken over by the
/// cache once it exists) and, with a bridge wanted and where NVRTC can,
/// the bridge for the plan (its image, and when its compile started).
pub(super) struct EarlyCompiles {
    pub(super) plan: RegisterPlan,
    pub(super) source: String,
    pub(super) kernel_proper: Vec<(String, Prefetched)>,
    pub(super) bridge: Option<(Vec<u8>, Instant)>,
}

/// Starts [`EarlyCompiles`] for `choice`'s first plan, unless the plan
/// fails (set-up then builds the variant and reports that) or its kernel
/// is in the cache `directory`; compiles the bridge on this thread (see
/// [`PersistentOptions::bridge`]).
pub(super) fn start_compiles(
    prog: &PersistentProgram,
    build: &VariantBuild,
    choice: VariantChoice,
    compiler: &NvrtcCompiler,
    directory: Option<&std::path::Path>,
    bridge: bool,
) -> Option<EarlyCompiles> {
    let plan = plan(&prog.matrices, &build.limits, &choice.request()).ok()?;
    let source_with =
        |vector| kernel_source(&plan, build.kernel_options(vector), &prog.fused_source);
    // the bridge's is the scalar epilogue's (no 16-byte atomics in code
    // compiled without optimization, whose pointers stay generic)
    let scalar = source_with(false);
    let sources: Vec<String> = build
        .epilogues()
        .iter()
        .map(|&v| if v { source_with(true) } else { scalar.clone() })
        .collect();
    let source = sources[0].clone();
    if directory.is_some_and(|d| crate::cache::entry_on_disk(d, &compiler.cache_tag(), &source)) {
        return None;
    }
    let kernel_proper = sources
        .into_iter()
        .filter_map(|s| {
            let proper = compiler.clone();
            let compiling =
                compile_in_background(&s, &[KERNEL_NAME], move |s, n| proper.compile(s, n));
            compiling.ok().map(|c| (s, c))
        })
        .collect();
    let bridge = bridge
        .then(|| {
            let compile_started = Instant::now();
            let quick = compiler.clone().with_fast_compile(true);
            // an NVRTC that cannot compile quickly: no bridge
            let image = quick.compile(&scalar, &[KERNEL_NAME]).ok()?;
            Some((image, compile_started))
        })
        .flatten();
    Some(EarlyCompiles {
        plan,
        source,
        kernel_proper,
        bridge,
    })
}

/// Once the device is open: loads the bridge kernel, if one was compiled
/// (it keeps its weights in local memory, which the driver takes for every
/// thread the device holds at its launch: a part of `need`), and asks
/// `check` whether `need` fits the device's room. A refusal waits for the
/// compiles under way first (NVRTC must not be torn down under them at
/// exit).
pub(super) fn check_opened(
    device: &Arc<CudaDevice>,
    need: &mut ramus_exec::memory::DeviceNeed,
    early: &mut Option<EarlyCompiles>,
    check: DeviceCheck<'_>,
    budget: Option<u64>,
) -> Result<(ramus_exec::memory::Fitted, Option<(LoadedModule, Instant)>)> {
    let bridge = match early.as_mut().and_then(|e| e.bridge.take()) {
        Some((image, at)) => {
            let module = LoadedModule::load(device.context(), &image, &[KERNEL_NAME])?;
            let spilled = module
                .function(KERNEL_NAME)?
                .local_size_bytes()
                .in_call("cuFuncGetAttribute(LOCAL_SIZE_BYTES)")?;
            let spilled = u64::try_from(spilled).unwrap_or(0);
            let local = local_memory_bytes(device, spilled)?;
            need.parts.push(("the bridge kernel's local memory", local));
            Some((module, at))
        }
        None => None,
    };
    match run_check(check, need, device_room(device, budget)?) {
        Ok(fitted) => Ok((fitted, bridge)),
        Err(e) => {
            for (_, compiling) in early.take().into_iter().flat_map(|e| e.kernel_proper) {
                let _ = compiling.join();
            }
            Err(e)
        }
    }
}
