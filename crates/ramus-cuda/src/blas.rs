//! cuBLAS single-precision GEMM for row-major tensors, bound to a stream.
//!
//! Ramus tensors are row-major `[rows, width]`; cuBLAS is column-major. A
//! row-major matrix read as column-major is its transpose, so
//! `C = op(A) op(B)` is computed as `Cᵀ = op(B)ᵀ op(A)ᵀ`: cuBLAS gets B
//! first, A second, and `m`/`n` swapped; the transpose flags and leading
//! dimensions (row strides) carry over unchanged.
//!
//! The math mode is cuBLAS's default (full FP32, no TF32) so that results
//! match the CPU reference to about 1e-4. cuBLAS keeps a small workspace per
//! handle of its own, allocated once by cuBLAS on first use.

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::cublas::result;
use cudarc::cublas::sys::{self, cublasHandle_t, cublasMath_t, cublasOperation_t};
use cudarc::driver::{CudaContext, CudaStream};

use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};
use crate::pool::DeviceView;

/// Which arithmetic cuBLAS may use for FP32 products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MathMode {
    /// Full FP32 (cuBLAS's default math): matches the CPU reference.
    Fp32,
    /// TF32 tensor cores: faster, about 1e-3 relative error.
    Tf32,
}

/// One row-major product `C = alpha · op(A) · op(B) + beta · C`, with
/// `op(A)` of shape `[m, k]`, `op(B)` of shape `[k, n]` and `C` of shape
/// `[m, n]`. `A` is stored `[m, k]`, or `[k, m]` when `trans_a`; likewise `B`
/// is `[k, n]`, or `[n, k]` when `trans_b`. A leading dimension is the stored
/// matrix's row stride in elements; `None` means packed rows.
///
/// `Gemm { trans_b: true, beta: 1.0, ..Gemm::new(m, n, k) }` accumulates
/// `A · Bᵀ` into `C`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub alpha: f32,
    pub beta: f32,
    pub lda: Option<usize>,
    pub ldb: Option<usize>,
    pub ldc: Option<usize>,
}

impl Gemm {
    /// `C = A · B` with packed rows.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        Self {
            m,
            n,
            k,
            trans_a: false,
            trans_b: false,
            alpha: 1.0,
            beta: 0.0,
            lda: None,
            ldb: None,
            ldc: None,
        }
    }

    /// The three operands as stored: (rows, columns, leading dimension).
    fn stored(&self) -> Result<[Operand; 3]> {
        let (m, n, k) = (self.m, self.n, self.k);
        let a = if self.trans_a { (k, m) } else { (m, k) };
        let b = if self.trans_b { (n, k) } else { (k, n) };
        Ok([
            Operand::new("A", a, self.lda)?,
            Operand::new("B", b, self.ldb)?,
            Operand::new("C", (m, n), self.ldc)?,
        ])
    }
}

/// Element strides between consecutive matrices of a strided batch. A stride
/// of 0 reuses one matrix for every product (e.g. shared weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StridedBatch {
    pub count: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
}

#[derive(Debug, Clone, Copy)]
struct Operand {
    name: &'static str,
    rows: usize,
    cols: usize,
    ld: usize,
}

impl Operand {
    fn new(name: &'static str, (rows, cols): (usize, usize), ld: Option<usize>) -> Result<Self> {
        let ld = ld.unwrap_or(cols.max(1));
        if ld < cols.max(1) {
            return Err(CudaError::BadArgument(format!(
                "GEMM operand {name} is [{rows}, {cols}] but its leading dimension is {ld}"
            )));
        }
        Ok(Self {
            name,
            rows,
            cols,
            ld,
        })
    }

    /// Elements spanned by one matrix.
    fn extent(&self) -> Result<usize> {
        match self.rows.checked_sub(1) {
            None => Ok(0),
            Some(last_row) => last_row
                .checked_mul(self.ld)
                .and_then(|start| start.checked_add(self.cols))
                .ok_or_else(|| {
                    CudaError::BadArgument(format!("GEMM operand {} size overflows", self.name))
                }),
        }
    }

