//! The persistent engine's kernel variants: what a variant is built for
//! ([`VariantChoice`]: `rpw`, CTAs per SM, the gradients' place, and how a
//! plan that spills falls back), the inputs every variant shares
//! ([`VariantBuild`]), the profile-guided `rpw` search's state
//! ([`Tuning`]), and building one ([`build_variant`]).

use std::path::PathBuf;
use std::sync::Arc;

use ramus_codegen::persistent::{KernelOptions, UpdateRule};
use ramus_core::vpps::{
    isa::PRODUCT_ITEM_WORDS, plan, valid_rpws, DeviceLimits, PlanRequest, RegisterPlan, Scheduler,
};

use super::options::model_err;
use crate::cache::KernelCache;
use crate::device::CudaDevice;
use crate::error::Result;
use crate::persistent::program::PersistentProgram;
use crate::persistent::{MatrixSlots, PersistentKernel};
use crate::pool::DevicePool;

/// One compiled kernel with its scheduler (their register plan).
pub(super) struct Variant {
    pub(super) kernel: PersistentKernel,
    /// Shared with the threads preparing batches.
    pub(super) scheduler: Arc<Scheduler>,
}

/// Inputs to compile a variant for another `rpw`.
pub(super) struct VariantBuild {
    pub(super) limits: DeviceLimits,
    pub(super) ctas_per_sm: Option<usize>,
    pub(super) grads_in_registers: Option<bool>,
    pub(super) rule: UpdateRule,
    pub(super) slots: Vec<MatrixSlots>,
    /// Where the chosen `rpw` is remembered (in the kernel cache).
    pub(super) choice_file: Option<PathBuf>,
    /// Where each launch's instruction trace is appended
    /// (`RAMUS_VPPS_TRACE`; see [`append_trace`]): kernels built traced.
    pub(super) trace: Option<PathBuf>,
    /// See [`PersistentOptions::wide_items`].
    pub(super) wide_items: u32,
    /// Whether kernels are tried with the vector epilogue first
    /// ([`KernelOptions::vector_epilogue`]; off with [`EPILOGUE_ENV`]).
    pub(super) vector_epilogue: bool,
}

/// VPPS' profile-guided load granularity (§III-A1): time a few batches
/// with each valid `rpw` from 1 up (one that spills is skipped), keep the
/// best. Every candidate is timed: stopping at the first one slower than
/// the best so far missed a faster larger `rpw`
/// (`docs/benchmarks.md#persistent-engine-rpw-search`).
/// Where the CTAs per SM and the gradients' place are left open, each
/// `rpw` is also tried keeping two CTAs per SM when two with register
/// gradients spill (see [`VariantChoice::keep_ctas`]), and where the
/// gradients' place is open, with them in memory ([`VariantChoice::candidates`]);
/// a candidate whose plan equals one already timed is skipped.
pub(super) struct Tuning {
    pub(super) candidates: Vec<VariantChoice>,
    /// Candidate being timed (index into `candidates`).
    pub(super) at: usize,
    /// Costs of the batches timed with it: kernel seconds and a share of
    /// the host's (see where [`PersistentEngine::tune`] is called).
    pub(super) samples: Vec<f64>,
    /// Best `(median cost, variant index)` so far.
    pub(super) best: Option<(f64, usize)>,
}

/// Batches timed per `rpw` candidate (the first, with compilation and
/// cold caches behind it, is dropped; the median of the rest counts, so
/// one slow batch does not decide; with the mean of three, runs of the
/// same search kept different variants:
/// `docs/benchmarks.md#persistent-engine-rpw-search`).
pub(super) const TUNE_BATCHES: usize = 6;
/// Most `rpw` values tried.
pub(super) const TUNE_CANDIDATES: usize = 4;

