//! Launching kernels: the built-in data-movement and reduction kernels of
//! `builtin.cu` (compiled once per device through the kernel cache) and the
//! generated fused elementwise kernels, each on a given stream, with a
//! launch counter the engines report as `kernels_per_batch`.

use std::cell::Cell;

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::cache::KernelCache;
use crate::error::{CudaError, InCall, Result};
use crate::pool::DeviceView;

mod cnn;
mod norm;
mod norm_sync;
pub use cnn::{ChannelShape, ColumnLayout};
pub use norm::{BatchNormOperands, NormGradOperands, NormStats};
pub use norm_sync::synced_len;

/// Whether an elementwise `dst ∘ src` has work: an error when their
/// lengths differ, `false` when they are empty.
fn same_len(dst: DeviceView<f32>, src: DeviceView<f32>) -> Result<bool> {
    if dst.len() != src.len() {
        return Err(CudaError::BadArgument(format!(
            "adding {} floats into {}",
            src.len(),
            dst.len()
        )));
    }
    Ok(!dst.is_empty())
}

/// Source of the built-in kernels.
pub const BUILTIN_SOURCE: &str = include_str!("builtin.cu");

/// Marks "no row" in row-index arrays (see `builtin.cu`).
pub const NONE: u32 = u32::MAX;

const BUILTIN_KERNELS: [&str; 33] = [
    "ramus_move_rows",
    "ramus_gemm_abt_small",
    "ramus_copy_columns",
    "ramus_fill",
    "ramus_scale_add",
    "ramus_sum_children",
    "ramus_expand_children",
    "ramus_sum_rows",
    "ramus_broadcast_rows",
    "ramus_softmax_xent",
    "ramus_softmax_xent_backward",
    // CNN ops (`cnn` submodule)
    "ramus_im2col",
    "ramus_col2im",
    "ramus_max_pool2d",
    "ramus_max_pool2d_backward",
    "ramus_global_avg_pool",
    "ramus_global_avg_pool_backward",
    "ramus_channel_broadcast",
    "ramus_channel_affine",
    "ramus_channel_sum",
    "ramus_batch_norm_coef",
    "ramus_batch_norm_backward_coef",
    "ramus_batch_norm_backward_apply",
    "ramus_batch_norm_backward_gamma",
    "ramus_batch_norm_inference_coef",
    "ramus_batch_norm_inference_param",
    // synchronized batch norm (`norm_sync` submodule)
    "ramus_norm_sq_dev",
    "ramus_batch_norm_coef_synced",
    "ramus_norm_grad_sums",
    "ramus_batch_norm_backward_coef_synced",
    // per-row matrices and the shared-row embedding
    "ramus_row_matmul",
    "ramus_embedding_unk",
    "ramus_embedding_unk_backward",
];

/// The built-in kernels, in the order of [`BUILTIN_KERNELS`].
#[derive(Clone, Copy)]
enum Builtin {
    MoveRows,
    GemmAbtSmall,
    CopyColumns,
    Fill,
    ScaleAdd,
    SumChildren,
    ExpandChildren,
    SumRows,
    BroadcastRows,
    SoftmaxXent,
    SoftmaxXentBackward,
    Im2col,
    Col2im,
    MaxPool2d,
    MaxPool2dBackward,
    GlobalAvgPool,
    GlobalAvgPoolBackward,
    ChannelBroadcast,
    ChannelAffine,
    ChannelSum,
    BatchNormCoef,
    BatchNormBackwardCoef,
    BatchNormBackwardApply,
    BatchNormBackwardGamma,
    BatchNormInferenceCoef,
    BatchNormInferenceParam,
    NormSqDev,
    BatchNormCoefSynced,
    NormGradSums,
    BatchNormBackwardCoefSynced,
    RowMatMul,
    EmbeddingUnk,
    EmbeddingUnkBackward,
}

