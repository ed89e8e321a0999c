//! The batched engine's optimizer state in and out of the device (the
//! plain and swap paths share the fused optimizer), for resumable
//! checkpoints.

use ramus_exec::Optimizer;

use super::CudaEngine;
use crate::error::Result;

impl CudaEngine {
    /// Copies the fused optimizer's moments and step count into `host`.
    /// Before the first device step there is no device state: `host` (a
    /// fresh optimizer, or the one [`upload_optimizer`](Self::upload_optimizer)
    /// was given) is left as it is.
    pub fn download_optimizer(&mut self, host: &mut Optimizer<f32>) -> Result<()> {
        let stream = self.device.stream().clone();
        match &mut self.optimizer {
            Some((_, opt)) => opt.download_into(&stream, host),
            None => Ok(()),
        }
    }

    /// Makes `host`'s moments and step count the fused optimizer's: at
    /// once if it exists, else when the first training step builds it.
    pub fn upload_optimizer(&mut self, host: &Optimizer<f32>) -> Result<()> {
        let stream = self.device.stream().clone();
        match &mut self.optimizer {
            Some((_, opt)) => opt.upload_from(&stream, host),
            None => {
                self.pending_optimizer = Some(host.clone());
                Ok(())
            }
        }
    }
}
