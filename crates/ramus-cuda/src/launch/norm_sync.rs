//! Launchers of synchronized batch normalisation's kernels (`builtin.cu`):
//! a rank's per-channel sums, and the coefficients from every rank's sums
//! once the engine has summed them over the ranks between the launches.
//! Layouts: `sums` holds `2C + 1` floats (`Σx`, the rows, `Σ(x - mean)²`),
//! `stats` `2C + 1` (mean, `1/sqrt(var + eps)`, the rows of every rank).

use cudarc::driver::{CudaStream, PushKernelArg};

use ramus_core::ops::{NormGeom, RUNNING_STATS_MOMENTUM};

use super::cnn::{holds, holds_input_and_gradient, mul, norm_dims, per_channel_cfg};
use super::cnn::{reduction_rows, ChannelShape};
use super::norm::{BatchNormOperands, NormGradOperands};
use super::{elementwise_cfg, Builtin, Launcher};
use crate::error::Result;
use crate::pool::DeviceView;

/// Floats of a layer's `sums` and of its `stats`.
pub fn synced_len(norm: &NormGeom) -> usize {
    2 * norm.channels + 1
}

impl Launcher {
    /// This rank's `Σx` per channel and its rows into `sums[0..C + 1]`.
    pub fn norm_sums(
        &self,
        stream: &CudaStream,
        sums: DeviceView<f32>,
        x: DeviceView<f32>,
        rows: usize,
        norm: &NormGeom,
    ) -> Result<()> {
        let c = norm.channels;
        holds(
            &sums,
            synced_len(norm),
            "the sums",
            "batch_norm (synchronized)",
        )?;
        let shape = ChannelShape {
            rows,
            channels: c,
            spatial: norm.spatial,
        };
        self.channel_sum(stream, sums.slice(0..c)?, x, shape)?;
        self.fill(stream, sums.slice(c..c + 1)?, rows as f32)
    }

