//! Which CUDA engine runs which model, decided without a device from the
//! same code the engines run: the batched engine's plan (its `run_op`
//! matches every [`ramus_core::ops::Op`] exhaustively, elementwise ops in
//! fused groups), the compiled engine's cell lowering, the persistent
//! engine's program and instruction set, and the swap path's static or
//! dynamic step checks. `ramus inspect --support` prints the table.

use ramus_core::Model;

use crate::compiled::CompiledOptions;
use crate::error::Result;
use crate::program::Program;
use crate::swap::steps;

/// The batched engine ([`crate::CudaEngine`]): its plan builds.
pub fn batched(model: &Model) -> Result<()> {
    Program::plan(model).map(|_| ())
}

/// The compiled inference engine ([`crate::compiled::CompiledEngine`]):
/// its cells lower under the default options and its kernels' code
/// generation accepts them.
pub fn compiled(model: &Model) -> Result<()> {
    crate::compiled::lowers(model, &CompiledOptions::default())
}

/// The persistent training engine ([`crate::persistent::PersistentEngine`]).
pub fn persistent(model: &Model) -> Result<()> {
    crate::persistent::support(model)
}

/// Swap execution (`crate::swap`): a static-graph model, or a dynamic one
/// whose steps run over segments of rows.
pub fn swap(model: &Model) -> Result<()> {
    let (program, _) = Program::plan(model)?;
    steps::check_static(model, &program).or_else(|_| steps::check_dynamic(model, &program))
}