/// What a variant is built for: `rpw`, the CTAs per SM and the gradients'
/// place where they are fixed (by the options or a remembered choice),
/// and how the open ones fall back when a kernel spills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct VariantChoice {
    pub(super) rpw: usize,
    pub(super) ctas_per_sm: Option<usize>,
    pub(super) grads_in_registers: Option<bool>,
    /// Where the plan's CTAs per SM with register gradients spill, give up
    /// the register gradients before a CTA per SM (else the other way
    /// round): either can be the faster
    /// (`docs/benchmarks.md#persistent-engine-rpw-search`).
    pub(super) keep_ctas: bool,
}

impl VariantChoice {
    /// The search's candidates for `build` (at most [`TUNE_CANDIDATES`]
    /// `rpw` values, each also with `keep_ctas` where the CTAs per SM and
    /// the gradients' place are open, and with the gradients in memory
    /// from the first plan on where their place is open: where they fit in
    /// registers the other candidates never try that, and it can be the
    /// fastest for small batches:
    /// `docs/benchmarks.md#persistent-engine-rpw-search`).
    pub(super) fn candidates(prog: &PersistentProgram, build: &VariantBuild) -> Vec<VariantChoice> {
        let grads_open = build.grads_in_registers.is_none();
        let open = build.ctas_per_sm.is_none() && grads_open;
        let mut rpws = valid_rpws(&prog.matrices, &build.limits);
        rpws.truncate(TUNE_CANDIDATES);
        rpws.into_iter()
            .flat_map(|rpw| {
                let choice = VariantChoice::of(build, rpw);
                let kept = VariantChoice {
                    keep_ctas: true,
                    ..choice
                };
                let in_memory = VariantChoice {
                    grads_in_registers: Some(false),
                    ..choice
                };
                std::iter::once(choice)
                    .chain(open.then_some(kept))
                    .chain(grads_open.then_some(in_memory))
            })
            .collect()
    }

    /// The first plan request of this choice.
    pub(super) fn request(&self) -> PlanRequest {
        PlanRequest {
            rpw: self.rpw,
            ctas_per_sm: self.ctas_per_sm,
            grads_in_registers: self.grads_in_registers,
        }
    }

    /// The request to try after the plan of `request`, with `(ctas per SM,
    /// gradients in registers)` = `chosen`, failed (spilled or could not be
    /// resident): one CTA per SM fewer (twice the registers per thread),
    /// else the gradients outside registers, or with `keep_ctas` the other
    /// way round; `None` where this choice leaves neither open.
    pub(super) fn fallback(
        &self,
        request: &PlanRequest,
        chosen: (usize, bool),
    ) -> Option<PlanRequest> {
        let fewer_ctas = self.ctas_per_sm.is_none() && chosen.0 > 1;
        let grads_out = self.grads_in_registers.is_none() && chosen.1;
        let (ctas_per_sm, grads_in_registers) = if self.keep_ctas && grads_out {
            (Some(chosen.0), Some(false))
        } else if fewer_ctas {
            (Some(chosen.0 - 1), request.grads_in_registers)
        } else if grads_out {
            (self.ctas_per_sm, Some(false))
        } else {
            return None;
        };
        Some(PlanRequest {
            rpw: self.rpw,
            ctas_per_sm,
            grads_in_registers,
        })
    }

    /// `rpw` with `build`'s options and the default fallback.
    pub(super) fn of(build: &VariantBuild, rpw: usize) -> Self {
        VariantChoice {
            rpw,
            ctas_per_sm: build.ctas_per_sm,
            grads_in_registers: build.grads_in_registers,
            keep_ctas: false,
        }
    }

    /// A remembered choice: `rpw ctas_per_sm grads_in_registers` (1 or 0);
    /// a bare `rpw` (written by earlier versions) keeps `build`'s options.
    pub(super) fn parse(text: &str, build: &VariantBuild) -> Option<Self> {
        let words: Vec<usize> = text
            .split_whitespace()
            .map(|w| w.parse().ok())
            .collect::<Option<_>>()?;
        match words[..] {
            [rpw] => Some(VariantChoice::of(build, rpw)),
            [rpw, ctas, grads] => Some(VariantChoice {
                rpw,
                ctas_per_sm: Some(ctas),
                grads_in_registers: Some(grads != 0),
                keep_ctas: false,
            }),
            _ => None,
        }
    }
}

