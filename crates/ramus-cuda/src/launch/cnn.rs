//! Launchers of the CNN kernels of `builtin.cu` (convolution lowering,
//! pooling, per-channel reductions and batch normalisation). Images are rows
//! of `C*H*W` floats in CHW order, as in `ramus_core::ops::cnn`, whose CPU
//! kernels these match (batch normalisation: `norm.rs`). Every launcher
//! checks its geometry (so no kernel divides by a zero stride or scans an
//! empty window) and that each view holds what the kernel touches.

use cudarc::driver::{CudaStream, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};

use ramus_core::ops::{Conv2dGeom, NormGeom, Pool2dGeom};

use super::{elementwise_cfg, u32_arg, Builtin, Launcher};
use crate::error::{CudaError, InCall, Result};
use crate::pool::DeviceView;

/// Threads per block of the per-channel reductions (`NORM_THREADS` in
/// `builtin.cu`).
const NORM_THREADS: u32 = 512;

/// The extents of a per-channel op: `rows` images of `channels` channels
/// of `spatial` positions each (rows of `C*S` floats, channel-major).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelShape {
    pub rows: usize,
    pub channels: usize,
    pub spatial: usize,
}

/// Where [`Launcher::im2col`] puts column entry `(image i, patch row k,
/// position p)` and where [`Launcher::col2im`] reads it:
/// `i * image_stride + k * ld + p`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColumnLayout {
    pub image_stride: usize,
    pub ld: usize,
}

impl ColumnLayout {
    /// One `[K, P]` matrix per image, one after the other (the forward
    /// product and the input gradient).
    pub fn per_image(patch_len: usize, positions: usize) -> Self {
        ColumnLayout {
            image_stride: patch_len * positions,
            ld: positions,
        }
    }

    /// One `[K, images * P]` matrix holding every image's positions side by
    /// side (the weight gradient's single product over all images).
    pub fn side_by_side(images: usize, positions: usize) -> Self {
        ColumnLayout {
            image_stride: positions,
            ld: images * positions,
        }
    }

    /// Elements spanned by `images` images of `patch_len` rows of
    /// `positions` columns.
    fn extent(&self, images: usize, patch_len: usize, positions: usize) -> Option<usize> {
        if images == 0 || patch_len == 0 || positions == 0 {
            return Some(0);
        }
        (images - 1)
            .checked_mul(self.image_stride)?
            .checked_add((patch_len - 1).checked_mul(self.ld)?)?
            .checked_add(positions)
    }
}

/// im2col or col2im with its name in errors, over `total` threads.
#[derive(Clone, Copy)]
struct ColumnKernel {
    kernel: Builtin,
    call: &'static str,
    total: usize,
}

/// `struct ConvGeom` of `builtin.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RawConvGeom {
    channels: u32,
    height: u32,
    width: u32,
    kernel_h: u32,
    kernel_w: u32,
    stride: u32,
    padding: u32,
    out_h: u32,
    out_w: u32,
    pad: u32,
}

// SAFETY: `repr(C)` plain data of ten u32, laid out as `struct ConvGeom` in
// `builtin.cu`, passed by value.
unsafe impl DeviceRepr for RawConvGeom {}

/// `struct PoolGeom` of `builtin.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RawPoolGeom {
    channels: u32,
    height: u32,
    width: u32,
    kernel: u32,
    stride: u32,
    padding: u32,
    out_h: u32,
    out_w: u32,
}

// SAFETY: `repr(C)` plain data of eight u32, laid out as `struct PoolGeom`
// in `builtin.cu`, passed by value.
unsafe impl DeviceRepr for RawPoolGeom {}

pub(super) fn bad(message: String) -> CudaError {
    CudaError::BadArgument(message)
}

/// Checks that `view` (named `what`) holds at least `len` elements.
pub(super) fn holds<T: crate::pool::DeviceScalar>(
    view: &DeviceView<T>,
    len: usize,
    what: &str,
    op: &str,
) -> Result<()> {
    if view.len() < len {
        return Err(bad(format!(
            "{op}: {what} holds {} elements, needs {len}",
            view.len()
        )));
    }
    Ok(())
}

