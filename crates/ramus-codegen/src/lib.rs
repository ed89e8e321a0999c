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
//!
//! Generating needs no GPU (compiling the source does: `ramus-cuda`).
//!
//! ```
//! use ramus_codegen::fused::FusedSource;
//! use ramus_core::fusion::{fuse, Step};
//! # use ramus_nn::{build_model, ModelConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let model = build_model("treelstm", &ModelConfig { vocab: 10, hidden: 8, classes: 5 })?;
//! // Every fused elementwise group of a model's forward vertex functions,
//! // phase by phase, as a CUDA kernel named by a hash of its source.
//! let mut kernels = Vec::new();
//! for f in &model.functions {
//!     let p = &f.forward_plan;
//!     for nodes in [&p.eager, &p.per_task, &p.lazy] {
//!         for step in fuse(&f.forward, nodes, &|_| false)?.steps {
//!             if let Step::Fused(group) = step {
//!                 kernels.push(group.kernel(&f.forward)?);
//!             }
//!         }
//!     }
//! }
//! assert!(!kernels.is_empty());
//! assert!(kernels[0].source.contains(&format!("__global__ void {}", kernels[0].name)));
//! # Ok(())
//! # }
//! ```

pub mod compiled;
pub mod fused;
pub mod persistent;
mod template;