/// Products with at most this many rows of `A` run on
/// [`Launcher::gemm_abt_small`] instead of cuBLAS (less host time per call;
/// the warp-per-column kernel's work grows with the rows).
pub const SMALL_GEMM_ROWS: usize = 32;

/// Threads per block of the elementwise-style kernels.
const BLOCK: u32 = 256;
/// Rows moved by one `ramus_move_rows` launch at most (`MAX_MOVES` in `builtin.cu`).
pub const MAX_MOVES: usize = 8;

/// One row movement (`RowMove` in `builtin.cu`): for `r < rows`, row
/// `dst_rows[r]` (or `r`) of `dst` receives row `src_rows[r]` (or `r`) of
/// `src`, overwriting or accumulating. A `NONE` source row gives zeros; a
/// `NONE` destination row is skipped.
#[derive(Clone, Copy, Debug)]
pub struct RowMove {
    pub dst: DeviceView<f32>,
    pub src: DeviceView<f32>,
    pub dst_rows: Option<DeviceView<u32>>,
    pub src_rows: Option<DeviceView<u32>>,
    pub rows: usize,
    pub width: usize,
    pub accumulate: bool,
}

impl RowMove {
    /// Rows `rows` of `src` (`width` floats each) into `dst`, in order.
    pub fn gather(
        dst: DeviceView<f32>,
        src: DeviceView<f32>,
        rows: DeviceView<u32>,
        width: usize,
    ) -> Self {
        RowMove {
            dst,
            src,
            dst_rows: None,
            src_rows: Some(rows),
            rows: rows.len(),
            width,
            accumulate: false,
        }
    }