/// Checks that the input `x` and the output gradient `dy` each hold
/// `total` elements.
pub(super) fn holds_input_and_gradient(
    x: &DeviceView<f32>,
    dy: &DeviceView<f32>,
    total: usize,
    op: &str,
) -> Result<()> {
    holds(x, total, "the input", op)?;
    holds(dy, total, "the output gradient", op)
}

/// `a * b`, an error instead of an overflow.
pub(super) fn mul(a: usize, b: usize, op: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| bad(format!("{op}: size {a} x {b} overflows")))
}

/// The kernel form of a valid convolution geometry whose per-image sizes
/// fit the kernels' 32-bit index arithmetic.
fn conv_geom(g: &Conv2dGeom, op: &str) -> Result<RawConvGeom> {
    g.validate().map_err(|e| bad(format!("{op}: {e}")))?;
    let positions = g.out_h() * g.out_w();
    // bounds every u32 value the kernels form: pixel, patch-row and
    // position indices, and oy * stride + kernel <= H + 2 * padding + kernel
    let largest = [
        g.in_len(),
        mul(g.patch_len(), positions, op)?,
        g.height + 2 * g.padding + g.kernel_h,
        g.width + 2 * g.padding + g.kernel_w,
    ];
    if largest.iter().any(|&v| v >= u32::MAX as usize) {
        return Err(bad(format!("{op}: an image of this geometry is too large")));
    }
    Ok(RawConvGeom {
        channels: u32_arg(g.in_channels, "channels")?,
        height: u32_arg(g.height, "height")?,
        width: u32_arg(g.width, "width")?,
        kernel_h: u32_arg(g.kernel_h, "kernel height")?,
        kernel_w: u32_arg(g.kernel_w, "kernel width")?,
        stride: u32_arg(g.stride, "stride")?,
        padding: u32_arg(g.padding, "padding")?,
        out_h: u32_arg(g.out_h(), "output height")?,
        out_w: u32_arg(g.out_w(), "output width")?,
        pad: 0,
    })
}

fn pool_geom(g: &Pool2dGeom, op: &str) -> Result<RawPoolGeom> {
    g.validate().map_err(|e| bad(format!("{op}: {e}")))?;
    // as for convolutions: indices and window ends fit 32 bits
    let largest = [
        g.in_len(),
        g.out_len(),
        g.height + 2 * g.padding + g.kernel,
        g.width + 2 * g.padding + g.kernel,
    ];
    if largest.iter().any(|&v| v >= u32::MAX as usize) {
        return Err(bad(format!("{op}: an image of this geometry is too large")));
    }
    Ok(RawPoolGeom {
        channels: u32_arg(g.channels, "channels")?,
        height: u32_arg(g.height, "height")?,
        width: u32_arg(g.width, "width")?,
        kernel: u32_arg(g.kernel, "kernel")?,
        stride: u32_arg(g.stride, "stride")?,
        padding: u32_arg(g.padding, "padding")?,
        out_h: u32_arg(g.out_h(), "output height")?,
        out_w: u32_arg(g.out_w(), "output width")?,
    })
}

/// Channels and positions of a per-channel op, checked positive.
fn channel_dims(channels: usize, spatial: usize, op: &str) -> Result<(u32, u32)> {
    if channels == 0 || spatial == 0 {
        return Err(bad(format!(
            "{op}: channels ({channels}) and positions ({spatial}) must be positive"
        )));
    }
    Ok((
        u32_arg(channels, "channels")?,
        u32_arg(spatial, "positions")?,
    ))
}

pub(super) fn norm_dims(n: &NormGeom, op: &str) -> Result<(u32, u32)> {
    n.validate().map_err(|e| bad(format!("{op}: {e}")))?;
    channel_dims(n.channels, n.spatial, op)
}

/// `rows` as a kernel argument of a per-channel reduction, whose 32-bit
/// element counter runs to `rows * spatial` (plus a block's stride).
pub(super) fn reduction_rows(rows: usize, spatial: usize, op: &str) -> Result<u32> {
    let count = mul(rows, spatial, op)?;
    if count > (u32::MAX - NORM_THREADS) as usize {
        return Err(bad(format!(
            "{op}: {rows} rows of {spatial} positions per channel are too many to reduce"
        )));
    }
    u32_arg(rows, "rows")
}

