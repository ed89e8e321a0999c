//! The device optimizer against the host reference `ramus_exec::Optimizer`:
//! SGD, Adagrad, Adam and AdamW, each with and without global-norm
//! clipping, five steps on parameters laid out like the CUDA engine's
//! (values in declaration order, gradients dense-first) with two embedding
//! tables between dense parameters, updated on touched rows only. Also: the
//! launch count, the norm on request, untouched rows, the kernel cache and
//! hyper-parameter changes. Skips with a notice where no CUDA driver is
//! found.

mod common;
use common::device;
use common::optimizer_fixture::*;

use std::sync::Arc;

use ramus_core::{Model, Params};
use ramus_cuda::{
    CudaDevice, DeviceOptimizer, DevicePool, DeviceView, GradLayout, KernelCache, ParamSlot,
    PinnedBuffer, PoolBuffer, PoolConfig, Result,
};
use ramus_exec::{Optimizer, OptimizerConfig, OptimizerKind};

/// Everything one comparison needs on the device.
struct Setup {
    device: Arc<CudaDevice>,
    pool: Arc<DevicePool>,
    cache: KernelCache,
    staging: PinnedBuffer,
}

fn setup() -> Option<Setup> {
    let device = device()?;
    let pool = DevicePool::new(
        &device,
        PoolConfig {
            initial_bytes: 4 << 20,
            max_bytes: None,
        },
    );
    let cache = KernelCache::for_device(&device, None).expect("kernel cache");
    let staging = PinnedBuffer::new(&device).expect("pinned buffer");
    Some(Setup {
        device,
        pool,
        cache,
        staging,
    })
}

/// The model's parameters on the device, laid out like the CUDA engine's.
struct DeviceParams {
    values: PoolBuffer<f32>,
    grads: PoolBuffer<f32>,
    slots: Vec<ParamSlot>,
    /// Gradient offset of each parameter.
    grad_at: Vec<usize>,
    total: usize,
}

fn upload_params(s: &mut Setup, model: &Model, params: &Params<f32>) -> Result<DeviceParams> {
    let lens: Vec<usize> = params.values.iter().map(|t| t.len()).collect();
    let total: usize = lens.iter().sum();
    let values = s.pool.alloc::<f32>(total)?;
    let grads = s.pool.alloc::<f32>(total)?;
    let mut grad_at = vec![0; lens.len()];
    let mut at = 0;
    for tables in [false, true] {
        for (p, &len) in lens.iter().enumerate() {
            if TABLES.contains(&p) == tables {
                grad_at[p] = at;
                at += len;
            }
        }
    }
    let mut slots = Vec::new();
    let mut value_at = 0;
    for (p, &len) in lens.iter().enumerate() {
        let layout = if TABLES.contains(&p) {
            GradLayout::Rows {
                width: model.params[p].shape[1],
            }
        } else {
            GradLayout::Dense
        };
        slots.push(ParamSlot {
            value: values.view().slice(value_at..value_at + len)?,
            grad: grads.view().slice(grad_at[p]..grad_at[p] + len)?,
            layout,
        });
        value_at += len;
    }
    s.staging
        .upload_slice(&flat(params), values.view(), s.device.stream())?;
    Ok(DeviceParams {
        values,
        grads,
        slots,
        grad_at,
        total,
    })
}

/// A step's touched rows on the device: one view per table.
struct Touched {
    _buffers: Vec<PoolBuffer<u32>>,
    views: Vec<DeviceView<u32>>,
}

/// Uploads step data: gradients into the gradient buffer, touched rows
/// into buffers of their own.
fn upload_step(
    s: &mut Setup,
    dp: &DeviceParams,
    grads: &[Vec<f32>],
    touched: &[Vec<u32>],
) -> Result<Touched> {
    let stream = s.device.stream().clone();
    for (p, data) in grads.iter().enumerate() {
        let at = dp.grad_at[p];
        s.staging
            .upload_slice(data, dp.grads.view().slice(at..at + data.len())?, &stream)?;
    }
    let mut buffers = Vec::new();
    let mut views = Vec::new();
    for rows in touched {
        let buffer = s.pool.alloc::<u32>(rows.len().max(1))?;
        let view = buffer.view().slice(0..rows.len())?;
        if !rows.is_empty() {
            s.staging.upload_slice(rows, view, &stream)?;
        }
        buffers.push(buffer);
        views.push(view);
    }
    Ok(Touched {
        _buffers: buffers,
        views,
    })
}

fn close(device: f32, host: f32) -> bool {
    (device - host).abs() <= 1e-6 + 1e-5 * host.abs()
}

