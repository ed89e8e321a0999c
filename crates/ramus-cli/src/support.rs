//! `ramus inspect --support`: which built-in model runs on which engine,
//! asked of the engines' own code for every model (never a kept list): the
//! CPU compiled engine is constructed, the CUDA engines' device-free checks
//! (`ramus_cuda::support`) run their plans, lowerings and instruction sets.
//! A refusal is shown with its reason: the first unsupported op or
//! structure, with the node.

use std::fmt::Write as _;

use ramus_core::{Model, Params};

/// The engines of the table, in column order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineKind {
    CpuBatched,
    CpuCompiled,
    CudaBatched,
    CudaCompiled,
    CudaPersistent,
    Swap,
}

pub(crate) const ENGINES: [EngineKind; 6] = [
    EngineKind::CpuBatched,
    EngineKind::CpuCompiled,
    EngineKind::CudaBatched,
    EngineKind::CudaCompiled,
    EngineKind::CudaPersistent,
    EngineKind::Swap,
];

impl EngineKind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            EngineKind::CpuBatched => "cpu batched",
            EngineKind::CpuCompiled => "cpu compiled",
            EngineKind::CudaBatched => "cuda batched",
            EngineKind::CudaCompiled => "cuda compiled",
            EngineKind::CudaPersistent => "cuda persistent",
            EngineKind::Swap => "swap",
        }
    }

    /// Whether this engine runs `model`; `Err` is the engine's own refusal.
    pub(crate) fn check(self, model: &Model) -> Result<(), String> {
        let shown = |e: &dyn std::fmt::Display| e.to_string();
        match self {
            // every op has a CPU kernel: `Kernel for Op` matches each variant
            EngineKind::CpuBatched => Ok(()),
            EngineKind::CpuCompiled => {
                let params = Params::init(model, 0);
                ramus_cpu::compiled::CpuCompiledEngine::new(model, &params, false)
                    .map(|_| ())
                    .map_err(|e| shown(&e))
            }
            EngineKind::CudaBatched => ramus_cuda::support::batched(model).map_err(|e| shown(&e)),
            EngineKind::CudaCompiled => ramus_cuda::support::compiled(model).map_err(|e| shown(&e)),
            EngineKind::CudaPersistent => {
                ramus_cuda::support::persistent(model).map_err(|e| shown(&e))
            }
            EngineKind::Swap => ramus_cuda::support::swap(model).map_err(|e| shown(&e)),
        }
    }
}

/// The table for `models` (name and model each): one row per model, `yes`
/// or `no (k)` per engine, then reason `k` of each refusal.
pub(crate) fn table(models: &[(&str, Model)]) -> String {
    let width = models
        .iter()
        .map(|(n, _)| n.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let mut out = format!("{:width$}", "model");
    for e in ENGINES {
        let _ = write!(out, "  {:>15}", e.label());
    }
    out.push('\n');
    let mut reasons = Vec::new();
    for (name, model) in models {
        let _ = write!(out, "{name:width$}");
        for e in ENGINES {
            let cell = match e.check(model) {
                Ok(()) => "yes".to_string(),
                Err(why) => {
                    reasons.push(format!("{name} on {}: {why}", e.label()));
                    format!("no ({})", reasons.len())
                }
            };
            let _ = write!(out, "  {cell:>15}");
        }
        out.push('\n');
    }
    if !reasons.is_empty() {
        out.push_str("\nwhy not:\n");
        for (k, r) in reasons.iter().enumerate() {
            let _ = writeln!(out, "({}) {r}", k + 1);
        }
    }
    out
}
