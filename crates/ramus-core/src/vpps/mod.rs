//! Host side of the persistent training engine (VPPS: *Virtual Persistent
//! Processor Specialization*): everything that is pure logic and does not
//! touch the device. The kernel's CUDA C++ is generated from it in
//! `ramus_codegen::persistent`.
//!
//! * [`regplan`] decides how the model's weight matrices (and, when the
//!   register file allows, their gradients) are spread over the registers of
//!   the persistent CTAs (VPPS §III-A1, Fig. 4, eq. 1), and which partition
//!   sizes (`rpw`, rows per warp) are worth compiling for the profile-guided
//!   search.
//! * [`isa`] is the instruction set: every opcode, its flags and operand
//!   layouts (a leaf the other modules import).
//! * [`script`] is the instruction encoding the generated kernel interprets:
//!   a 4-byte preamble plus 4-byte operands (VPPS §III-B1, Fig. 6c), and the
//!   one buffer that carries all per-CTA scripts to the device in a single
//!   copy (§III-B2).
//! * [`wide`] cuts a wide product instruction's GEMM into the pieces the
//!   scheduler deals over the processors (and the kernel cuts the same way).
//! * [`task`] is a batch's task DAG, the scheduler's input.
//! * [`schedule`] turns one batch's task DAG into those scripts: level
//!   scheduling by maximum depth, greedy load balancing over the virtual
//!   processors, merging of cached-matrix work onto the CTAs that hold the
//!   matrix, and signal/wait barriers between consecutive levels (§III-B1,
//!   Fig. 6d).
//! * [`simulator`] runs packed scripts on the CPU against their task graph:
//!   the oracle of the scheduler's tests.
//! * [`launches`] cuts a batch's task DAG at its host tasks (products that
//!   cuBLAS runs between launches) into the kernel launches around them.
//!
//! A *virtual persistent processor* (VPP) is one persistent CTA; the two words
//! are used interchangeably and both are numbered `0..ctas`.
//!
//! # Vocabulary
//!
//! * **plan** — decided once per model at set-up: the [`RegisterPlan`] (which
//!   CTA holds which weight rows); the *kernel* is generated for one plan.
//! * **task** — one node of a batch's DAG ([`VppTask`] in a [`VppTaskGraph`]):
//!   an instruction and its [`Placement`]. (`ramus_graph::Task` is a batch of
//!   vertices of the Cavs schedule, a different thing.)
//! * **scripts** — what the [`Scheduler`] makes of a task graph: each VPP's
//!   instruction stream with its barriers ([`BatchScripts`], packed for the
//!   device as [`PackedScripts`]). Not a "schedule": that word is
//!   `ramus_graph::Schedule`, the batching of a model's vertices.
//! * **launch** — the part of a task graph between two host tasks.
//! * **program** is not used here: it is what `ramus-cuda` lowers a model or
//!   batch into (its task graphs and pool layout).

pub mod isa;
pub mod launches;
pub mod regplan;
pub mod schedule;
pub mod script;
pub mod simulator;
pub mod task;
pub mod wide;

pub use isa::{
    INLINE_ITEMS, MAX_INLINE_ITEM_WORDS, OP_FIRST_ENGINE, OP_HOST, OP_SIGNAL, OP_WAIT, WIDE_ITEMS,
};
pub use launches::{split_launches, Launch};
pub use regplan::{
    plan, valid_rpws, DeviceLimits, MatrixSpec, Piece, PlanRequest, RegisterPlan, CTA_THREADS,
    WARP, WARPS_PER_CTA,
};
pub use schedule::{BatchScripts, Scheduler};
pub use script::{decode, Instr, PackedScripts};
pub use simulator::{simulate, simulate_with, Simulation};
pub use task::{Placement, VppTask, VppTaskGraph};
pub use wide::{split_depth, wide_tiles, wide_work, WIDE_PRODUCT_ITEMS};