/// Five steps on the device and on the host from the same gradients; every
/// parameter compared after every step, untouched rows checked unchanged,
/// launches counted, the norm compared when asked for.
fn compare(s: &mut Setup, config: &OptimizerConfig, want_norm: bool) -> Result<()> {
    let model = test_model();
    let mut params = Params::<f32>::init(&model, 11);
    let mut host = Optimizer::new(*config, &params);
    let dp = upload_params(s, &model, &params)?;
    let mut opt = DeviceOptimizer::new(&s.device, &s.pool, &s.cache, config, &dp.slots)?;
    let stream = s.device.stream().clone();
    let table_at: Vec<usize> = TABLES
        .iter()
        .map(|&p| params.values[..p].iter().map(|t| t.len()).sum())
        .collect();
    let mut before = flat(&params);
    let mut identical = 0;
    for step in 1..=STEPS {
        let (grads, touched) = step_data(&model, step);
        let g = host_grads(&model, &grads, &touched);
        let host_norm = host.step(&mut params, &g);
        let rows = upload_step(s, &dp, &grads, &touched)?;
        let report = opt.step(&stream, &rows.views, None, want_norm)?;
        let got = s.staging.download_to_vec(dp.values.view(), &stream)?;
        let want = flat(&params);
        let what = format!("{config:?}, step {step}");
        assert_eq!(got.len(), dp.total);
        for (i, (&d, &h)) in got.iter().zip(&want).enumerate() {
            assert!(close(d, h), "{what}: value {i}: device {d} vs host {h}");
            identical += usize::from(d.to_bits() == h.to_bits());
        }
        for (t, &p) in TABLES.iter().enumerate() {
            let width = model.params[p].shape[1];
            let rows = model.params[p].shape[0] as u32;
            for r in (0..rows).filter(|r| !touched[t].contains(r)) {
                let range =
                    table_at[t] + r as usize * width..table_at[t] + (r as usize + 1) * width;
                assert_eq!(
                    got[range.clone()],
                    before[range],
                    "{what}: untouched row {r} of param {p} moved"
                );
            }
        }
        // the norm kernel runs every step: it checks the gradients are finite
        assert_eq!(report.launches, 2, "{what}: launches");
        let status = opt.take_status()?.expect("the step's status");
        assert!(
            status.applied && status.nonfinite_gradient.is_none(),
            "{what}"
        );
        match (want_norm, report.norm) {
            (false, None) => {}
            (true, Some(norm)) => {
                let want = host_norm.unwrap_or_else(|| g.norm());
                assert!(
                    (norm - want).abs() <= 1e-9 * want,
                    "{what}: norm {norm} vs host {want}"
                );
            }
            (asked, got) => panic!("{what}: norm asked {asked}, got {got:?}"),
        }
        before = got;
    }
    assert_eq!(opt.steps(), STEPS);
    println!(
        "{config:?}: {identical} of {} values bit-identical to the host",
        STEPS as usize * dp.total
    );
    Ok(())
}

fn compare_kind(kind: OptimizerKind, lr: f64, weight_decay: f64) -> Result<()> {
    let Some(mut s) = setup() else {
        return Ok(());
    };
    for clip in [None, Some(1.0)] {
        compare(&mut s, &config(kind, lr, weight_decay, clip), false)?;
    }
    Ok(())
}

#[test]
fn sgd_matches_the_host() -> Result<()> {
    compare_kind(OptimizerKind::Sgd, 0.1, 0.01)
}

#[test]
fn adagrad_matches_the_host() -> Result<()> {
    compare_kind(OptimizerKind::Adagrad, 0.1, 0.001)
}

#[test]
fn adam_matches_the_host() -> Result<()> {
    compare_kind(OptimizerKind::Adam, 0.01, 0.0)
}

#[test]
fn adamw_matches_the_host() -> Result<()> {
    compare_kind(OptimizerKind::Adam, 0.01, 0.1)
}

#[test]
fn the_norm_comes_back_only_when_asked() -> Result<()> {
    let Some(mut s) = setup() else {
        return Ok(());
    };
    // clipping: the norm on request (one download), same launches
    compare(
        &mut s,
        &config(OptimizerKind::Adam, 0.01, 0.0, Some(1.0)),
        true,
    )?;
    // no clipping: asking costs one norm launch
    compare(&mut s, &config(OptimizerKind::Sgd, 0.1, 0.0, None), true)?;
    // a threshold above the norm: clipping changes nothing
    compare(
        &mut s,
        &config(OptimizerKind::Adagrad, 0.1, 0.0, Some(1e6)),
        true,
    )
}