    /// The rows of `src`, in order, over rows `rows` of `dst`.
    pub fn scatter(
        dst: DeviceView<f32>,
        src: DeviceView<f32>,
        rows: DeviceView<u32>,
        width: usize,
    ) -> Self {
        RowMove {
            dst_rows: Some(rows),
            src_rows: None,
            ..RowMove::gather(dst, src, rows, width)
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawRowMove {
    dst: u64,
    src: u64,
    dst_rows: u64,
    src_rows: u64,
    rows: u32,
    width: u32,
    accumulate: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawRowMoves {
    moves: [RawRowMove; MAX_MOVES],
}

// SAFETY: `RawRowMoves` is `repr(C)` plain data laid out exactly as
// `struct RowMoves` in `builtin.cu` (8-byte pointers, then four u32, no
// padding differences), passed by value.
unsafe impl DeviceRepr for RawRowMoves {}

fn grid_for(elements: usize) -> u32 {
    elements.div_ceil(BLOCK as usize).clamp(1, 65_535) as u32
}

fn u32_arg(value: usize, what: &str) -> Result<u32> {
    u32::try_from(value)
        .map_err(|_| CudaError::BadArgument(format!("{what} = {value} does not fit 32 bits")))
}

/// The built-in kernels of one device plus the launch counter.
pub struct Launcher {
    functions: Vec<CudaFunction>,
    launches: Cell<u64>,
}

impl Launcher {
    /// Compiles (or loads from the cache) the built-in kernels.
    pub fn new(cache: &KernelCache) -> Result<Self> {
        let module = cache.get_or_compile(BUILTIN_SOURCE, &BUILTIN_KERNELS)?;
        let functions = BUILTIN_KERNELS
            .iter()
            .map(|name| module.function(name).cloned())
            .collect::<Result<Vec<_>>>()?;
        Ok(Launcher {
            functions,
            launches: Cell::new(0),
        })
    }

    /// Kernels launched so far (built-in, fused and cuBLAS calls counted by
    /// the engine through [`Launcher::count`]).
    pub fn launches(&self) -> u64 {
        self.launches.get()
    }

    /// Counts a launch made elsewhere (a cuBLAS call, a copy).
    pub fn count(&self) {
        self.launches.set(self.launches.get() + 1);
    }

    fn function(&self, kernel: Builtin) -> &CudaFunction {
        &self.functions[kernel as usize]
    }

    /// Up to any number of row movements, [`MAX_MOVES`] per launch.
    pub fn move_rows(&self, stream: &CudaStream, moves: &[RowMove]) -> Result<()> {
        for chunk in moves.chunks(MAX_MOVES) {
            let mut raw = RawRowMoves::default();
            let mut widest = 0;
            let mut count = 0;
            for mv in chunk.iter().filter(|m| m.rows > 0 && m.width > 0) {
                raw.moves[count] = RawRowMove {
                    dst: mv.dst.device_ptr(),
                    src: mv.src.device_ptr(),
                    dst_rows: mv.dst_rows.map_or(0, |v| v.device_ptr()),
                    src_rows: mv.src_rows.map_or(0, |v| v.device_ptr()),
                    rows: u32_arg(mv.rows, "rows moved")?,
                    width: u32_arg(mv.width, "row width")?,
                    accumulate: mv.accumulate as u32,
                    pad: 0,
                };
                widest = widest.max(mv.rows * mv.width);
                count += 1;
            }
            if count == 0 {
                continue;
            }
            let cfg = LaunchConfig {
                grid_dim: (grid_for(widest), count as u32, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = stream.launch_builder(self.function(Builtin::MoveRows));
            launch.arg(&raw);
            // SAFETY: the struct matches the kernel's parameter; every view
            // addresses live pool memory of `rows * width` floats (indices:
            // `rows` u32) that stays allocated until the stream passes it.
            unsafe { launch.launch(cfg) }.in_call("cuLaunchKernel(ramus_move_rows)")?;
            self.count();
        }
        Ok(())
    }

    /// `c[r, j] = Σ_t a[r * lda + t] · b[j * k + t] (+ bias[j])` for `r < m`,
    /// `j < n` (`c` packed, `n` wide): `A·Bᵀ` with a row-major weight `B`
    /// (`n × k`), for few rows (see [`SMALL_GEMM_ROWS`]).
    pub fn gemm_abt_small(
        &self,
        stream: &CudaStream,
        c: DeviceView<f32>,
        operands: AbtOperands,
        (m, n, k): (usize, usize, usize),
    ) -> Result<()> {
        let AbtOperands { a, lda, b, bias } = operands;
        if m * n == 0 {
            return Ok(());
        }
        let a_needed = (m - 1) * lda + k;
        if lda < k
            || a.len() < a_needed
            || b.len() < n * k
            || c.len() < m * n
            || bias.is_some_and(|v| v.len() < n)
        {
            return Err(CudaError::BadArgument(format!(
                "small product {m}x{k} · ({n}x{k})ᵀ out of bounds (A {} floats, lda {lda}; B {}; C {})",
                a.len(),
                b.len(),
                c.len()
            )));
        }
        let (ldc, lda, m, n, k) = (
            u32_arg(n, "columns")?,
            u32_arg(lda, "leading dimension")?,
            u32_arg(m, "rows")?,
            u32_arg(n, "columns")?,
            u32_arg(k, "inner dimension")?,
        );
        let bias_arg = bias.map_or(0, |v| v.device_ptr());
        let mut launch = stream.launch_builder(self.function(Builtin::GemmAbtSmall));
        launch
            .arg(c.kernel_arg())
            .arg(&ldc)
            .arg(a.kernel_arg())
            .arg(&lda)
            .arg(b.kernel_arg())
            .arg(&bias_arg)
            .arg(&m)
            .arg(&n)
            .arg(&k);
        // SAFETY: arguments match the kernel; every view covers what the
        // kernel touches (checked above); a null bias adds nothing.
        unsafe { launch.launch(elementwise_cfg(n as usize * 32)) }
            .in_call("cuLaunchKernel(ramus_gemm_abt_small)")?;
        self.count();
        Ok(())
    }

    /// `dst[r, dst.col..dst.col + cols] = src[r, src.col..src.col + cols]`
    /// for `r < rows`.
    pub fn copy_columns(
        &self,
        stream: &CudaStream,
        dst: ColumnWindow,
        src: ColumnWindow,
        cols: usize,
        rows: usize,
    ) -> Result<()> {
        let ColumnWindow {
            data: dst,
            width: dst_width,
            col: dst_col,
        } = dst;
        let ColumnWindow {
            data: src,
            width: src_width,
            col: src_col,
        } = src;
        if rows * cols == 0 {
            return Ok(());
        }
        if dst.len() < rows * dst_width
            || src.len() < rows * src_width
            || dst_col + cols > dst_width
            || src_col + cols > src_width
        {
            return Err(CudaError::BadArgument(format!(
                "column copy of {rows}x{cols} out of bounds ({} / {} floats, widths {dst_width} / {src_width})",
                dst.len(),
                src.len()
            )));
        }
        let (dw, dc, sw, sc, c, r) = (
            u32_arg(dst_width, "width")?,
            u32_arg(dst_col, "column")?,
            u32_arg(src_width, "width")?,
            u32_arg(src_col, "column")?,
            u32_arg(cols, "columns")?,
            u32_arg(rows, "rows")?,
        );
        let mut launch = stream.launch_builder(self.function(Builtin::CopyColumns));
        launch
            .arg(dst.kernel_arg())
            .arg(&dw)
            .arg(&dc)
            .arg(src.kernel_arg())
            .arg(&sw)
            .arg(&sc)
            .arg(&c)
            .arg(&r);
        // SAFETY: arguments match the kernel; bounds checked above.
        unsafe { launch.launch(elementwise_cfg(rows * cols)) }
            .in_call("cuLaunchKernel(ramus_copy_columns)")?;
        self.count();
        Ok(())
    }

    /// `rows` whole rows of `width` floats from `src` into `dst`
    /// ([`Launcher::copy_columns`] over every column).
    pub fn copy_rows(
        &self,
        stream: &CudaStream,
        dst: DeviceView<f32>,
        src: DeviceView<f32>,
        width: usize,
        rows: usize,
    ) -> Result<()> {
        let (dst, src) = (
            ColumnWindow::whole(dst, width),
            ColumnWindow::whole(src, width),
        );
        self.copy_columns(stream, dst, src, width, rows)
    }

    /// Sets every element of `dst` to `value`.
    pub fn fill(&self, stream: &CudaStream, dst: DeviceView<f32>, value: f32) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let n = dst.len() as u64;
        let mut launch = stream.launch_builder(self.function(Builtin::Fill));
        launch.arg(dst.kernel_arg()).arg(&n).arg(&value);
        // SAFETY: `dst` holds `n` floats.
        unsafe { launch.launch(elementwise_cfg(dst.len())) }
            .in_call("cuLaunchKernel(ramus_fill)")?;
        self.count();
        Ok(())
    }

    /// `dst = a · dst + b · src` elementwise (`a` = 0: `dst` is not read;
    /// `b` = 0: `src` is not, and may be `dst`).
    pub fn scale_add(
        &self,
        stream: &CudaStream,
        (dst, a): (DeviceView<f32>, f32),
        (src, b): (DeviceView<f32>, f32),
    ) -> Result<()> {
        if !same_len(dst, src)? {
            return Ok(());
        }
        let n = dst.len() as u64;
        let mut launch = stream.launch_builder(self.function(Builtin::ScaleAdd));
        launch
            .arg(dst.kernel_arg())
            .arg(src.kernel_arg())
            .arg(&n)
            .arg(&a)
            .arg(&b);
        // SAFETY: both views hold `n` floats.
        unsafe { launch.launch(elementwise_cfg(dst.len())) }
            .in_call("cuLaunchKernel(ramus_scale_add)")?;
        self.count();
        Ok(())
    }

    /// Child sum over CSR edge offsets (`offsets.index`, absolute;
    /// `offsets.base` is subtracted); edge rows are read from column
    /// `src.col` of source rows `src.width` wide (`width` wide from column
    /// 0 for a plain value).
    pub fn sum_children(
        &self,
        stream: &CudaStream,
        dst: DeviceView<f32>,
        src: ColumnWindow,
        offsets: IndexRows,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        let IndexRows {
            index: offsets,
            base: edge_base,
        } = offsets;
        let src_window = (src.width, src.col);
        let src = src.data;
        if rows * width == 0 {
            return Ok(());
        }
        if offsets.len() < rows + 1 || dst.len() < rows * width {
            return Err(CudaError::BadArgument(
                "sum_children: offsets or output too short".into(),
            ));
        }
        let (b, r, w) = (
            u32_arg(edge_base, "edge offset")?,
            u32_arg(rows, "rows")?,
            u32_arg(width, "width")?,
        );
        let (stride, offset) = (
            u32_arg(src_window.0, "row stride")?,
            u32_arg(src_window.1, "column offset")?,
        );
        if src_window.1 + width > src_window.0 {
            return Err(CudaError::BadArgument(format!(
                "sum_children: window {}..{} outside rows of {}",
                src_window.1,
                src_window.1 + width,
                src_window.0
            )));
        }
        let mut launch = stream.launch_builder(self.function(Builtin::SumChildren));
        launch
            .arg(dst.kernel_arg())
            .arg(src.kernel_arg())
            .arg(offsets.kernel_arg())
            .arg(&b)
            .arg(&r)
            .arg(&w)
            .arg(&stride)
            .arg(&offset);
        // SAFETY: arguments match; offsets index edges inside `src` (the
        // schedule's CSR for these rows).
        unsafe { launch.launch(elementwise_cfg(rows * width)) }
            .in_call("cuLaunchKernel(ramus_sum_children)")?;
        self.count();
        Ok(())
    }

    /// Each edge row copies its parent's row (`parent.index[e] -
    /// parent.base`).
    pub fn expand_children(
        &self,
        stream: &CudaStream,
        dst: DeviceView<f32>,
        src: DeviceView<f32>,
        parent: IndexRows,
        edges: usize,
        width: usize,
    ) -> Result<()> {
        let IndexRows {
            index: parent,
            base: row_base,
        } = parent;
        if edges * width == 0 {
            return Ok(());
        }
        if parent.len() < edges || dst.len() < edges * width {
            return Err(CudaError::BadArgument(
                "expand_children: parents or output too short".into(),
            ));
        }
        let (b, e, w) = (
            u32_arg(row_base, "row offset")?,
            u32_arg(edges, "edges")?,
            u32_arg(width, "width")?,
        );
        let mut launch = stream.launch_builder(self.function(Builtin::ExpandChildren));
        launch
            .arg(dst.kernel_arg())
            .arg(src.kernel_arg())
            .arg(parent.kernel_arg())
            .arg(&b)
            .arg(&e)
            .arg(&w);
        // SAFETY: arguments match; parents index rows inside `src`.
        unsafe { launch.launch(elementwise_cfg(edges * width)) }
            .in_call("cuLaunchKernel(ramus_expand_children)")?;
        self.count();
        Ok(())
    }

    /// `out[r] = op(A_r) · op(B_r)` for `rows` rows (see `ramus_row_matmul`
    /// in `builtin.cu`); a static operand is passed with `per_row` false.
    pub fn row_matmul(
        &self,
        stream: &CudaStream,
        out: DeviceView<f32>,
        a: RowOperand,
        b: RowOperand,
        rows: usize,
        product: &ramus_core::ops::RowMatMul,
    ) -> Result<()> {
        let RowOperand {
            data: a,
            per_row: a_per_row,
        } = a;
        let RowOperand {
            data: b,
            per_row: b_per_row,
        } = b;
        let (m, k, n) = (product.m, product.k, product.n);
        if rows * m * n == 0 {
            return Ok(());
        }
        let need = |per_row: bool, size: usize| if per_row { rows * size } else { size };
        if out.len() < rows * m * n
            || a.len() < need(a_per_row, m * k)
            || b.len() < need(b_per_row, k * n)
        {
            return Err(CudaError::BadArgument(format!(
                "row_matmul: operands too short for {rows} rows of {m}x{k} · {k}x{n}"
            )));
        }
        let a_step = if a_per_row { (m * k) as u64 } else { 0 };
        let b_step = if b_per_row { (k * n) as u64 } else { 0 };
        let r = u32_arg(rows, "rows")?;
        let (m, k, n) = (u32_arg(m, "m")?, u32_arg(k, "k")?, u32_arg(n, "n")?);
        let (ta, tb) = (u32::from(product.trans_a), u32::from(product.trans_b));
        let mut launch = stream.launch_builder(self.function(Builtin::RowMatMul));
        launch
            .arg(out.kernel_arg())
            .arg(a.kernel_arg())
            .arg(&a_step)
            .arg(b.kernel_arg())
            .arg(&b_step)
            .arg(&r)
            .arg(&m)
            .arg(&k)
            .arg(&n)
            .arg(&ta)
            .arg(&tb);
        // SAFETY: arguments match the kernel's signature; every operand
        // holds the rows (or the one static matrix) read, checked above.
        unsafe { launch.launch(elementwise_cfg(rows * (m * n) as usize)) }
            .in_call("cuLaunchKernel(ramus_row_matmul)")?;
        self.count();
        Ok(())
    }

    /// `shape.rows` rows of a `[shape.table_rows, shape.width]` table by
    /// token, a token beyond the table reading row 0 (`embedding_unk`); with
    /// `backward`, the gradient rows `src` are added into a zeroed table
    /// gradient `dst` instead.
    pub fn embedding_unk(
        &self,
        stream: &CudaStream,
        dst: DeviceView<f32>,
        src: DeviceView<f32>,
        tokens: DeviceView<u32>,
        shape: EmbeddingShape,
        backward: bool,
    ) -> Result<()> {
        let EmbeddingShape {
            rows,
            table_rows,
            width,
        } = shape;
        let (table, per_row) = if backward { (dst, src) } else { (src, dst) };
        if table_rows == 0
            || table.len() < table_rows * width
            || per_row.len() < rows * width
            || tokens.len() < rows
        {
            return Err(CudaError::BadArgument(format!(
                "embedding_unk: operands too short for {rows} rows of a {table_rows}x{width} table"
            )));
        }
        if backward {
            self.fill(stream, dst, 0.0)?;
        }
        if rows * width == 0 {
            return Ok(());
        }
        let (r, t, w) = (
            u32_arg(rows, "rows")?,
            u32_arg(table_rows, "table rows")?,
            u32_arg(width, "width")?,
        );
        let kernel = if backward {
            Builtin::EmbeddingUnkBackward
        } else {
            Builtin::EmbeddingUnk
        };
        let mut launch = stream.launch_builder(self.function(kernel));
        launch
            .arg(dst.kernel_arg())
            .arg(src.kernel_arg())
            .arg(tokens.kernel_arg())
            .arg(&r)
            .arg(&t)
            .arg(&w);
        // SAFETY: arguments match the kernel's signature; the table, the
        // rows and the tokens hold what is read and written (checked above;
        // the kernel clamps tokens to the table).
        unsafe { launch.launch(elementwise_cfg(rows * width)) }
            .in_call("cuLaunchKernel(ramus_embedding_unk)")?;
        self.count();
        Ok(())
    }

    /// `dst[j] = scale * sum_r src[r, j]`.
    pub fn sum_rows(
        &self,
        stream: &CudaStream,
        dst: DeviceView<f32>,
        src: DeviceView<f32>,
        rows: usize,
        width: usize,
        scale: f32,
    ) -> Result<()> {
        if width == 0 {
            return Ok(());
        }
        if dst.len() < width || src.len() < rows * width {
            return Err(CudaError::BadArgument(
                "sum_rows: operands too short".into(),
            ));
        }
        let (r, w) = (u32_arg(rows, "rows")?, u32_arg(width, "width")?);
        let cfg = LaunchConfig {
            grid_dim: (width.div_ceil(32) as u32, 1, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(self.function(Builtin::SumRows));
        launch
            .arg(dst.kernel_arg())
            .arg(src.kernel_arg())
            .arg(&r)
            .arg(&w)
            .arg(&scale);
        // SAFETY: arguments match; sizes checked above.
        unsafe { launch.launch(cfg) }.in_call("cuLaunchKernel(ramus_sum_rows)")?;
        self.count();
        Ok(())
    }

    /// `dst[r, j] = scale * src[j]`.
    pub fn broadcast_rows(
        &self,
        stream: &CudaStream,
        dst: DeviceView<f32>,
        src: DeviceView<f32>,
        rows: usize,
        width: usize,
        scale: f32,
    ) -> Result<()> {
        if rows * width == 0 {
            return Ok(());
        }
        if dst.len() < rows * width || src.len() < width {
            return Err(CudaError::BadArgument(
                "broadcast_rows: operands too short".into(),
            ));
        }
        let (r, w) = (u32_arg(rows, "rows")?, u32_arg(width, "width")?);
        let mut launch = stream.launch_builder(self.function(Builtin::BroadcastRows));
        launch
            .arg(dst.kernel_arg())
            .arg(src.kernel_arg())
            .arg(&r)
            .arg(&w)
            .arg(&scale);
        // SAFETY: arguments match; sizes checked above.
        unsafe { launch.launch(elementwise_cfg(rows * width)) }
            .in_call("cuLaunchKernel(ramus_broadcast_rows)")?;
        self.count();
        Ok(())
    }

    /// Per-row softmax cross-entropy, or (with `upstream`) its gradient.
    /// Labels must be below `classes` (the engine checks them on the host).
    pub fn softmax_xent(
        &self,
        stream: &CudaStream,
        out: DeviceView<f32>,
        operands: XentOperands,
        rows: usize,
        classes: usize,
    ) -> Result<()> {
        let XentOperands {
            scores,
            labels,
            upstream,
        } = operands;
        if rows == 0 {
            return Ok(());
        }
        if scores.len() < rows * classes || labels.len() < rows {
            return Err(CudaError::BadArgument(
                "softmax_xent: operands too short".into(),
            ));
        }
        let (r, c) = (u32_arg(rows, "rows")?, u32_arg(classes, "classes")?);
        let cfg = LaunchConfig {
            grid_dim: (rows.min(65_535) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let kernel = if upstream.is_some() {
            Builtin::SoftmaxXentBackward
        } else {
            Builtin::SoftmaxXent
        };
        let mut launch = stream.launch_builder(self.function(kernel));
        launch
            .arg(out.kernel_arg())
            .arg(scores.kernel_arg())
            .arg(labels.kernel_arg());
        if let Some(up) = &upstream {
            launch.arg(up.kernel_arg());
        }
        launch.arg(&r).arg(&c);
        // SAFETY: arguments match the chosen kernel; sizes checked above.
        unsafe { launch.launch(cfg) }.in_call("cuLaunchKernel(softmax_xent)")?;
        self.count();
        Ok(())
    }

    /// A generated fused elementwise kernel over `n` elements of rows of
    /// `width`, with the parameter order of
    /// [`ramus_codegen::fused::FusedSource::cuda_source`]: input pointers (a
    /// window's source), output pointers, concat pointers, `n`, `width`,
    /// then `(stride, offset)` per window input and per concat write.
    pub fn fused(
        &self,
        stream: &CudaStream,
        kernel: &CudaFunction,
        args: &FusedArgs,
    ) -> Result<()> {
        if args.n == 0 {
            return Ok(());
        }
        let (count, w) = (args.n as u64, u32_arg(args.width, "width")?);
        let mut launch = stream.launch_builder(kernel);
        for v in args.inputs.iter().chain(&args.outputs).chain(&args.concats) {
            launch.arg(v.kernel_arg());
        }
        for (rows, _) in &args.csr {
            launch.arg(rows.kernel_arg());
        }
        launch.arg(&count).arg(&w);
        for pair in &args.strides {
            launch.arg(&pair[0]).arg(&pair[1]);
        }
        for (_, base) in &args.csr {
            launch.arg(base);
        }
        // SAFETY: the engine passes one view per declared pointer parameter,
        // each covering the elements the kernel reads or writes for `n`
        // elements (windows and concats through their stride and offset),
        // one (stride, offset) pair per window input and concat write, and
        // one index view (covering the rows / edges launched) and base per
        // child-sum or parent-row input.
        unsafe { launch.launch(elementwise_cfg(args.n)) }.in_call("cuLaunchKernel(fused)")?;
        self.count();
        Ok(())
    }
}

/// The operands of [`Launcher::gemm_abt_small`]: `A` (rows `lda` floats
/// apart), the row-major weight `B` and an optional bias row.
#[derive(Clone, Copy, Debug)]
pub struct AbtOperands {
    pub a: DeviceView<f32>,
    pub lda: usize,
    pub b: DeviceView<f32>,
    pub bias: Option<DeviceView<f32>>,
}

/// A matrix of rows `width` floats wide, read or written from column `col`
/// on ([`Launcher::copy_columns`], the source of
/// [`Launcher::sum_children`]).
#[derive(Clone, Copy, Debug)]
pub struct ColumnWindow {
    pub data: DeviceView<f32>,
    pub width: usize,
    pub col: usize,
}

impl ColumnWindow {
    /// `data` in rows of `width`, from column `col`.
    pub fn new(data: DeviceView<f32>, width: usize, col: usize) -> Self {
        ColumnWindow { data, width, col }
    }

    /// `data` in rows of `width`, whole rows from column 0.
    pub fn whole(data: DeviceView<f32>, width: usize) -> Self {
        Self::new(data, width, 0)
    }
}

/// Row numbers read by a topology kernel (CSR edge offsets of
/// [`Launcher::sum_children`], parent rows of
/// [`Launcher::expand_children`]), each naming row `index[i] - base`.
#[derive(Clone, Copy, Debug)]
pub struct IndexRows {
    pub index: DeviceView<u32>,
    pub base: usize,
}

/// One operand of [`Launcher::row_matmul`]: a matrix per row
/// (`per_row`) or one static matrix shared by every row.
#[derive(Clone, Copy, Debug)]
pub struct RowOperand {
    pub data: DeviceView<f32>,
    pub per_row: bool,
}

/// The extents of [`Launcher::embedding_unk`]: `rows` looked-up rows of a
/// `[table_rows, width]` table.
#[derive(Clone, Copy, Debug)]
pub struct EmbeddingShape {
    pub rows: usize,
    pub table_rows: usize,
    pub width: usize,
}

/// The inputs of [`Launcher::softmax_xent`]: per-row scores, their labels
/// and, for the gradient, the upstream gradient of each row's loss.
#[derive(Clone, Copy, Debug)]
pub struct XentOperands {
    pub scores: DeviceView<f32>,
    pub labels: DeviceView<u32>,
    pub upstream: Option<DeviceView<f32>>,
}

/// The arguments of one fused-kernel launch (see [`Launcher::fused`]).
#[derive(Default)]
pub struct FusedArgs {
    pub inputs: Vec<DeviceView<f32>>,
    pub outputs: Vec<DeviceView<f32>>,
    pub concats: Vec<DeviceView<f32>>,
    pub n: usize,
    pub width: usize,
    /// `(stride, offset)` per window input, then per concat write.
    pub strides: Vec<[u32; 2]>,
    /// Per child-sum or parent-row input, in input order: its index rows
    /// (CSR offsets or parent numbers) and the base subtracted from them.
    pub csr: Vec<(DeviceView<u32>, u32)>,
}

fn elementwise_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid_for(n), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}
