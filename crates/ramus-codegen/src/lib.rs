//! Ramus code generation: the CUDA C++ the engines compile, generated from
//! the IR and its passes in `ramus-core`.
//!
//! * [`fused`]: the kernels of the fusion pass's elementwise groups, for
//!   the batched engine and as cases of the persistent kernel.
//! * [`compiled`]: the compiled inference engine's kernels (Cortex): a
//!   recursive model's lowered cells ([`ramus_core::lower`]) as one
//!   persistent level kernel and per-token table kernels.
//! * [`persistent`]: the persistent training engine's kernel (VPPS), for a
//!   register plan and the model's fused groups, interpreting the scripts
//!   `ramus_core::vpps` schedules.

pub mod compiled;
pub mod fused;
pub mod persistent;
mod template;