/// One block of [`NORM_THREADS`] threads per channel.
pub(super) fn per_channel_cfg(channels: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (channels, 1, 1),
        block_dim: (NORM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Launcher {
    /// Launches `launch` over `cfg` (`call` names it in errors) and counts
    /// the launch.
    ///
    /// # Safety
    ///
    /// As for [`LaunchArgs::launch`]: the arguments pushed onto `launch`
    /// match its kernel, and every view among them holds what the kernel
    /// touches under `cfg`.
    pub(super) unsafe fn launch_counted(
        &self,
        launch: &mut LaunchArgs<'_>,
        cfg: LaunchConfig,
        call: &'static str,
    ) -> Result<()> {
        // SAFETY: the caller's contract above.
        unsafe { launch.launch(cfg) }.in_call(call)?;
        self.count();
        Ok(())
    }

    /// Checks that the per-channel output `out` holds `channels` elements
    /// and, when there are no rows, fills them with zeros: `Ok(true)` then
    /// (nothing left to launch).
    pub(super) fn zeros_without_rows(
        &self,
        stream: &CudaStream,
        out: DeviceView<f32>,
        channels: usize,
        rows: usize,
        op: &str,
    ) -> Result<bool> {
        holds(&out, channels, "the output", op)?;
        if rows == 0 {
            self.fill(stream, out.slice(0..channels)?, 0.0)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Lowers `images` images (rows of `C*H*W` in `x`) to convolution
    /// columns in `cols`, laid out as `layout` says (`K = C*kh*kw` patch
    /// rows of `P = Ho*Wo` positions per image; 0 where a tap falls in the
    /// padding). A 1x1, stride-1 geometry makes it a plain rearrangement of
    /// channel-major rows.
    pub fn im2col(
        &self,
        stream: &CudaStream,
        cols: DeviceView<f32>,
        x: DeviceView<f32>,
        geom: &Conv2dGeom,
        images: usize,
        layout: ColumnLayout,
    ) -> Result<()> {
        const OP: &str = "im2col";
        let g = conv_geom(geom, OP)?;
        let positions = geom.out_h() * geom.out_w();
        let total = mul(images, mul(geom.patch_len(), positions, OP)?, OP)?;
        if total == 0 {
            return Ok(());
        }
        holds(&x, mul(images, geom.in_len(), OP)?, "the input", OP)?;
        check_columns(&cols, layout, images, geom.patch_len(), positions, OP)?;
        let kernel = ColumnKernel {
            kernel: Builtin::Im2col,
            call: "cuLaunchKernel(ramus_im2col)",
            total,
        };
        self.column_kernel(stream, kernel, (cols, x), g, images, layout)
    }

    /// The adjoint of [`Launcher::im2col`]: every pixel of the `images` rows
    /// of `x` becomes the sum of the column entries im2col would read from
    /// it (one thread per pixel, no atomics).
    pub fn col2im(
        &self,
        stream: &CudaStream,
        x: DeviceView<f32>,
        cols: DeviceView<f32>,
        geom: &Conv2dGeom,
        images: usize,
        layout: ColumnLayout,
    ) -> Result<()> {
        const OP: &str = "col2im";
        let g = conv_geom(geom, OP)?;
        let total = mul(images, geom.in_len(), OP)?;
        if total == 0 {
            return Ok(());
        }
        holds(&x, total, "the output", OP)?;
        let positions = geom.out_h() * geom.out_w();
        check_columns(&cols, layout, images, geom.patch_len(), positions, OP)?;
        let kernel = ColumnKernel {
            kernel: Builtin::Col2im,
            call: "cuLaunchKernel(ramus_col2im)",
            total,
        };
        self.column_kernel(stream, kernel, (x, cols), g, images, layout)
    }

    /// Launches im2col or col2im (`kernel`) with arguments `(dst, src, g,
    /// images, image_stride, ld)`; the callers check that the views hold
    /// what the layout spans.
    fn column_kernel(
        &self,
        stream: &CudaStream,
        kernel: ColumnKernel,
        (dst, src): (DeviceView<f32>, DeviceView<f32>),
        g: RawConvGeom,
        images: usize,
        layout: ColumnLayout,
    ) -> Result<()> {
        let ColumnKernel {
            kernel,
            call,
            total,
        } = kernel;
        let (n, stride, ld) = (
            u32_arg(images, "images")?,
            layout.image_stride as u64,
            layout.ld as u64,
        );
        let mut launch = stream.launch_builder(self.function(kernel));
        launch
            .arg(dst.kernel_arg())
            .arg(src.kernel_arg())
            .arg(&g)
            .arg(&n)
            .arg(&stride)
            .arg(&ld);
        // SAFETY: arguments match the kernel; `x` holds `images` rows and
        // `cols` every entry of the layout (checked by the callers).
        unsafe { self.launch_counted(&mut launch, elementwise_cfg(total), call) }
    }

    /// Max pooling of `rows` image rows of `x` into `y`.
    pub fn max_pool2d(
        &self,
        stream: &CudaStream,
        y: DeviceView<f32>,
        x: DeviceView<f32>,
        geom: &Pool2dGeom,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "max_pool2d";
        let g = pool_geom(geom, OP)?;
        let total = mul(rows, geom.out_len(), OP)?;
        if total == 0 {
            return Ok(());
        }
        holds(&x, mul(rows, geom.in_len(), OP)?, "the input", OP)?;
        holds(&y, total, "the output", OP)?;
        let r = u32_arg(rows, "rows")?;
        let mut launch = stream.launch_builder(self.function(Builtin::MaxPool2d));
        launch
            .arg(y.kernel_arg())
            .arg(x.kernel_arg())
            .arg(&g)
            .arg(&r);
        // SAFETY: arguments match the kernel; sizes checked above; the
        // geometry is valid, so every window holds a pixel.
        unsafe {
            self.launch_counted(
                &mut launch,
                elementwise_cfg(total),
                "cuLaunchKernel(ramus_max_pool2d)",
            )
        }
    }

    /// The gradient of max pooling: `dx` (rows of `C*H*W`) from the forward
    /// input `x` and the output gradient `dy`, each window's argmax
    /// recomputed (first maximum wins ties).
    pub fn max_pool2d_backward(
        &self,
        stream: &CudaStream,
        dx: DeviceView<f32>,
        x: DeviceView<f32>,
        dy: DeviceView<f32>,
        geom: &Pool2dGeom,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "max_pool2d_backward";
        let g = pool_geom(geom, OP)?;
        let total = mul(rows, geom.in_len(), OP)?;
        if total == 0 {
            return Ok(());
        }
        holds(&x, total, "the input", OP)?;
        holds(&dx, total, "the output", OP)?;
        holds(
            &dy,
            mul(rows, geom.out_len(), OP)?,
            "the output gradient",
            OP,
        )?;
        let r = u32_arg(rows, "rows")?;
        let mut launch = stream.launch_builder(self.function(Builtin::MaxPool2dBackward));
        launch
            .arg(dx.kernel_arg())
            .arg(x.kernel_arg())
            .arg(dy.kernel_arg())
            .arg(&g)
            .arg(&r);
        // SAFETY: arguments match the kernel; sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                elementwise_cfg(total),
                "cuLaunchKernel(ramus_max_pool2d_backward)",
            )
        }
    }

    /// `y[r, c] = mean over the positions of x[r, c]` (rows `[C*S]` → `[C]`).
    pub fn global_avg_pool(
        &self,
        stream: &CudaStream,
        y: DeviceView<f32>,
        x: DeviceView<f32>,
        shape: ChannelShape,
    ) -> Result<()> {
        let ChannelShape {
            rows,
            channels,
            spatial,
        } = shape;
        const OP: &str = "global_avg_pool";
        let (c, s) = channel_dims(channels, spatial, OP)?;
        let total = mul(rows, channels, OP)?;
        if total == 0 {
            return Ok(());
        }
        holds(&x, mul(total, spatial, OP)?, "the input", OP)?;
        holds(&y, total, "the output", OP)?;
        let r = u32_arg(rows, "rows")?;
        let mut launch = stream.launch_builder(self.function(Builtin::GlobalAvgPool));
        launch
            .arg(y.kernel_arg())
            .arg(x.kernel_arg())
            .arg(&r)
            .arg(&c)
            .arg(&s);
        // SAFETY: arguments match the kernel; sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                elementwise_cfg(total),
                "cuLaunchKernel(ramus_global_avg_pool)",
            )
        }
    }

    /// `dx[r, c, j] = dy[r, c] / S`.
    pub fn global_avg_pool_backward(
        &self,
        stream: &CudaStream,
        dx: DeviceView<f32>,
        dy: DeviceView<f32>,
        shape: ChannelShape,
    ) -> Result<()> {
        let op = "global_avg_pool_backward";
        self.per_element(
            stream,
            Builtin::GlobalAvgPoolBackward,
            (op, "cuLaunchKernel(ramus_global_avg_pool_backward)"),
            dx,
            (dy, mul(shape.rows, shape.channels, op)?),
            shape,
        )
    }

    /// `y[r, c, j] = b[c]` for `rows` rows.
    pub fn channel_broadcast(
        &self,
        stream: &CudaStream,
        y: DeviceView<f32>,
        b: DeviceView<f32>,
        shape: ChannelShape,
    ) -> Result<()> {
        self.per_element(
            stream,
            Builtin::ChannelBroadcast,
            (
                "channel_broadcast",
                "cuLaunchKernel(ramus_channel_broadcast)",
            ),
            y,
            (b, shape.channels),
            shape,
        )
    }

    /// A kernel `(out, in, rows, channels, spatial)` with one thread per
    /// output element of `rows` rows of `C*S`; `input` must hold its given
    /// number of elements. `names`: the op (for messages) and the call.
    fn per_element(
        &self,
        stream: &CudaStream,
        kernel: Builtin,
        (op, call): (&str, &'static str),
        out: DeviceView<f32>,
        input: (DeviceView<f32>, usize),
        shape: ChannelShape,
    ) -> Result<()> {
        let ChannelShape {
            rows,
            channels,
            spatial,
        } = shape;
        let (c, s) = channel_dims(channels, spatial, op)?;
        let total = mul(rows, mul(channels, spatial, op)?, op)?;
        if total == 0 {
            return Ok(());
        }
        holds(&out, total, "the output", op)?;
        holds(&input.0, input.1, "the input", op)?;
        let r = u32_arg(rows, "rows")?;
        let mut launch = stream.launch_builder(self.function(kernel));
        launch
            .arg(out.kernel_arg())
            .arg(input.0.kernel_arg())
            .arg(&r)
            .arg(&c)
            .arg(&s);
        // SAFETY: the kernel takes (out, in, rows, channels, spatial) and
        // writes `total` elements of `out`, reading inside `input.1`
        // elements of the input (sizes checked above).
        unsafe { self.launch_counted(&mut launch, elementwise_cfg(total), call) }
    }

    /// `y = x * coef[2c] + coef[2c + 1]` per channel (batch normalisation
    /// once its coefficients are known).
    pub fn channel_affine(
        &self,
        stream: &CudaStream,
        y: DeviceView<f32>,
        x: DeviceView<f32>,
        coef: DeviceView<f32>,
        shape: ChannelShape,
    ) -> Result<()> {
        let ChannelShape {
            rows,
            channels,
            spatial,
        } = shape;
        const OP: &str = "channel_affine";
        let (c, s) = channel_dims(channels, spatial, OP)?;
        let total = mul(rows, mul(channels, spatial, OP)?, OP)?;
        if total == 0 {
            return Ok(());
        }
        holds(&y, total, "the output", OP)?;
        holds(&x, total, "the input", OP)?;
        holds(&coef, 2 * channels, "the coefficients", OP)?;
        let r = u32_arg(rows, "rows")?;
        let mut launch = stream.launch_builder(self.function(Builtin::ChannelAffine));
        launch
            .arg(y.kernel_arg())
            .arg(x.kernel_arg())
            .arg(coef.kernel_arg())
            .arg(&r)
            .arg(&c)
            .arg(&s);
        // SAFETY: arguments match the kernel; sizes checked above.
        unsafe {
            self.launch_counted(
                &mut launch,
                elementwise_cfg(total),
                "cuLaunchKernel(ramus_channel_affine)",
            )
        }
    }

    /// `out[c] = Σ x[r, c, j]` over `rows` rows and the positions (summed
    /// in double); zeros when there are no rows.
    pub fn channel_sum(
        &self,
        stream: &CudaStream,
        out: DeviceView<f32>,
        x: DeviceView<f32>,
        shape: ChannelShape,
    ) -> Result<()> {
        let ChannelShape {
            rows,
            channels,
            spatial,
        } = shape;
        const OP: &str = "channel_sum";
        let (c, s) = channel_dims(channels, spatial, OP)?;
        if self.zeros_without_rows(stream, out, channels, rows, OP)? {
            return Ok(());
        }
        holds(
            &x,
            mul(rows, mul(channels, spatial, OP)?, OP)?,
            "the input",
            OP,
        )?;
        let r = reduction_rows(rows, spatial, OP)?;
        let mut launch = stream.launch_builder(self.function(Builtin::ChannelSum));
        launch
            .arg(out.kernel_arg())
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
                "cuLaunchKernel(ramus_channel_sum)",
            )
        }
    }
}

