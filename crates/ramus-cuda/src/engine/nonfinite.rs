//! Non-finite training steps on the CUDA engine. The optimizer's norm
//! kernel checks the loss and every gradient and holds the update back if
//! one is not finite (see [`crate::optimizer`]); its status comes back
//! behind the step with one asynchronous copy. The host reads it once it
//! has synchronized with the stream anyway — when the next step's loss
//! comes back, or at the end of an epoch — so a step's outcome is known one
//! step late and the check costs no host round trip of its own.

use ramus_core::Model;
use ramus_exec::nonfinite::{first_nonfinite_value, NonFiniteParam, TensorPart};
use ramus_exec::Range;
use ramus_exec::{NonFiniteStep, StepOutcome};

use super::CudaEngine;

/// The loss a submitted step reports once its status is back: known on
/// the host, or the one its update checked on the device (a data-parallel
/// step's, summed over the ranks with the gradients).
#[derive(Clone, Copy, Debug)]
pub(crate) enum StepLoss {
    Host(f64),
    Device,
}
use crate::error::Result;
use crate::optimizer::StepStatus;
use crate::pool::DeviceView;

impl CudaEngine {
    /// The outcome of the last training step whose outcome was not taken
    /// yet: its loss, or why its update was held back. Reads its status
    /// (waiting only if the host has not synchronized with the stream since
    /// the step; the loss of a later step already did) and, for a skipped
    /// step, names the first non-finite parameter (reading the parameters
    /// back: the slow path).
    pub(crate) fn settle_step(&mut self) -> Result<Option<StepOutcome>> {
        let Some(pending) = self.pending_loss.take() else {
            return Ok(None);
        };
        let status = match self.optimizer.as_mut() {
            Some((_, opt)) => opt.take_status()?,
            None => None,
        };
        let loss = match (pending, status) {
            (StepLoss::Host(loss), _) => loss,
            (StepLoss::Device, Some(status)) => f64::from(status.loss),
            (StepLoss::Device, None) => f64::NAN,
        };
        match status {
            Some(StepStatus { applied: true, .. }) => Ok(Some(Ok(loss))),
            Some(status) => {
                let param = self.first_nonfinite(status.nonfinite_gradient)?;
                Ok(Some(Err(NonFiniteStep { loss, param })))
            }
            // the optimizer was rebuilt (new parameter buffers or a new
            // kind of update) before the status was read: the loss decides
            None if loss.is_finite() => Ok(Some(Ok(loss))),
            None => Ok(Some(Err(NonFiniteStep { loss, param: None }))),
        }
    }

    /// The first non-finite parameter of a skipped step: the first whose
    /// value is not finite (read back from the device), else the one whose
    /// gradient the optimizer found.
    fn first_nonfinite(&mut self, gradient: Option<usize>) -> Result<Option<NonFiniteParam>> {
        let views = self.param_views()?.values.clone();
        let stream = self.device.stream().clone();
        let values = views
            .into_iter()
            .map(|v| self.staging.download_to_vec(v, &stream))
            .collect::<Result<Vec<_>>>()?;
        let value = first_nonfinite_value(&self.param_names, &values);
        Ok(value.or_else(|| {
            gradient.map(|p| NonFiniteParam {
                index: p,
                name: self.param_names.get(p).cloned().unwrap_or_default(),
                part: TensorPart::Gradient,
            })
        }))
    }

    /// The loss of the last train-mode forward pass on the device (one
    /// float in the batch arena, alive until the next pass), if it has one.
    pub(super) fn loss_view(&self, model: &Model) -> Result<Option<DeviceView<f32>>> {
        let head = &model.head;
        let rows = Range::rows_only(self.state.head_vertices.len());
        let v = self.float_view(&head.forward, head.loss, &self.state.head_fwd, None, rows)?;
        (!v.is_empty()).then(|| v.slice(0..1)).transpose()
    }
}
