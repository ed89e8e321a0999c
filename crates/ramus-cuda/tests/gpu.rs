//! GPU tests: device, pool and arena, pinned copies, NVRTC through the kernel
//! cache, cuBLAS against CPU loops, stream ordering. On a machine without
//! CUDA each test prints a skip notice and passes.

mod common;
use common::{device, values};

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ramus_cuda::cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use ramus_cuda::launch::{AbtOperands, Launcher, SMALL_GEMM_ROWS};
use ramus_cuda::{
    Blas, CudaDevice, CudaError, DevicePool, DeviceView, Gemm, InCall, KernelCache, LoadedModule,
    PinnedBuffer, PoolConfig, Result, StridedBatch,
};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ramus-cuda-gpu-{name}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn small_pool(device: &CudaDevice) -> Arc<DevicePool> {
    DevicePool::new(
        device,
        PoolConfig {
            initial_bytes: 4 << 20,
            max_bytes: None,
        },
    )
}

const SAXPY: &str = r#"
extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = a * x[i] + y[i];
    }
}
"#;

fn launch_saxpy(
    module: &LoadedModule,
    stream: &CudaStream,
    a: f32,
    x: DeviceView<f32>,
    y: DeviceView<f32>,
) -> Result<()> {
    let n = u32::try_from(y.len()).expect("small test vectors");
    let saxpy = module.function("saxpy")?;
    let mut launch = stream.launch_builder(saxpy);
    launch
        .arg(&a)
        .arg(x.kernel_arg())
        .arg(y.kernel_arg())
        .arg(&n);
    // SAFETY: the arguments match the kernel's signature and x, y hold n
    // elements of device memory that outlive the launch (the caller waits).
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.in_call("cuLaunchKernel")?;
    Ok(())
}

#[test]
fn the_device_opens_and_reports_its_architecture() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let (major, minor) = device.compute_capability();
    println!(
        "device {}: {}, compute capability {major}.{minor}, arch {}, {} SMs, {:.1} GiB ({:.1} GiB free)",
        device.ordinal(),
        device.name(),
        device.arch(),
        device.sm_count(),
        device.total_memory() as f64 / (1u64 << 30) as f64,
        device.free_memory()? as f64 / (1u64 << 30) as f64,
    );
    assert_eq!(device.arch(), format!("sm_{major}{minor}"));
    assert!(device.sm_count() > 0);
    assert!(device.free_memory()? <= device.total_memory());
    assert!(matches!(
        CudaDevice::open(usize::MAX / 2),
        Err(CudaError::NoDevice { .. })
    ));
    Ok(())
}

#[test]
fn pool_buffers_round_trip_through_pinned_memory() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let stream = device.stream();
    let pool = small_pool(&device);
    let mut staging = PinnedBuffer::new(&device)?;
    {
        let data = values(1000, 1);
        let floats = pool.alloc::<f32>(data.len())?;
        staging.upload_slice(&data, floats.view(), stream)?;
        assert_eq!(staging.download_to_vec(floats.view(), stream)?, data);

        let indices: Vec<u32> = (0..5000).map(|i| i * 7 + 3).collect();
        let ints = pool.alloc::<u32>(indices.len())?;
        staging.upload_slice(&indices, ints.view(), stream)?;
        let middle = ints.view().slice(100..200)?;
        assert_eq!(staging.download_to_vec(middle, stream)?, &indices[100..200]);

        floats.view().slice(10..20)?.fill_zero(stream)?;
        let back = staging.download_to_vec(floats.view(), stream)?;
        assert!(back[10..20].iter().all(|&v| v == 0.0));
        assert_eq!(back[..10], data[..10]);
        assert_eq!(back[20..], data[20..]);
        assert!(staging.capacity_bytes() >= 5000 * 4);
    }
    let stats = pool.stats();
    println!("{stats}");
    assert_eq!(stats.in_use_bytes, 0);
    assert_eq!(stats.driver_allocations, 1);
    Ok(())
}