/// Checks that `cols` holds `images` images of the layout and that rows do
/// not overlap (`ld >= positions`).
fn check_columns(
    cols: &DeviceView<f32>,
    layout: ColumnLayout,
    images: usize,
    patch_len: usize,
    positions: usize,
    op: &str,
) -> Result<()> {
    if layout.ld < positions {
        return Err(bad(format!(
            "{op}: column rows of {positions} positions with a leading dimension of {}",
            layout.ld
        )));
    }
    let extent = layout
        .extent(images, patch_len, positions)
        .ok_or_else(|| bad(format!("{op}: the column layout overflows")))?;
    holds(cols, extent, "the columns", op)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::{BUILTIN_KERNELS, BUILTIN_SOURCE};

    #[test]
    fn every_listed_kernel_is_defined_and_the_enum_follows_the_list() {
        for name in BUILTIN_KERNELS {
            assert!(
                BUILTIN_SOURCE.contains(&format!("__global__ void {name}(")),
                "{name} is not defined in builtin.cu"
            );
        }
        assert_eq!(
            Builtin::EmbeddingUnkBackward as usize + 1,
            BUILTIN_KERNELS.len()
        );
        assert_eq!(
            BUILTIN_KERNELS[Builtin::RowMatMul as usize],
            "ramus_row_matmul"
        );
        assert_eq!(
            BUILTIN_KERNELS[Builtin::EmbeddingUnk as usize],
            "ramus_embedding_unk"
        );
        assert_eq!(BUILTIN_KERNELS[Builtin::Im2col as usize], "ramus_im2col");
        assert_eq!(
            BUILTIN_KERNELS[Builtin::ChannelSum as usize],
            "ramus_channel_sum"
        );
    }

    #[test]
    fn column_layouts_span_what_the_kernels_touch() {
        // 3 images of K = 4 rows of P = 5 positions
        let per = ColumnLayout::per_image(4, 5);
        assert_eq!(per.extent(3, 4, 5), Some(3 * 4 * 5));
        let side = ColumnLayout::side_by_side(3, 5);
        assert_eq!(
            side,
            ColumnLayout {
                image_stride: 5,
                ld: 15
            }
        );
        assert_eq!(side.extent(3, 4, 5), Some(3 * 4 * 5));
        assert_eq!(per.extent(0, 4, 5), Some(0));
    }

    #[test]
    fn bad_geometries_are_refused_before_any_launch() {
        let g = Conv2dGeom {
            in_channels: 3,
            height: 8,
            width: 8,
            out_channels: 4,
            kernel_h: 3,
            kernel_w: 3,
            stride: 0,
            padding: 1,
        };
        let e = conv_geom(&g, "im2col").unwrap_err().to_string();
        assert!(e.contains("stride"), "{e}");
        let ok = conv_geom(&Conv2dGeom { stride: 2, ..g }, "im2col").unwrap();
        assert_eq!((ok.out_h, ok.out_w), (4, 4));
        let p = Pool2dGeom {
            channels: 2,
            height: 8,
            width: 8,
            kernel: 2,
            stride: 2,
            padding: 2,
        };
        let e = pool_geom(&p, "max_pool2d").unwrap_err().to_string();
        assert!(e.contains("padding"), "{e}");
        assert!(channel_dims(0, 4, "channel_sum").is_err());
    }
}