impl VariantBuild {
    /// The kernel's options for its variants, with or without the vector
    /// epilogue ([`KernelOptions::vector_epilogue`]).
    pub(super) fn kernel_options(&self, vector_epilogue: bool) -> KernelOptions {
        KernelOptions {
            rule: self.rule,
            trace: self.trace.is_some(),
            vector_epilogue,
        }
    }

    /// The epilogues a plan's kernel is tried with, in order.
    pub(super) fn epilogues(&self) -> &'static [bool] {
        if self.vector_epilogue {
            &[true, false]
        } else {
            &[false]
        }
    }
}

/// The scheduler of a variant with `register_plan`.
pub(super) fn variant_scheduler(register_plan: &RegisterPlan, build: &VariantBuild) -> Scheduler {
    let mut scheduler = Scheduler::new(register_plan);
    scheduler.record = false;
    // product tasks carry an (input, output, bias) item per row
    scheduler.holder_item = PRODUCT_ITEM_WORDS;
    scheduler.wide_items = (build.wide_items != u32::MAX).then_some(build.wide_items as usize);
    scheduler
}

/// Plans the registers for `rpw` and compiles (or loads) its kernel.
pub(super) fn build_variant(
    device: &Arc<CudaDevice>,
    cache: &KernelCache,
    pool: &Arc<DevicePool>,
    prog: &PersistentProgram,
    build: &VariantBuild,
    choice: VariantChoice,
) -> Result<Variant> {
    // The plan budgets registers with a fixed allowance for the
    // interpreter; where the compiled kernel needs more and spills (or
    // cannot be resident) with either epilogue, the choice's fallback is
    // tried (`VariantChoice::fallback`).
    let mut request = choice.request();
    loop {
        let register_plan: RegisterPlan = plan(&prog.matrices, &build.limits, &request)?;
        let chosen = (register_plan.ctas_per_sm, register_plan.grads_in_registers);
        let mut failed = None;
        // the vector epilogue first; where it spills, the scalar one
        for &vector_epilogue in build.epilogues() {
            let built = PersistentKernel::build(
                device,
                cache,
                pool,
                register_plan.clone(),
                build.kernel_options(vector_epilogue),
                &prog.fused_source,
                &build.slots,
            );
            match built {
                Ok(kernel) => {
                    let scheduler = Arc::new(variant_scheduler(kernel.plan(), build));
                    return Ok(Variant { kernel, scheduler });
                }
                Err(e) => failed = Some(e),
            }
        }
        match choice.fallback(&request, chosen) {
            Some(next) => request = next,
            None => {
                return Err(failed.unwrap_or_else(|| model_err("no kernel was built")));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ramus_core::vpps::WIDE_PRODUCT_ITEMS;
    use ramus_nn::{build_model_with, ModelConfig, ModelOptions};

    /// Follows `choice`'s fallbacks from its first request (`chosen`: each
    /// failed plan's CTAs per SM and gradients' place) until it gives up.
    fn fallback_chain(
        choice: VariantChoice,
        chosen: &[(usize, bool)],
    ) -> Vec<(Option<usize>, Option<bool>)> {
        let mut request = choice.request();
        let mut chain = Vec::new();
        for &c in chosen {
            match choice.fallback(&request, c) {
                Some(next) => {
                    assert_eq!(next.rpw, choice.rpw);
                    chain.push((next.ctas_per_sm, next.grads_in_registers));
                    request = next;
                }
                None => break,
            }
        }
        chain
    }

    #[test]
    fn kernels_try_the_vector_epilogue_first_unless_told_otherwise() {
        let b = build(None, None);
        assert_eq!(b.epilogues(), [true, false]);
        assert!(b.kernel_options(true).vector_epilogue);
        let scalar = VariantBuild {
            vector_epilogue: false,
            ..b
        };
        assert_eq!(scalar.epilogues(), [false]);
    }

    #[test]
    fn a_failing_plan_falls_back_to_fewer_ctas_then_gradients_outside_registers() {
        let open = VariantChoice::of(&build(None, None), 2);
        // 2 CTAs with register gradients spill, then 1; the gradients go out
        // (the plan takes 2 CTAs again), which spills too, then 1 CTA
        // keeping the gradients out; then nothing is left
        let chain = fallback_chain(open, &[(2, true), (1, true), (2, false), (1, false)]);
        assert_eq!(
            chain,
            [(Some(1), None), (None, Some(false)), (Some(1), Some(false))]
        );
        let kept = VariantChoice {
            keep_ctas: true,
            ..open
        };
        let chain = fallback_chain(kept, &[(2, true), (2, false), (1, false)]);
        assert_eq!(chain, [(Some(2), Some(false)), (Some(1), Some(false))]);
        // fixed by the options: no fallback at all
        let fixed = VariantChoice::of(&build(Some(2), Some(true)), 2);
        assert!(fallback_chain(fixed, &[(2, true)]).is_empty());
    }

    fn build(ctas_per_sm: Option<usize>, grads_in_registers: Option<bool>) -> VariantBuild {
        VariantBuild {
            limits: DeviceLimits::hopper(132),
            ctas_per_sm,
            grads_in_registers,
            rule: UpdateRule::Sgd,
            slots: Vec::new(),
            choice_file: None,
            trace: None,
            wide_items: WIDE_PRODUCT_ITEMS,
            vector_epilogue: true,
        }
    }

    #[test]
    fn the_search_also_tries_each_rpw_with_two_ctas_kept_and_with_gradients_in_memory() {
        let cfg = ModelConfig {
            vocab: 50,
            hidden: 512,
            classes: 5,
        };
        let model = build_model_with("treelstm", &cfg, &ModelOptions::default()).expect("model");
        let prog = PersistentProgram::build(&model).expect("program");
        let open = VariantChoice::candidates(&prog, &build(None, None));
        let rpws = valid_rpws(&prog.matrices, &DeviceLimits::hopper(132));
        assert_eq!(open.len(), 3 * rpws.len().min(TUNE_CANDIDATES));
        for three in open.chunks(3) {
            assert!(three
                .iter()
                .all(|c| c.rpw == three[0].rpw && c.ctas_per_sm.is_none()));
            assert_eq!(
                three
                    .iter()
                    .map(|c| (c.keep_ctas, c.grads_in_registers))
                    .collect::<Vec<_>>(),
                [(false, None), (true, None), (false, Some(false))]
            );
        }
        // a fixed CTA count leaves nothing to keep, but the gradients'
        // place still open
        let c = VariantChoice::candidates(&prog, &build(Some(1), None));
        assert_eq!(c.len(), 2 * rpws.len().min(TUNE_CANDIDATES));
        assert!(
            c.iter().all(|c| !c.keep_ctas && c.ctas_per_sm == Some(1)),
            "{c:?}"
        );
        // a fixed gradients' place leaves one candidate per rpw
        let c = VariantChoice::candidates(&prog, &build(None, Some(false)));
        assert!(c.iter().all(|c| !c.keep_ctas), "{c:?}");
        assert_eq!(c.len(), rpws.len().min(TUNE_CANDIDATES));
    }

    #[test]
    fn a_remembered_choice_fixes_the_plan_and_old_files_still_parse() {
        let b = build(None, None);
        assert_eq!(
            VariantChoice::parse("2 2 0\n", &b),
            Some(VariantChoice {
                rpw: 2,
                ctas_per_sm: Some(2),
                grads_in_registers: Some(false),
                keep_ctas: false,
            })
        );
        assert_eq!(
            VariantChoice::parse("3\n", &b),
            Some(VariantChoice::of(&b, 3))
        );
        for bad in ["", "x", "1 2", "1 2 3 4", "-1 1 1"] {
            assert_eq!(VariantChoice::parse(bad, &b), None, "{bad:?}");
        }
    }
}
