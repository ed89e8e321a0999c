//! Image geometry of the convolutional ops: [`Conv2dGeom`],
//! [`Pool2dGeom`] and [`NormGeom`], their checks and derived sizes.

use crate::op::{want_float, Cost};
use crate::types::{Space, ValueType};

/// Window positions along one axis: `(size + 2·padding - kernel) / stride + 1`.
pub(crate) fn windows(size: usize, padding: usize, kernel: usize, stride: usize) -> usize {
    (size + 2 * padding).saturating_sub(kernel) / stride.max(1) + 1
}

/// Errs with "NAME must be positive" for the first of `named` that is 0.
pub(crate) fn want_positive(named: &[(&str, usize)]) -> std::result::Result<(), String> {
    match named.iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => Err(format!("{name} must be positive")),
        None => Ok(()),
    }
}

/// Geometry of a 2-D convolution (one stride and padding for both axes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dGeom {
    pub in_channels: usize,
    pub height: usize,
    pub width: usize,
    pub out_channels: usize,
    pub kernel_h: usize,
    pub kernel_w: usize,
    pub stride: usize,
    pub padding: usize,
}

impl Conv2dGeom {
    /// Checks that every size is positive and the kernel fits the padded image.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let named = [
            ("in channels", self.in_channels),
            ("height", self.height),
            ("width", self.width),
            ("out channels", self.out_channels),
            ("kernel height", self.kernel_h),
            ("kernel width", self.kernel_w),
            ("stride", self.stride),
        ];
        want_positive(&named)?;
        if self.kernel_h > self.height + 2 * self.padding
            || self.kernel_w > self.width + 2 * self.padding
        {
            return Err(format!(
                "kernel {}x{} is larger than the padded image {}x{}",
                self.kernel_h,
                self.kernel_w,
                self.height + 2 * self.padding,
                self.width + 2 * self.padding
            ));
        }
        Ok(())
    }
    /// Output height `(H + 2p - kh) / s + 1`.
    pub fn out_h(&self) -> usize {
        windows(self.height, self.padding, self.kernel_h, self.stride)
    }
    /// Output width `(W + 2p - kw) / s + 1`.
    pub fn out_w(&self) -> usize {
        windows(self.width, self.padding, self.kernel_w, self.stride)
    }
    /// Width of an input row, `C*H*W`.
    pub fn in_len(&self) -> usize {
        self.in_channels * self.height * self.width
    }
    /// Width of an output row, `O*Ho*Wo`.
    pub fn out_len(&self) -> usize {
        self.out_channels * self.out_h() * self.out_w()
    }
    /// Length of one patch (a weight row), `C*kh*kw`.
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.kernel_h * self.kernel_w
    }
    /// True when im2col is the identity (1x1 kernel, stride 1, no padding).
    pub fn pointwise(&self) -> bool {
        self.kernel_h == 1 && self.kernel_w == 1 && self.stride == 1 && self.padding == 0
    }
    pub(crate) fn attrs(&self) -> String {
        format!(
            "{}x{}x{}->{},k{}x{},s{},p{}",
            self.in_channels,
            self.height,
            self.width,
            self.out_channels,
            self.kernel_h,
            self.kernel_w,
            self.stride,
            self.padding
        )
    }
    /// Names the image input in shape errors.
    pub(crate) fn input_what(&self) -> String {
        format!(
            "input ({}x{}x{} image)",
            self.in_channels, self.height, self.width
        )
    }
    /// Multiply-adds of one row's product.
    pub fn macs(&self) -> usize {
        self.out_channels * self.patch_len() * self.out_h() * self.out_w()
    }
    /// Checks a weight type: static `[O, C*kh*kw]` or `[O, C, kh, kw]`.
    pub(crate) fn check_weight(&self, w: &ValueType) -> std::result::Result<(), String> {
        want_float(w, "weight")?;
        let flat = [self.out_channels, self.patch_len()];
        let full = [
            self.out_channels,
            self.in_channels,
            self.kernel_h,
            self.kernel_w,
        ];
        if w.space != Space::Static || (w.shape != flat && w.shape != full) {
            return Err(format!(
                "weight must be static {flat:?} (O, C*kh*kw) or {full:?}, got {w}"
            ));
        }
        Ok(())
    }
}

/// Geometry of a 2-D max pooling (square window).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pool2dGeom {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl Pool2dGeom {
    /// Checks sizes; padding may be at most half the window (as in PyTorch),
    /// so every window holds at least one image element.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let named = [
            ("channels", self.channels),
            ("height", self.height),
            ("width", self.width),
            ("kernel", self.kernel),
            ("stride", self.stride),
        ];
        want_positive(&named)?;
        if 2 * self.padding > self.kernel {
            return Err(format!(
                "padding {} exceeds half the window {}",
                self.padding, self.kernel
            ));
        }
        if self.kernel > self.height + 2 * self.padding
            || self.kernel > self.width + 2 * self.padding
        {
            return Err(format!(
                "window {k}x{k} is larger than the padded image {}x{}",
                self.height + 2 * self.padding,
                self.width + 2 * self.padding,
                k = self.kernel
            ));
        }
        Ok(())
    }
    pub fn out_h(&self) -> usize {
        windows(self.height, self.padding, self.kernel, self.stride)
    }
    pub fn out_w(&self) -> usize {
        windows(self.width, self.padding, self.kernel, self.stride)
    }
    /// Width of an input row, `C*H*W`.
    pub fn in_len(&self) -> usize {
        self.channels * self.height * self.width
    }
    /// Width of an output row, `C*Ho*Wo`.
    pub fn out_len(&self) -> usize {
        self.channels * self.out_h() * self.out_w()
    }
    pub(crate) fn attrs(&self) -> String {
        format!(
            "{}x{}x{},k{},s{},p{}",
            self.channels, self.height, self.width, self.kernel, self.stride, self.padding
        )
    }
    /// Names the image input in shape errors.
    pub(crate) fn input_what(&self) -> String {
        format!(
            "input ({}x{}x{} image)",
            self.channels, self.height, self.width
        )
    }
}

/// Attributes of the batch-normalisation ops: channels, positions per
/// channel (`H*W`) and the variance epsilon.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormGeom {
    pub channels: usize,
    pub spatial: usize,
    pub eps: f64,
}

impl NormGeom {
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.channels == 0 || self.spatial == 0 {
            return Err(format!(
                "channels ({}) and positions ({}) must be positive",
                self.channels, self.spatial
            ));
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(format!(
                "eps must be finite and non-negative, got {}",
                self.eps
            ));
        }
        Ok(())
    }
    pub(crate) fn attrs(&self) -> String {
        format!("C{},S{},eps{}", self.channels, self.spatial, self.eps)
    }
    /// Width of a row, `C*S`.
    pub fn row_len(&self) -> usize {
        self.channels * self.spatial
    }
    /// Names the input rows in the forward ops' shape errors.
    pub(crate) fn input_what(&self) -> String {
        format!("input ({} channels x {})", self.channels, self.spatial)
    }
    /// Cost over `rows` rows: `flops` and `words` (4-byte reads and writes)
    /// per element of a row.
    pub(crate) fn cost(&self, rows: usize, flops: usize, words: usize) -> Cost {
        Cost {
            flops: (flops * rows * self.row_len()) as f64,
            bytes: 4.0 * (words * rows * self.row_len()) as f64,
        }
    }
}