    /// This rank's `Σ(x - mean)²` per channel into `sums[C + 1..]`, the
    /// mean from every rank's `sums[0..C + 1]`.
    pub fn norm_sq_dev(
        &self,
        stream: &CudaStream,
        sums: DeviceView<f32>,
        x: DeviceView<f32>,
        rows: usize,
        norm: &NormGeom,
    ) -> Result<()> {
        const OP: &str = "batch_norm (synchronized)";
        let (c, s) = norm_dims(norm, OP)?;
        holds(&sums, synced_len(norm), "the sums", OP)?;
        holds(
            &x,
            mul(rows, norm.channels * norm.spatial, OP)?,
            "the input",
            OP,
        )?;
        let r = reduction_rows(rows, norm.spatial, OP)?;
        let mut launch = stream.launch_builder(self.function(Builtin::NormSqDev));
        launch
            .arg(sums.kernel_arg())
            .arg(x.kernel_arg())
            .arg(&r)
            .arg(&c)
            .arg(&s);
        // SAFETY: arguments match the kernel (one block per channel);
        // sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                per_channel_cfg(c),
                "cuLaunchKernel(ramus_norm_sq_dev)",
            )
        }
    }

    /// From every rank's `sums`: training batch normalisation's `(a, b)`
    /// into `coef` (`2C`; `None`: a rank without rows, which only keeps
    /// the statistics and the running ones), the statistics into `stats`
    /// and the running statistics blended as
    /// [`batch_norm_coef`](Launcher::batch_norm_coef) blends them.
    pub fn batch_norm_coef_synced(
        &self,
        stream: &CudaStream,
        (coef, stats, sums): (Option<DeviceView<f32>>, DeviceView<f32>, DeviceView<f32>),
        operands: BatchNormOperands,
        norm: &NormGeom,
    ) -> Result<()> {
        const OP: &str = "batch_norm (synchronized)";
        let (c, s) = norm_dims(norm, OP)?;
        holds(&sums, synced_len(norm), "the sums", OP)?;
        holds(&stats, synced_len(norm), "the statistics", OP)?;
        holds(&operands.gamma, norm.channels, "gamma", OP)?;
        holds(&operands.beta, norm.channels, "beta", OP)?;
        if let Some(coef) = &coef {
            holds(coef, 2 * norm.channels, "the coefficients", OP)?;
        }
        if let Some((mean, var)) = &operands.running {
            holds(mean, norm.channels, "the running mean", OP)?;
            holds(var, norm.channels, "the running variance", OP)?;
        }
        let null = 0u64;
        let momentum = RUNNING_STATS_MOMENTUM;
        let mut launch = stream.launch_builder(self.function(Builtin::BatchNormCoefSynced));
        match &coef {
            Some(coef) => launch.arg(coef.kernel_arg()),
            None => launch.arg(&null),
        };
        launch
            .arg(stats.kernel_arg())
            .arg(sums.kernel_arg())
            .arg(operands.gamma.kernel_arg())
            .arg(operands.beta.kernel_arg())
            .arg(&c)
            .arg(&s)
            .arg(&norm.eps);
        match &operands.running {
            Some((mean, var)) => launch.arg(mean.kernel_arg()).arg(var.kernel_arg()),
            None => launch.arg(&null).arg(&null),
        };
        launch.arg(&momentum);
        // SAFETY: arguments match the kernel (null coefficients and running
        // statistics, which it checks, when there are none); sizes checked.
        unsafe {
            self.launch_counted(
                &mut launch,
                elementwise_cfg(norm.channels),
                "cuLaunchKernel(ramus_batch_norm_coef_synced)",
            )
        }
    }

    /// This rank's `(Σdy, Σdy·x̂)` per channel, `x̂` from every rank's
    /// `stats`, into `sums[0..C]` and `sums[C..2C]`; with `with_sd` false
    /// only `Σdy·x̂`, into `sums[0..C]` (gamma's gradient).
    pub fn norm_grad_sums(
        &self,
        stream: &CudaStream,
        (sums, with_sd): (DeviceView<f32>, bool),
        (x, dy, stats): (DeviceView<f32>, DeviceView<f32>, DeviceView<f32>),
        rows: usize,
        norm: &NormGeom,
    ) -> Result<()> {
        const OP: &str = "batch_norm_backward (synchronized)";
        let (c, s) = norm_dims(norm, OP)?;
        let cs = norm.channels;
        holds(&stats, synced_len(norm), "the statistics", OP)?;
        holds(&sums, if with_sd { 2 * cs } else { cs }, "the sums", OP)?;
        if rows == 0 {
            return self.fill(stream, sums, 0.0);
        }
        holds_input_and_gradient(&x, &dy, mul(rows, cs * norm.spatial, OP)?, OP)?;
        let r = reduction_rows(rows, norm.spatial, OP)?;
        let (null, sd, sdx) = match with_sd {
            true => (0u64, Some(sums.slice(0..cs)?), sums.slice(cs..2 * cs)?),
            false => (0u64, None, sums.slice(0..cs)?),
        };
        let mut launch = stream.launch_builder(self.function(Builtin::NormGradSums));
        match &sd {
            Some(sd) => launch.arg(sd.kernel_arg()),
            None => launch.arg(&null),
        };
        launch
            .arg(sdx.kernel_arg())
            .arg(x.kernel_arg())
            .arg(dy.kernel_arg())
            .arg(stats.kernel_arg())
            .arg(&r)
            .arg(&c)
            .arg(&s);
        // SAFETY: arguments match the kernel (one block per channel; a null
        // `sd`, which it checks); sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                per_channel_cfg(c),
                "cuLaunchKernel(ramus_norm_grad_sums)",
            )
        }
    }

    /// Training batch normalisation's input gradient from every rank's
    /// `(Σdy, Σdy·x̂)` in `sums`: the coefficients into `coef` (`3C`), then
    /// `dx = k·dy + x·q + p` as
    /// [`batch_norm_backward_input`](Launcher::batch_norm_backward_input).
    pub fn batch_norm_backward_input_synced(
        &self,
        stream: &CudaStream,
        (dx, coef): (DeviceView<f32>, DeviceView<f32>),
        operands: NormGradOperands,
        (sums, stats): (DeviceView<f32>, DeviceView<f32>),
        (rows, norm): (usize, &NormGeom),
    ) -> Result<()> {
        const OP: &str = "batch_norm_backward_input (synchronized)";
        let (c, s) = norm_dims(norm, OP)?;
        holds(&coef, 3 * norm.channels, "the coefficients", OP)?;
        holds(&sums, 2 * norm.channels, "the sums", OP)?;
        holds(&stats, synced_len(norm), "the statistics", OP)?;
        holds(&operands.gamma, norm.channels, "gamma", OP)?;
        let mut launch = stream.launch_builder(self.function(Builtin::BatchNormBackwardCoefSynced));
        launch
            .arg(coef.kernel_arg())
            .arg(sums.kernel_arg())
            .arg(stats.kernel_arg())
            .arg(operands.gamma.kernel_arg())
            .arg(&c)
            .arg(&s);
        // SAFETY: arguments match the kernel; sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                elementwise_cfg(norm.channels),
                "cuLaunchKernel(ramus_batch_norm_backward_coef_synced)",
            )
        }?;
        self.batch_norm_backward_apply(stream, dx, operands, coef, rows, norm)
    }
}
