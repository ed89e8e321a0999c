//! Ramus swap planning: training past device memory (the AutoVM policy).
//!
//! This crate is the *policy* half of AutoVM (Chapter 3 of the thesis in
//! `papers/`): it decides which tensors leave the device, after which op,
//! and when they come back, so that a training iteration runs inside a
//! device memory budget with its copies hidden behind compute. It is pure
//! host logic, independent of Ramus' graph IR and of the *mechanism* (copy
//! streams, events and pinned host buffers, which live in the CUDA back end
//! and execute a [`SwapPlan`]).
//!
//! * **Input:** a [`Trace`] — one iteration's ops in order with the tensors
//!   each reads and writes (size, [`TensorKind`]), optionally measured op
//!   times from a profiled iteration — plus a [`CostModel`] (link bandwidth
//!   and latency) and a budget.
//! * **Analysis:** [`analyze`] finds each tensor's uses, the gaps between
//!   them and their reuse distance in ops and time, and the resident bytes
//!   and working set of every op.
//! * **Planners** ([`Planner`]): [`AutoVmPlanner`] (candidates, Belady
//!   selection, earliest or profiled prefetch placement, Fig. 3.5
//!   reordering; see [`planner`]), and the baselines [`NoBudgetPlanner`]
//!   and [`LruPlanner`] (naive on-demand swapping).
//! * **Output:** a [`SwapPlan`] — per-op [`Action`]s, predicted peak
//!   memory, bytes each way and stall, and optionally a [`Layout`] fixing
//!   every allocation's offset in one arena ([`layout`]: the plan then
//!   cannot be defeated by the device allocator's fragmentation) — as JSON
//!   ([`SwapPlan::to_json`]) or a listing ([`SwapPlan::listing`]).
//! * **Simulated device:** [`Simulator`] replays a trace under a plan and a
//!   budget with one copy stream per direction, enforces the budget, checks
//!   that nothing is used while off the device and reports time and stalls.
//! * **Synthetic traces** ([`synthetic`]): VGG-, ResNet- and AlexNet-shaped
//!   CNN training, a long LSTM sequence and a batch of large trees.
//! * **Execution** ([`exec`]): the mechanism's ordering logic. The
//!   [`Executor`] walks an iteration op by op — pre-access allocation,
//!   frees after last use, offloads and prefetches ordered by events,
//!   naive on-demand LRU swapping, offsets from a plan's layout — and drives
//!   any [`SwapDevice`]: the CUDA engine's copy streams and pool, or the
//!   [`SimDevice`] that enforces a budget (counting bytes, or modelling the
//!   CUDA pool's best-fit [`OffsetAllocator`] and its fragmentation), counts
//!   transfers and checks every order and offset in the tests.
//!
//! ```
//! use ramus_swap::synthetic::{vgg19, DeviceSpeed};
//! use ramus_swap::{analyze, AutoVmPlanner, CostModel, LruPlanner, Planner, PlannerConfig};
//!
//! let trace = vgg19(32, 224, DeviceSpeed::rtx_2080_ti()).trace().unwrap();
//! let cost = CostModel::pcie3_x16();
//! let peak = analyze(&trace, &cost).peak_bytes;
//! let budget = peak * 2 / 3; // Nm = 1.5
//! let mut cfg = PlannerConfig::new(budget);
//! cfg.cost = cost;
//! let plan = AutoVmPlanner::new(cfg).plan(&trace).unwrap();
//! let lru = LruPlanner::new(budget, cost).plan(&trace).unwrap();
//! assert!(plan.predicted.peak_bytes <= budget);
//! assert!(plan.predicted.stall_s < lru.predicted.stall_s);
//! ```
//!
//! ## Modules, bottom up
//!
//! Each module imports only modules listed before it (no import cycles),
//! so the crate reads from the top of this list down:
//!
//! | module | what it holds | builds on |
//! | --- | --- | --- |
//! | [`trace`] | the input: ops and the tensors they use | — |
//! | [`cost`] | copy and op times, byte and time formatting | trace |
//! | [`error`] | planning, layout and replay errors | trace, cost |
//! | [`analysis`] | liveness, reuse gaps, resident bytes | trace, cost |
//! | [`plan`] | the output: actions, prediction, layout data | error |
//! | [`sim`] | replaying a plan on a simulated device | plan |
//! | [`layout`] | laying a plan out in one arena | plan, sim |
//! | [`planner`] | the AutoVM planner, step by step | analysis, sim, layout |
//! | [`baseline`] | no-budget and LRU planners | planner (trait), sim |
//! | [`exec`] | executing a plan on any [`SwapDevice`] | plan, layout |
//! | [`offset_allocator`] | the best-fit allocator of the CUDA pool | — |
//! | [`simdev`] | the simulated [`SwapDevice`] | exec, offset_allocator |
//! | [`synthetic`] | synthetic training traces | trace |

pub mod analysis;
pub mod baseline;
pub mod cost;
pub mod error;
pub mod exec;
pub mod layout;
pub mod offset_allocator;
pub mod plan;
pub mod planner;
pub mod sim;
pub mod simdev;
pub mod synthetic;
pub mod trace;

pub use analysis::{analyze, Analysis, ReuseGap, TensorLiveness};
pub use baseline::{LruPlanner, NoBudgetPlanner};
pub use cost::{human_bytes, human_seconds, CostModel};
pub use error::{LayoutError, PlanError, SimError};
pub use exec::{ExecOptions, ExecReport, Executor, ExecutorError, SwapDevice};
pub use offset_allocator::{aligned_size, Allocation, OffsetAllocator, ALIGNMENT};
pub use plan::{Action, Block, Layout, OffloadDecision, Policy, Prediction, SwapPlan};
pub use planner::{
    AutoVmPlanner, Candidate, PlacementOrder, Planner, PlannerConfig, PrefetchTiming, Selection,
};
pub use sim::{Direction, SimReport, Simulator, TransferRecord};
pub use simdev::{SimDevice, SimDeviceCounts};
pub use trace::{OpInfo, Phase, TensorId, TensorInfo, TensorKind, Trace, TraceBuilder, TraceError};