#[test]
fn arena_batches_make_no_driver_allocation_after_the_first() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let stream = device.stream();
    let pool = small_pool(&device);
    let mut arena = pool.arena(256 << 10);
    let sizes: Vec<usize> = (0..30).map(|i| (i * 7919) % 40_000 + 1).collect();
    let mut after_first = None;
    for batch in 0..100 {
        let mut this_batch = sizes.clone();
        this_batch.rotate_left(batch % sizes.len());
        this_batch.truncate(sizes.len() - batch % 4);
        for len in this_batch {
            let tensor = arena.alloc::<f32>(len)?;
            tensor.fill_zero(stream)?; // touches the memory on the device
        }
        arena.reset()?;
        let allocations = pool.stats().driver_allocations;
        match after_first {
            None => after_first = Some(allocations),
            Some(first) => assert_eq!(allocations, first, "batch {batch} allocated"),
        }
    }
    stream.synchronize().in_call("cuStreamSynchronize")?;
    println!("{} (arena peak {} bytes)", pool.stats(), arena.peak_bytes());
    Ok(())
}

#[test]
fn saxpy_compiles_through_the_cache_and_loads_from_disk() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let dir = TempDir::new("saxpy");
    let stream = device.stream();
    let pool = small_pool(&device);
    let mut staging = PinnedBuffer::new(&device)?;
    let n = 1000;
    let (x, y) = (values(n, 2), values(n, 3));
    let expected: Vec<f32> = x.iter().zip(&y).map(|(x, y)| 2.5 * x + y).collect();
    let (x_dev, y_dev) = (pool.alloc::<f32>(n)?, pool.alloc::<f32>(n)?);

    let cache = KernelCache::for_device(&device, Some(dir.0.clone()))?;
    let module = cache.get_or_compile(SAXPY, &["saxpy"])?;
    staging.upload_slice(&x, x_dev.view(), stream)?;
    staging.upload_slice(&y, y_dev.view(), stream)?;
    launch_saxpy(&module, stream, 2.5, x_dev.view(), y_dev.view())?;
    // The GPU fuses a * x + y into one rounding; the CPU rounds twice.
    assert_close(
        &staging.download_to_vec(y_dev.view(), stream)?,
        &expected,
        "saxpy",
    );
    let again = cache.get_or_compile(&format!("// again\n{SAXPY}"), &["saxpy"])?;
    assert!(Arc::ptr_eq(&module, &again));
    let stats = cache.stats();
    println!("first cache: {stats}");
    assert_eq!((stats.compiled, stats.memory_hits), (1, 1));
    assert!(cache
        .entry_path_for(SAXPY)
        .is_some_and(|path| path.exists()));

    let cache = KernelCache::for_device(&device, Some(dir.0.clone()))?;
    let module = cache.get_or_compile(SAXPY, &["saxpy"])?;
    let stats = cache.stats();
    println!("second cache: {stats}");
    assert_eq!((stats.compiled, stats.disk_hits), (0, 1));
    staging.upload_slice(&y, y_dev.view(), stream)?;
    launch_saxpy(&module, stream, 2.5, x_dev.view(), y_dev.view())?;
    assert_close(
        &staging.download_to_vec(y_dev.view(), stream)?,
        &expected,
        "saxpy from disk",
    );
    Ok(())
}