    /// Checks that `view` holds `count` (at least 1) matrices `stride`
    /// elements apart.
    fn check_view(&self, view: &DeviceView<f32>, count: usize, stride: usize) -> Result<()> {
        let needed = count
            .saturating_sub(1)
            .checked_mul(stride)
            .and_then(|offset| offset.checked_add(self.extent().ok()?))
            .ok_or_else(|| {
                CudaError::BadArgument(format!("GEMM operand {} size overflows", self.name))
            })?;
        if view.len() < needed {
            return Err(CudaError::BadArgument(format!(
                "GEMM operand {} needs {needed} elements ({count} × [{}, {}], leading \
                 dimension {}, stride {stride}) but its view has {}",
                self.name,
                self.rows,
                self.cols,
                self.ld,
                view.len()
            )));
        }
        Ok(())
    }
}

/// A cuBLAS handle bound to one stream.
#[derive(Debug)]
pub struct Blas {
    handle: cublasHandle_t,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

// SAFETY: a cuBLAS handle may be used from any host thread ("the cuBLAS
// library is thread safe ... even with the same handle"); the stream is
// changed only through `&mut self`, and every call binds the context first.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

impl Blas {
    /// A handle on `device` that enqueues on `stream`, in FP32 math mode.
    pub fn new(device: &CudaDevice, stream: Arc<CudaStream>) -> Result<Self> {
        crate::device::check_cublas()?;
        let context = Arc::clone(device.context());
        context.bind_to_thread().in_call("cuCtxSetCurrent")?;
        let handle = result::create_handle().in_call("cublasCreate")?;
        let blas = Self {
            handle,
            context,
            stream,
        };
        // SAFETY: `handle` is live and the stream belongs to the bound context.
        unsafe { result::set_stream(blas.handle, blas.stream.cu_stream() as _) }
            .in_call("cublasSetStream")?;
        blas.set_math_mode(MathMode::Fp32)?;
        Ok(blas)
    }

    /// The stream products are enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Enqueues later products on `stream` instead.
    pub fn set_stream(&mut self, stream: Arc<CudaStream>) -> Result<()> {
        self.context.bind_to_thread().in_call("cuCtxSetCurrent")?;
        // SAFETY: `self.handle` is live; the stream outlives its use because
        // `self` keeps the `Arc` until it is replaced again or dropped.
        unsafe { result::set_stream(self.handle, stream.cu_stream() as _) }
            .in_call("cublasSetStream")?;
        self.stream = stream;
        Ok(())
    }

    /// Chooses FP32 or TF32 arithmetic (FP32 by default).
    pub fn set_math_mode(&self, mode: MathMode) -> Result<()> {
        let mode = match mode {
            MathMode::Fp32 => cublasMath_t::CUBLAS_DEFAULT_MATH,
            MathMode::Tf32 => cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
        };
        // SAFETY: `self.handle` is live.
        unsafe { sys::cublasSetMathMode(self.handle, mode) }
            .result()
            .in_call("cublasSetMathMode")
    }

    /// `C = alpha · op(A) · op(B) + beta · C` (row-major; see [`Gemm`]),
    /// enqueued on the handle's stream. `c` must not overlap `a` or `b`.
    pub fn sgemm(
        &self,
        gemm: &Gemm,
        a: DeviceView<f32>,
        b: DeviceView<f32>,
        c: DeviceView<f32>,
    ) -> Result<()> {
        let batch = StridedBatch {
            count: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
        };
        self.gemm(gemm, &batch, a, b, c)
    }

    /// `batch.count` independent products, matrix `i` of each operand
    /// starting `i · stride` elements into its view.
    pub fn sgemm_strided_batched(
        &self,
        gemm: &Gemm,
        batch: &StridedBatch,
        a: DeviceView<f32>,
        b: DeviceView<f32>,
        c: DeviceView<f32>,
    ) -> Result<()> {
        self.gemm(gemm, batch, a, b, c)
    }