#[test]
fn a_second_optimizer_with_the_same_config_compiles_nothing() -> Result<()> {
    let Some(mut s) = setup() else {
        return Ok(());
    };
    let model = test_model();
    let params = Params::<f32>::init(&model, 3);
    let dp = upload_params(&mut s, &model, &params)?;
    let adam = config(OptimizerKind::Adam, 0.01, 0.0, Some(1.0));
    let mut first = DeviceOptimizer::new(&s.device, &s.pool, &s.cache, &adam, &dp.slots)?;
    let compiled = s.cache.stats().compiled;
    let hits = s.cache.stats().memory_hits;
    // other hyper-parameters, same kind and clipping: the same kernel
    let other = OptimizerConfig {
        lr: 0.5,
        beta1: 0.5,
        weight_decay: 0.2,
        clip_norm: Some(3.0),
        ..adam
    };
    let second = DeviceOptimizer::new(&s.device, &s.pool, &s.cache, &other, &dp.slots)?;
    assert_eq!(s.cache.stats().compiled, compiled, "{}", s.cache.stats());
    assert_eq!(s.cache.stats().memory_hits, hits + 1);
    assert_eq!(second.spec(), first.spec());

    // hyper-parameters change in place; the kernel choice cannot
    first.set_config(&other)?;
    assert_eq!(first.config().lr, 0.5);
    let sgd = config(OptimizerKind::Sgd, 0.1, 0.0, Some(1.0));
    assert!(first.set_config(&sgd).is_err());
    let unclipped = OptimizerConfig {
        clip_norm: None,
        ..adam
    };
    assert!(first.set_config(&unclipped).is_err());

    // the state is where `state` says, zero before the first step
    let state = first.state(1)?;
    let (m, v) = (
        state.first.expect("Adam keeps m"),
        state.second.expect("Adam keeps v"),
    );
    assert_eq!(m.len(), params.values[1].len());
    let stream = s.device.stream().clone();
    assert!(s
        .staging
        .download_to_vec(m, &stream)?
        .iter()
        .all(|&x| x == 0.0));
    assert!(s
        .staging
        .download_to_vec(v, &stream)?
        .iter()
        .all(|&x| x == 0.0));
    assert!(first.state(6).is_err());

    // a wrong number of touched-row lists is an error, not a launch
    assert!(first.step(&stream, &[], None, false).is_err());
    assert_eq!(first.steps(), 0);
    assert_eq!(first.launches(), 0);
    Ok(())
}

/// A step whose gradient or loss is not finite changes no value and no
/// moment and is taken back from the step count; its status names the
/// parameter; the next step is the one the host takes after skipping.
#[test]
fn nonfinite_steps_change_nothing_and_the_next_step_follows_the_host() -> Result<()> {
    let Some(mut s) = setup() else {
        return Ok(());
    };
    let config = config(OptimizerKind::Adam, 0.01, 0.01, None);
    let model = test_model();
    let mut params = Params::<f32>::init(&model, 11);
    let mut host = Optimizer::new(config, &params);
    let dp = upload_params(&mut s, &model, &params)?;
    let mut opt = DeviceOptimizer::new(&s.device, &s.pool, &s.cache, &config, &dp.slots)?;
    let stream = s.device.stream().clone();
    let loss = s.pool.alloc::<f32>(1)?;
    let state = |s: &mut Setup, opt: &DeviceOptimizer| -> Result<Vec<f32>> {
        let mut all = Vec::new();
        for p in 0..model.params.len() {
            let st = opt.state(p)?;
            for v in [st.first, st.second].into_iter().flatten() {
                all.extend(s.staging.download_to_vec(v, &stream)?);
            }
        }
        Ok(all)
    };
    // step 2: NaN in a dense gradient (W_out, parameter 3); step 3: a NaN loss
    for step in 1..=4u64 {
        let (mut grads, touched) = step_data(&model, step);
        if step == 2 {
            grads[3][5] = f32::NAN;
        }
        let value = if step == 3 { f32::NAN } else { 0.25 };
        s.staging.upload_slice(&[value], loss.view(), &stream)?;
        let g = host_grads(&model, &grads, &touched);
        let applied = step != 3 && host.step_if_finite(&mut params, &g);
        let (values_before, state_before) = (
            s.staging.download_to_vec(dp.values.view(), &stream)?,
            state(&mut s, &opt)?,
        );
        let rows = upload_step(&mut s, &dp, &grads, &touched)?;
        opt.step(&stream, &rows.views, Some(loss.view()), false)?;
        let status = opt.take_status()?.expect("status");
        assert_eq!(status.applied, applied, "step {step}");
        assert_eq!(opt.steps(), host.steps(), "step {step}: step count");
        let got = s.staging.download_to_vec(dp.values.view(), &stream)?;
        if applied {
            for (i, (&d, &h)) in got.iter().zip(&flat(&params)).enumerate() {
                assert!(
                    close(d, h),
                    "step {step}: value {i}: device {d} vs host {h}"
                );
            }
        } else {
            assert_eq!(got, values_before, "step {step}: values moved");
            assert_eq!(
                state(&mut s, &opt)?,
                state_before,
                "step {step}: moments moved"
            );
            let named = (step == 2).then_some(3);
            assert_eq!(status.nonfinite_gradient, named, "step {step}");
        }
    }
    assert_eq!(opt.steps(), 2);
    Ok(())
}