#[test]
fn compile_errors_carry_the_log_and_missing_kernels_are_named() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let cache = KernelCache::for_device(&device, None)?;
    let broken = r#"extern "C" __global__ void broken(float* y) { y[0] = undeclared; }"#;
    match cache.get_or_compile(broken, &["broken"]) {
        Err(CudaError::Compile { kernels, log, .. }) => {
            assert_eq!(kernels, "broken");
            assert!(log.contains("undeclared"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    match cache.get_or_compile(SAXPY, &["saxpy", "missing"]) {
        Err(CudaError::KernelNotFound { name }) => assert_eq!(name, "missing"),
        other => panic!("expected KernelNotFound, got {other:?}"),
    }
    Ok(())
}

/// Row-major reference: C = alpha op(A) op(B) + beta C, in f64.
#[allow(clippy::too_many_arguments)]
fn reference_gemm(
    g: &Gemm,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    lda: usize,
    ldb: usize,
    ldc: usize,
) {
    for i in 0..g.m {
        for j in 0..g.n {
            let mut sum = 0.0f64;
            for p in 0..g.k {
                let a_ip = if g.trans_a {
                    a[p * lda + i]
                } else {
                    a[i * lda + p]
                };
                let b_pj = if g.trans_b {
                    b[j * ldb + p]
                } else {
                    b[p * ldb + j]
                };
                sum += f64::from(a_ip) * f64::from(b_pj);
            }
            let out = &mut c[i * ldc + j];
            *out = (f64::from(g.alpha) * sum + f64::from(g.beta) * f64::from(*out)) as f32;
        }
    }
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "{what}: element {i} is {g}, expected {w}"
        );
    }
}

#[test]
fn sgemm_matches_a_cpu_loop_for_every_transpose() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let stream = device.stream();
    let pool = small_pool(&device);
    let mut staging = PinnedBuffer::new(&device)?;
    let blas = Blas::new(&device, Arc::clone(stream))?;
    let (m, n, k) = (37, 29, 53);
    for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
        for (alpha, beta, pad) in [(1.0, 0.0, 0), (0.5, 1.0, 3)] {
            let (a_rows, a_cols) = if trans_a { (k, m) } else { (m, k) };
            let (b_rows, b_cols) = if trans_b { (n, k) } else { (k, n) };
            let (lda, ldb, ldc) = (a_cols + pad, b_cols + pad, n + pad);
            let gemm = Gemm {
                trans_a,
                trans_b,
                alpha,
                beta,
                lda: Some(lda),
                ldb: Some(ldb),
                ldc: Some(ldc),
                ..Gemm::new(m, n, k)
            };
            let a = values(a_rows * lda, 4);
            let b = values(b_rows * ldb, 5);
            let mut c = values(m * ldc, 6);
            let (a_dev, b_dev, c_dev) = (
                pool.alloc::<f32>(a.len())?,
                pool.alloc::<f32>(b.len())?,
                pool.alloc::<f32>(c.len())?,
            );
            staging.upload_slice(&a, a_dev.view(), stream)?;
            staging.upload_slice(&b, b_dev.view(), stream)?;
            staging.upload_slice(&c, c_dev.view(), stream)?;
            blas.sgemm(&gemm, a_dev.view(), b_dev.view(), c_dev.view())?;
            let got = staging.download_to_vec(c_dev.view(), stream)?;
            reference_gemm(&gemm, &a, &b, &mut c, lda, ldb, ldc);
            let what = format!("trans_a={trans_a} trans_b={trans_b} alpha={alpha} beta={beta}");
            assert_close(&got, &c, &what);
        }
    }
    Ok(())
}

#[test]
fn the_small_product_kernel_matches_a_cpu_loop_with_and_without_bias() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let stream = device.stream();
    let pool = small_pool(&device);
    let mut staging = PinnedBuffer::new(&device)?;
    let cache = KernelCache::for_device(&device, None)?;
    let launcher = Launcher::new(&cache)?;
    // rows around the kernel's blocks of four, k around a warp's 32 lanes,
    // A with a wider leading dimension (a column window), with and without bias
    for (m, n, k, pad) in [
        (1, 7, 5, 0),
        (4, 40, 32, 3),
        (5, 33, 70, 0),
        (SMALL_GEMM_ROWS, 65, 256, 9),
    ] {
        for with_bias in [false, true] {
            let lda = k + pad;
            let a = values(m * lda, 11);
            let b = values(n * k, 12);
            let bias = values(n, 13);
            let (a_dev, b_dev, bias_dev, c_dev) = (
                pool.alloc::<f32>(a.len())?,
                pool.alloc::<f32>(b.len())?,
                pool.alloc::<f32>(n)?,
                pool.alloc::<f32>(m * n)?,
            );
            staging.upload_slice(&a, a_dev.view(), stream)?;
            staging.upload_slice(&b, b_dev.view(), stream)?;
            staging.upload_slice(&bias, bias_dev.view(), stream)?;
            let bias_view = with_bias.then(|| bias_dev.view());
            let operands = AbtOperands {
                a: a_dev.view(),
                lda,
                b: b_dev.view(),
                bias: bias_view,
            };
            launcher.gemm_abt_small(stream, c_dev.view(), operands, (m, n, k))?;
            let got = staging.download_to_vec(c_dev.view(), stream)?;
            let gemm = Gemm {
                trans_b: true,
                ..Gemm::new(m, n, k)
            };
            let mut want = if with_bias {
                (0..m).flat_map(|_| bias.iter().copied()).collect()
            } else {
                vec![0.0; m * n]
            };
            let product = {
                let mut c = vec![0.0; m * n];
                reference_gemm(&gemm, &a, &b, &mut c, lda, k, n);
                c
            };
            want.iter_mut().zip(&product).for_each(|(w, p)| *w += p);
            assert_close(
                &got,
                &want,
                &format!("{m}x{n}x{k} lda {lda} bias {with_bias}"),
            );
        }
    }
    // a view too short for the product is refused, not read past
    let short = pool.alloc::<f32>(3)?;
    let b = pool.alloc::<f32>(4 * 8)?;
    let c = pool.alloc::<f32>(2 * 4)?;
    let err = launcher
        .gemm_abt_small(
            stream,
            c.view(),
            AbtOperands {
                a: short.view(),
                lda: 8,
                b: b.view(),
                bias: None,
            },
            (2, 4, 8),
        )
        .expect_err("A holds 3 of 16 floats");
    assert!(err.to_string().contains("out of bounds"), "{err}");
    Ok(())
}

