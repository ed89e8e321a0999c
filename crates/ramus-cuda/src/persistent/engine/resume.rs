//! The persistent engine's training state in and out of the pool, for
//! resumable checkpoints: the parameter values, the optimizer's moments
//! (beside each parameter in the pool), its step count and the dropout
//! stream.

use ramus_core::{Params, Tensor};
use ramus_exec::Optimizer;
use rand_chacha::ChaCha8Rng;

use super::options::model_err;
use super::PersistentEngine;
use crate::error::Result;

impl PersistentEngine {
    /// The dropout stream where it stands (after every batch submitted).
    pub fn dropout_rng(&self) -> &ChaCha8Rng {
        &self.rng
    }

    /// Continues the dropout masks from `rng`.
    pub fn set_dropout_rng(&mut self, rng: ChaCha8Rng) {
        self.rng = rng;
    }

    /// Copies the moments and step count into `host` (the host twin for
    /// the same model). Every submitted batch must be finished.
    pub fn download_optimizer(&mut self, host: &mut Optimizer<f32>) -> Result<()> {
        self.check_idle(host)?;
        let stream = self.device.stream().clone();
        let total = self.prog.params.total;
        let all = self
            .transfer
            .download_to_vec(self.buffer.view().slice(0..total)?, &stream)?;
        let layout = &self.prog.params;
        let pick = |offsets: &[usize], like: &[Tensor<f32>]| -> Result<Vec<Tensor<f32>>> {
            like.iter()
                .enumerate()
                .map(|(p, t)| match t.is_empty() {
                    true => Ok(t.clone()),
                    false => Tensor::from_vec(
                        t.shape(),
                        all[offsets[p]..offsets[p] + layout.len[p]].to_vec(),
                    )
                    .map_err(|e| model_err(format!("optimizer state of parameter {p}: {e}"))),
                })
                .collect()
        };
        let first = pick(&layout.first, host.first_moments())?;
        let second = pick(&layout.second, host.second_moments())?;
        host.restore(self.steps, first, second).map_err(model_err)
    }

    /// Makes `host`'s moments and step count the engine's. Every submitted
    /// batch must be finished.
    pub fn upload_optimizer(&mut self, host: &Optimizer<f32>) -> Result<()> {
        self.check_idle(host)?;
        let stream = self.device.stream().clone();
        let total = self.prog.params.total;
        let view = self.buffer.view().slice(0..total)?;
        let mut all = self.transfer.download_to_vec(view, &stream)?;
        let layout = &self.prog.params;
        for (offsets, moments) in [
            (&layout.first, host.first_moments()),
            (&layout.second, host.second_moments()),
        ] {
            for (p, t) in moments.iter().enumerate() {
                if t.is_empty() {
                    continue;
                }
                if t.len() != layout.len[p] {
                    return Err(model_err(format!(
                        "optimizer state of parameter {p}: {} values for {}",
                        t.len(),
                        layout.len[p]
                    )));
                }
                all[offsets[p]..offsets[p] + t.len()].copy_from_slice(t.data());
            }
        }
        self.transfer.upload_slice(&all, view, &stream)?;
        self.transfer.wait()?;
        self.steps = host.steps();
        Ok(())
    }

    /// Makes `params` the engine's parameter values. Every submitted
    /// batch must be finished.
    pub fn upload_params(&mut self, params: &Params<f32>) -> Result<()> {
        self.check_no_pending()?;
        let layout = &self.prog.params;
        if params.values.len() != layout.len.len() {
            return Err(model_err(format!(
                "{} parameter tensors for an engine of {}",
                params.values.len(),
                layout.len.len()
            )));
        }
        let stream = self.device.stream().clone();
        let view = self.buffer.view().slice(0..layout.total)?;
        let mut all = self.transfer.download_to_vec(view, &stream)?;
        for (p, t) in params.values.iter().enumerate() {
            if t.len() != layout.len[p] {
                return Err(model_err(format!(
                    "parameter {p}: {} values for {}",
                    t.len(),
                    layout.len[p]
                )));
            }
            let at = layout.value[p];
            all[at..at + t.len()].copy_from_slice(t.data());
        }
        self.transfer.upload_slice(&all, view, &stream)?;
        self.transfer.wait()
    }

    /// Batches submitted whose steps were not returned yet.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    fn check_no_pending(&self) -> Result<()> {
        match self.pending.is_empty() {
            true => Ok(()),
            false => Err(model_err(
                "the training state moves only between batches (finish them first)",
            )),
        }
    }

    fn check_idle(&self, host: &Optimizer<f32>) -> Result<()> {
        self.check_no_pending()?;
        if host.config.kind != self.optimizer.kind
            || host.first_moments().len() != self.prog.params.len.len()
        {
            return Err(model_err(format!(
                "host optimizer {:?} for {} parameters, engine {:?} for {}",
                host.config.kind,
                host.first_moments().len(),
                self.optimizer.kind,
                self.prog.params.len.len()
            )));
        }
        Ok(())
    }
}
