//! The CPU batched engine under the training contract ([`ramus_exec::Engine`]):
//! each call forwards to [`CpuEngine`]'s own method.

use ramus_core::{Grads, HeadRows, Model, Params, Real};
use ramus_exec::{Batch, Engine, ForwardOutput, Mode, Result};
use rand_chacha::ChaCha8Rng;

use crate::engine::CpuEngine;

impl<T: Real> Engine<T> for CpuEngine<T> {
    fn name(&self) -> &'static str {
        "cpu-batched"
    }
    fn forward_rows(
        &mut self,
        model: &Model,
        params: &Params<T>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<T>> {
        CpuEngine::forward_rows(self, model, params, batch, mode, rows)
    }
    fn backward(
        &mut self,
        model: &Model,
        params: &Params<T>,
        batch: &Batch<'_>,
        grads: &mut Grads<T>,
    ) -> Result<()> {
        CpuEngine::backward(self, model, params, batch, grads)
    }
    fn set_seed(&mut self, seed: u64) {
        CpuEngine::set_seed(self, seed)
    }
    fn dropout_rng(&self) -> ChaCha8Rng {
        CpuEngine::dropout_rng(self).clone()
    }
    fn set_dropout_rng(&mut self, rng: ChaCha8Rng) {
        CpuEngine::set_dropout_rng(self, rng)
    }
    fn apply_running_stats(&mut self, params: &mut Params<T>) -> Result<()> {
        CpuEngine::apply_running_stats(self, params)?;
        Ok(())
    }
}