#[test]
fn strided_batched_sgemm_matches_separate_products() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let stream = device.stream();
    let pool = small_pool(&device);
    let mut staging = PinnedBuffer::new(&device)?;
    let blas = Blas::new(&device, Arc::clone(stream))?;
    let (m, n, k, count) = (8, 16, 12, 5);
    let gemm = Gemm {
        trans_b: true,
        ..Gemm::new(m, n, k)
    };
    // Per-item A, one shared B (stride 0), per-item C.
    let batch = StridedBatch {
        count,
        stride_a: m * k,
        stride_b: 0,
        stride_c: m * n,
    };
    let a = values(count * m * k, 7);
    let b = values(n * k, 8);
    let (a_dev, b_dev, c_dev) = (
        pool.alloc::<f32>(a.len())?,
        pool.alloc::<f32>(b.len())?,
        pool.alloc::<f32>(count * m * n)?,
    );
    staging.upload_slice(&a, a_dev.view(), stream)?;
    staging.upload_slice(&b, b_dev.view(), stream)?;
    blas.sgemm_strided_batched(&gemm, &batch, a_dev.view(), b_dev.view(), c_dev.view())?;
    let got = staging.download_to_vec(c_dev.view(), stream)?;
    for item in 0..count {
        let mut want = vec![0.0; m * n];
        let a_item = &a[item * m * k..(item + 1) * m * k];
        reference_gemm(&gemm, a_item, &b, &mut want, k, k, n);
        assert_close(
            &got[item * m * n..(item + 1) * m * n],
            &want,
            &format!("item {item}"),
        );
    }
    let short = pool.alloc::<f32>(m * n)?;
    assert!(matches!(
        blas.sgemm_strided_batched(&gemm, &batch, a_dev.view(), b_dev.view(), short.view()),
        Err(CudaError::BadArgument(_))
    ));
    Ok(())
}

#[test]
fn a_second_stream_is_ordered_by_an_event() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let main = device.stream();
    let eager = device.new_stream()?;
    let pool = small_pool(&device);
    let cache = KernelCache::for_device(&device, None)?;
    let module = cache.get_or_compile(SAXPY, &["saxpy"])?;
    let n = 1 << 16;
    let (x, y) = (values(n, 9), values(n, 10));
    let (x_dev, y_dev) = (pool.alloc::<f32>(n)?, pool.alloc::<f32>(n)?);
    let mut main_staging = PinnedBuffer::new(&device)?;
    let mut eager_staging = PinnedBuffer::new(&device)?;

    main_staging.upload_slice(&y, y_dev.view(), main)?;
    eager_staging.upload_slice(&x, x_dev.view(), &eager)?;
    let x_ready = device.new_event()?;
    x_ready.record(&eager).in_call("cuEventRecord")?;
    main.wait(&x_ready).in_call("cuStreamWaitEvent")?;
    launch_saxpy(&module, main, -1.0, x_dev.view(), y_dev.view())?;
    let got = main_staging.download_to_vec(y_dev.view(), main)?;
    let want: Vec<f32> = x.iter().zip(&y).map(|(x, y)| -x + y).collect();
    assert_eq!(got, want);
    Ok(())
}