    fn gemm(
        &self,
        gemm: &Gemm,
        batch: &StridedBatch,
        a: DeviceView<f32>,
        b: DeviceView<f32>,
        c: DeviceView<f32>,
    ) -> Result<()> {
        let [op_a, op_b, op_c] = gemm.stored()?;
        if batch.count == 0 || gemm.m == 0 || gemm.n == 0 {
            return Ok(());
        }
        let output_extent = op_c.extent()?;
        if batch.count > 1 && batch.stride_c < output_extent {
            return Err(CudaError::BadArgument(format!(
                "strided GEMM outputs overlap: stride {} < {output_extent} elements per output",
                batch.stride_c,
            )));
        }
        op_a.check_view(&a, batch.count, batch.stride_a)?;
        op_b.check_view(&b, batch.count, batch.stride_b)?;
        op_c.check_view(&c, batch.count, batch.stride_c)?;

        let call = ColumnMajorCall::for_row_major(gemm, &op_a, &op_b, &op_c)?;
        let (first, second) = (b.device_ptr() as *const f32, a.device_ptr() as *const f32);
        let out = c.device_ptr() as *mut f32;
        let (alpha, beta) = (gemm.alpha, gemm.beta);

        self.context.bind_to_thread().in_call("cuCtxSetCurrent")?;
        if batch.count == 1 {
            // SAFETY: the views hold every element the product touches
            // (checked above) and live in device memory, so cuBLAS reads and
            // writes only device memory; alpha and beta are host scalars
            // (cuBLAS's default pointer mode) that outlive the call.
            unsafe {
                result::sgemm(
                    self.handle,
                    operation(call.trans_first),
                    operation(call.trans_second),
                    call.m,
                    call.n,
                    call.k,
                    &alpha,
                    first,
                    call.ld_first,
                    second,
                    call.ld_second,
                    &beta,
                    out,
                    call.ldc,
                )
            }
            .in_call("cublasSgemm")
        } else {
            let stride = |value: usize| {
                i64::try_from(value).map_err(|_| {
                    CudaError::BadArgument(format!("GEMM stride {value} is too large"))
                })
            };
            let count = c_int::try_from(batch.count).map_err(|_| {
                CudaError::BadArgument(format!("{} GEMMs in one batch are too many", batch.count))
            })?;
            let (stride_first, stride_second) = (stride(batch.stride_b)?, stride(batch.stride_a)?);
            let stride_out = stride(batch.stride_c)?;
            // SAFETY: as for the single product; the views hold every matrix
            // of the batch (checked above) and outputs do not overlap.
            unsafe {
                result::sgemm_strided_batched(
                    self.handle,
                    operation(call.trans_first),
                    operation(call.trans_second),
                    call.m,
                    call.n,
                    call.k,
                    &alpha,
                    first,
                    call.ld_first,
                    stride_first,
                    second,
                    call.ld_second,
                    stride_second,
                    &beta,
                    out,
                    call.ldc,
                    stride_out,
                    count,
                )
            }
            .in_call("cublasSgemmStridedBatched")
        }
    }
}

fn operation(transposed: bool) -> cublasOperation_t {
    if transposed {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// The column-major GEMM that computes a row-major [`Gemm`]:
/// `Cᵀ[n, m] = op(B)ᵀ[n, k] · op(A)ᵀ[k, m]`, with B as the first operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ColumnMajorCall {
    trans_first: bool,
    trans_second: bool,
    m: c_int,
    n: c_int,
    k: c_int,
    ld_first: c_int,
    ld_second: c_int,
    ldc: c_int,
}

impl ColumnMajorCall {
    fn for_row_major(gemm: &Gemm, a: &Operand, b: &Operand, c: &Operand) -> Result<Self> {
        let int = |value: usize, what: &str| {
            c_int::try_from(value).map_err(|_| {
                CudaError::BadArgument(format!("GEMM {what} = {value} exceeds cuBLAS's int range"))
            })
        };
        Ok(Self {
            trans_first: gemm.trans_b,
            trans_second: gemm.trans_a,
            m: int(gemm.n, "n")?,
            n: int(gemm.m, "m")?,
            k: int(gemm.k, "k")?,
            ld_first: int(b.ld, "ldb")?,
            ld_second: int(a.ld, "lda")?,
            ldc: int(c.ld, "ldc")?,
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        if let Err(e) = self.context.bind_to_thread() {
            eprintln!("ramus-cuda: cannot bind the context to destroy a cuBLAS handle: {e}");
            return;
        }
        // SAFETY: the handle was created in `new` and is destroyed only here.
        if let Err(e) = unsafe { result::destroy_handle(self.handle) } {
            eprintln!("ramus-cuda: cublasDestroy failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_shapes_follow_the_transpose_flags() {
        let gemm = Gemm {
            trans_a: true,
            ..Gemm::new(2, 3, 4)
        };
        let [a, b, c] = gemm.stored().unwrap();
        assert_eq!((a.rows, a.cols, a.ld), (4, 2, 2));
        assert_eq!((b.rows, b.cols, b.ld), (4, 3, 3));
        assert_eq!((c.rows, c.cols, c.ld), (2, 3, 3));

        let gemm = Gemm {
            trans_b: true,
            ldc: Some(10),
            ..Gemm::new(2, 3, 4)
        };
        let [_, b, c] = gemm.stored().unwrap();
        assert_eq!((b.rows, b.cols), (3, 4));
        assert_eq!(c.extent().unwrap(), 10 + 3);
    }

    /// Column-major BLAS semantics, as cuBLAS defines them.
    fn column_major_sgemm(call: &ColumnMajorCall, first: &[f32], second: &[f32], out: &mut [f32]) {
        let (m, n, k) = (call.m as usize, call.n as usize, call.k as usize);
        let (ld1, ld2, ldc) = (
            call.ld_first as usize,
            call.ld_second as usize,
            call.ldc as usize,
        );
        for i in 0..m {
            for j in 0..n {
                let mut sum = 0.0;
                for p in 0..k {
                    let x = if call.trans_first {
                        first[p + i * ld1]
                    } else {
                        first[i + p * ld1]
                    };
                    let y = if call.trans_second {
                        second[j + p * ld2]
                    } else {
                        second[p + j * ld2]
                    };
                    sum += x * y;
                }
                out[i + j * ldc] = sum;
            }
        }
    }

    /// Checks the row-major -> column-major mapping without a GPU: the call
    /// handed to cuBLAS, evaluated with BLAS semantics, gives the row-major
    /// product.
    #[test]
    fn the_column_major_call_computes_the_row_major_product() {
        let (m, n, k) = (3, 4, 5);
        for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
            let pad = 2;
            let gemm = Gemm {
                trans_a,
                trans_b,
                ..Gemm::new(m, n, k)
            };
            let (a_rows, a_cols) = if trans_a { (k, m) } else { (m, k) };
            let (b_rows, b_cols) = if trans_b { (n, k) } else { (k, n) };
            let gemm = Gemm {
                lda: Some(a_cols + pad),
                ldb: Some(b_cols + pad),
                ldc: Some(n + pad),
                ..gemm
            };
            let [op_a, op_b, op_c] = gemm.stored().unwrap();
            let a: Vec<f32> = (0..a_rows * op_a.ld)
                .map(|i| (i % 7) as f32 - 3.0)
                .collect();
            let b: Vec<f32> = (0..b_rows * op_b.ld)
                .map(|i| (i % 5) as f32 - 2.0)
                .collect();
            let at = |i: usize, p: usize| {
                if trans_a {
                    a[p * op_a.ld + i]
                } else {
                    a[i * op_a.ld + p]
                }
            };
            let bt = |p: usize, j: usize| {
                if trans_b {
                    b[j * op_b.ld + p]
                } else {
                    b[p * op_b.ld + j]
                }
            };

            let call = ColumnMajorCall::for_row_major(&gemm, &op_a, &op_b, &op_c).unwrap();
            let mut c = vec![f32::NAN; m * op_c.ld];
            column_major_sgemm(&call, &b, &a, &mut c);
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
                    assert_eq!(
                        c[i * op_c.ld + j],
                        want,
                        "trans {trans_a}/{trans_b} at ({i}, {j})"
                    );
                }
            }
        }
    }

    #[test]
    fn short_leading_dimensions_are_rejected() {
        let gemm = Gemm {
            lda: Some(3),
            ..Gemm::new(2, 3, 4)
        };
        assert!(matches!(gemm.stored(), Err(CudaError::BadArgument(_))));
        // Empty matrices still get a valid (>= 1) leading dimension.
        let [a, _, _] = Gemm::new(2, 3, 0).stored().unwrap();
        assert_eq!(a.ld, 1);
    }
}
