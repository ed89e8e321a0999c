//! Tests of the device optimizer: layouts, and the generated kernels run
//! as C++ on the host against `ramus_exec::Optimizer`, bit for bit.

use ramus_core::{Model, Params};
use ramus_exec::Optimizer;

use super::host::*;
use super::plan::RawSegments;
use super::*;
use ramus_conformance::optimizer_fixture::*;

const KINDS: [OptimizerKind; 3] = [
    OptimizerKind::Sgd,
    OptimizerKind::Adagrad,
    OptimizerKind::Adam,
];

#[test]
fn identical_configs_give_identical_source() {
    for kind in KINDS {
        for clip in [None, Some(1.0)] {
            let a = UpdateKernelSpec::of(&config(kind, 0.1, 0.0, clip));
            let b = UpdateKernelSpec::of(&config(kind, 0.1, 0.0, clip));
            assert_eq!(a, b);
            assert_eq!(a.source(), b.source());
            assert_eq!(a.kernel_names(), b.kernel_names());
            assert!(a
                .source()
                .contains(&format!("void {}(", a.update_kernel_name())));
            assert!(a.source().contains("void ramus_grad_norm("));
        }
    }
}

#[test]
fn hyper_parameters_are_arguments_and_structure_is_source() {
    let base = config(OptimizerKind::Adam, 0.01, 0.0, Some(1.0));
    let variants = [
        OptimizerConfig { lr: 0.02, ..base },
        OptimizerConfig {
            weight_decay: 0.1,
            ..base
        },
        OptimizerConfig { beta1: 0.8, ..base },
        OptimizerConfig {
            beta2: 0.99,
            ..base
        },
        OptimizerConfig { eps: 1e-6, ..base },
        OptimizerConfig {
            clip_norm: Some(5.0),
            ..base
        },
    ];
    let spec = UpdateKernelSpec::of(&base);
    for v in &variants {
        // same kernel...
        assert_eq!(UpdateKernelSpec::of(v).source(), spec.source(), "{v:?}");
    }
    // ...different arguments (the clip threshold is the norm kernel's)
    for v in &variants[..5] {
        assert_ne!(
            UpdateArgs::for_step(v, 3),
            UpdateArgs::for_step(&base, 3),
            "{v:?}"
        );
    }
    assert_ne!(variants[5].clip_norm, base.clip_norm);

    // the rule and clipping change the source and the kernel names
    let mut sources = Vec::new();
    let mut names = Vec::new();
    for kind in KINDS {
        for clip in [None, Some(1.0)] {
            let spec = UpdateKernelSpec::of(&config(kind, 0.1, 0.0, clip));
            sources.push(spec.source());
            names.push(spec.update_kernel_name());
        }
    }
    for i in 0..sources.len() {
        for j in 0..i {
            assert_ne!(sources[i], sources[j]);
            assert_ne!(names[i], names[j]);
        }
    }
    // weight decay on or off is the same kernel (AdamW is Adam's kernel)
    assert_eq!(
        UpdateKernelSpec::of(&config(OptimizerKind::Adam, 0.1, 0.05, None)),
        UpdateKernelSpec::of(&config(OptimizerKind::Adam, 0.1, 0.0, None))
    );
}

#[test]
fn the_clip_factor_is_read_only_when_clipping() {
    for kind in KINDS {
        let clipped = UpdateKernelSpec::of(&config(kind, 0.1, 0.0, Some(1.0))).source();
        let plain = UpdateKernelSpec::of(&config(kind, 0.1, 0.0, None)).source();
        assert!(clipped.contains("*clip_scale;"));
        assert!(!plain.contains("*clip_scale;"));
        // no FMA contraction anywhere in the update
        assert!(clipped.contains("__fmul_rn") && clipped.contains("__fadd_rn"));
    }
}

#[test]
fn bias_corrections_follow_the_host() {
    let c = config(OptimizerKind::Adam, 0.001, 0.01, None);
    for step in [1u64, 2, 10, 1000] {
        let a = UpdateArgs::for_step(&c, step);
        let t = step as f64;
        assert_eq!(
            a.inv_bias_correction1,
            (1.0 / (1.0 - 0.9f64.powf(t))) as f32
        );
        assert_eq!(
            a.inv_bias_correction2,
            (1.0 / (1.0 - 0.999f64.powf(t))) as f32
        );
        assert_eq!(a.lr, 0.001f32);
        assert_eq!(a.weight_decay, 0.01f32);
        assert_eq!(a.one_minus_beta1, 1.0f32 - 0.9f32);
        assert_eq!(a.one_minus_beta2, 1.0f32 - 0.999f32);
        assert_eq!(a.eps, 1e-8f32);
    }
    assert_ne!(UpdateArgs::for_step(&c, 1), UpdateArgs::for_step(&c, 2));
}

#[test]
fn raw_structs_match_the_cuda_layout() {
    assert_eq!(std::mem::size_of::<RawSegment>(), 64);
    assert_eq!(std::mem::size_of::<RawSegments>(), 64 * MAX_SEGMENTS);
    assert_eq!(std::mem::size_of::<UpdateArgs>(), 36);
    assert!(PRELUDE.contains(&format!("#define RAMUS_MAX_SEGMENTS {MAX_SEGMENTS}")));
    assert!(PRELUDE.contains(&format!("#define RAMUS_BLOCK {BLOCK}")));
}

// ------------------------------------------------------------------
// Plans over fake device addresses
// ------------------------------------------------------------------

#[test]
fn a_leading_table_leaves_one_dense_run() {
    let pool = fake_pool();
    let l = engine_layout(
        &pool,
        &[(40 * 6, Some(6)), (72, None), (6, None), (30, None)],
    );
    let state = State::new(&pool, OptimizerKind::Adam, &l.slots).unwrap();
    let plan = &state.plan;
    assert_eq!(plan.runs.len(), 1);
    let run = plan.runs[0];
    assert_eq!(run.len, 108);
    assert_eq!(run.grad, l.grads.view().device_ptr()); // the dense prefix
    assert_eq!(run.value, l.values.view().device_ptr() + 4 * 240);
    let first = state.first.as_ref().unwrap().view().device_ptr();
    assert_eq!(run.first, first + 4 * 240);
    assert_eq!(plan.tables.len(), 1);
    let t = plan.tables[0];
    assert_eq!((t.width, t.rows), (6, 40));
    assert_eq!(t.grad, l.grads.view().device_ptr() + 4 * 108);
    assert_eq!(t.first, first);
    assert_eq!(t.second, state.second.as_ref().unwrap().view().device_ptr());
    assert_eq!(
        state.offsets,
        vec![(0, 240), (240, 72), (312, 6), (318, 30)]
    );
}

#[test]
fn tables_between_dense_parameters_split_the_runs() {
    let pool = fake_pool();
    // W, emb, b, W_out, tags, W_leaf: runs [W], [b, W_out], [W_leaf]
    let l = engine_layout(
        &pool,
        &[
            (72, None),
            (240, Some(6)),
            (6, None),
            (30, None),
            (120, Some(4)),
            (60, None),
        ],
    );
    let state = State::new(&pool, OptimizerKind::Sgd, &l.slots).unwrap();
    let plan = &state.plan;
    assert!(state.first.is_none() && state.second.is_none());
    let lens: Vec<usize> = plan.runs.iter().map(|r| r.len).collect();
    assert_eq!(lens, [72, 36, 60]);
    assert!(plan.runs.iter().all(|r| r.first == 0 && r.second == 0));
    assert_eq!(plan.runs[1].grad, l.grads.view().device_ptr() + 4 * 72);
    assert_eq!(plan.tables.len(), 2);

    let rows = pool.alloc::<u32>(16).unwrap();
    let touched = [
        rows.view().slice(0..5).unwrap(),
        rows.view().slice(5..5).unwrap(),
    ];
    let segs = plan.segments(&touched).unwrap();
    assert_eq!(segs.len(), 4, "the empty table is left out");
    assert_eq!(segs[3].rows, rows.view().device_ptr());
    assert_eq!((segs[3].len, segs[3].width, segs[3].table_rows), (5, 6, 40));
    assert_eq!(segs[3].elements(), 30);
    assert_eq!(segs[0].elements(), 72);
    assert_eq!(l.grad_at, vec![0, 168, 72, 78, 408, 108]);

    assert!(plan.segments(&touched[..1]).is_err(), "one list per table");
    let too_many = pool.alloc::<u32>(41).unwrap();
    assert!(plan.segments(&[too_many.view(), touched[1]]).is_err());
}

/// Slots over `buf`: (value range, gradient range, layout) each.
fn slots_in(
    buf: &PoolBuffer<f32>,
    specs: &[(std::ops::Range<usize>, std::ops::Range<usize>, GradLayout)],
) -> Vec<ParamSlot> {
    specs
        .iter()
        .map(|(value, grad, layout)| ParamSlot {
            value: buf.view().slice(value.clone()).unwrap(),
            grad: buf.view().slice(grad.clone()).unwrap(),
            layout: *layout,
        })
        .collect()
}

#[test]
fn frozen_buffers_are_left_out_of_every_segment() {
    let pool = fake_pool();
    let buf = pool.alloc::<f32>(1000).unwrap();
    let v = |a: usize, b: usize| buf.view().slice(a..b).unwrap();
    let (dense, frozen) = (GradLayout::Dense, GradLayout::Frozen);
    // dense, frozen, dense, dense: the frozen slot splits the run and
    // no segment covers it
    let slots = slots_in(
        &buf,
        &[
            (0..10, 500..510, dense),
            (10..14, 510..514, frozen),
            (14..20, 514..520, dense),
            (20..30, 520..530, dense),
        ],
    );
    let state = State::new(&pool, OptimizerKind::Adam, &slots).unwrap();
    let segs = state.plan.segments(&[]).unwrap();
    assert_eq!(segs.len(), 2);
    assert_eq!((segs[0].value, segs[0].len), (v(0, 10).device_ptr(), 10));
    assert_eq!((segs[1].value, segs[1].len), (v(14, 20).device_ptr(), 16));
    let covered: u64 = segs.iter().map(|s| s.elements()).sum();
    assert_eq!(covered, 26, "the 4 frozen values are not updated");
    // a model of buffers only has nothing to update
    let only = slots_in(&buf, &[(0..4, 500..504, frozen)]);
    let state = State::new(&pool, OptimizerKind::Sgd, &only).unwrap();
    assert!(state.plan.segments(&[]).unwrap().is_empty());
}

#[test]
fn bad_layouts_are_errors() {
    let pool = fake_pool();
    let buf = pool.alloc::<f32>(1000).unwrap();
    let v = |a: usize, b: usize| buf.view().slice(a..b).unwrap();
    let slot = |value, grad, layout| ParamSlot {
        value,
        grad,
        layout,
    };
    let dense = GradLayout::Dense;
    let ok = [slot(v(0, 10), v(500, 510), dense)];
    assert!(State::new(&pool, OptimizerKind::Adam, &ok).is_ok());
    let bad: [&[ParamSlot]; 5] = [
        &[slot(v(0, 10), v(500, 509), dense)],
        &[slot(v(0, 10), v(500, 510), GradLayout::Rows { width: 3 })],
        &[slot(v(0, 10), v(500, 510), GradLayout::Rows { width: 0 })],
        &[
            slot(v(0, 10), v(500, 510), dense),
            slot(v(5, 15), v(600, 610), dense),
        ],
        &[slot(v(0, 10), v(5, 15), dense)],
    ];
    for slots in bad {
        assert!(
            matches!(
                State::new(&pool, OptimizerKind::Sgd, slots),
                Err(CudaError::BadArgument(_))
            ),
            "{slots:?}"
        );
    }
}

#[test]
fn chunks_split_at_max_segments_and_number_the_norm_slots() {
    let seg = |len: u64, width: u32| RawSegment {
        len,
        width,
        ..RawSegment::default()
    };
    let mut segments: Vec<RawSegment> = (0..20).map(|i| seg(100 + i, 0)).collect();
    segments[3] = seg(1 << 20, 0);
    segments[18] = seg(1000, 64); // 64000 elements
    let (chunks, total) = launch_chunks(&segments, MAX_NORM_BLOCKS).unwrap();
    assert_eq!(chunks.len(), 2);
    assert_eq!((chunks[0].count, chunks[0].grid_x), (16, MAX_NORM_BLOCKS));
    assert_eq!((chunks[1].count, chunks[1].grid_x), (4, MAX_NORM_BLOCKS));
    assert_eq!(chunks[1].slot_base, 16 * MAX_NORM_BLOCKS);
    assert_eq!(total, 20 * MAX_NORM_BLOCKS);
    assert_eq!(chunks[1].segments.s[2], segments[18]);
    assert_eq!(chunks[1].segments.s[4], RawSegment::default());
    // updates: as wide as the largest segment of the launch needs
    let (chunks, total) = launch_chunks(&segments, MAX_UPDATE_BLOCKS).unwrap();
    assert_eq!(
        (chunks[0].grid_x, chunks[1].grid_x),
        (MAX_UPDATE_BLOCKS, 250)
    );
    assert_eq!(total, 16 * MAX_UPDATE_BLOCKS + 4 * 250);
    let (small, total) = launch_chunks(&segments[..2], MAX_UPDATE_BLOCKS).unwrap();
    assert_eq!((small.len(), small[0].grid_x, total), (1, 1, 2));
    assert_eq!(launch_chunks(&[], MAX_NORM_BLOCKS).unwrap().1, 0);
}

// ------------------------------------------------------------------
// The generated kernels, compiled and run on the host
// ------------------------------------------------------------------

/// The test model's parameters: (length, row width if a table).
fn test_shapes(model: &Model) -> Vec<(usize, Option<usize>)> {
    model
        .params
        .iter()
        .enumerate()
        .map(|(p, spec)| {
            let len = spec.shape.iter().product();
            (len, TABLES.contains(&p).then(|| spec.shape[1]))
        })
        .collect()
}

/// Runs `configs` for [`STEPS`] steps through the generated kernels on
/// the host and through `ramus_exec::Optimizer`, and compares every
/// parameter after every step, bit for bit; parameter `p`'s rate is
/// multiplied by `scales[p]` (empty: 1 for every one) on both.
fn compare_with_host(configs: &[OptimizerConfig], scales: &[f64]) {
    let model = test_model();
    let shapes = test_shapes(&model);
    let total: usize = shapes.iter().map(|s| s.0).sum();
    let initial = Params::<f32>::init(&model, 7);
    let modules: Vec<(String, UpdateKernelSpec)> = configs
        .iter()
        .enumerate()
        .map(|(c, config)| (format!("c{c}"), UpdateKernelSpec::of(config)))
        .collect();
    let mut src = host_program(&modules);
    // The host reference: per config, per step, (values, norm).
    let mut expected: Vec<Vec<(Vec<f32>, Option<f64>)>> = Vec::new();
    for (config, (ns, spec)) in configs.iter().zip(&modules) {
        // The device: the engine's layout and the optimizer's own state.
        let pool = fake_pool();
        let layout = engine_layout(&pool, &shapes);
        let mut state = State::new(&pool, config.kind, &layout.slots).unwrap();
        if !scales.is_empty() {
            let view =
                |b: &Option<PoolBuffer<f32>>| b.as_ref().map(|b| b.view().slice(0..total).unwrap());
            let scales: Vec<f32> = scales.iter().map(|&s| s as f32).collect();
            let (first, second) = (view(&state.first), view(&state.second));
            state.plan = Plan::with_scales(&layout.slots, &scales, first, second).unwrap();
        }
        let values_at = layout.values.view().device_ptr();
        src += "    std::memset(mem, 0, 1 << 20);\n";
        src += &put_cpp(values_at, &bits(&flat(&initial)));
        let mut params = initial.clone();
        let mut host = Optimizer::new(*config, &params);
        host.set_lr_scales(scales).unwrap();
        let mut steps = Vec::new();
        for step in 1..=STEPS {
            let (grads, touched) = step_data(&model, step);
            let g = host_grads(&model, &grads, &touched);
            let norm = host.step(&mut params, &g);
            steps.push((flat(&params), norm));

            for (p, data) in grads.iter().enumerate() {
                let addr = layout.grads.view().device_ptr() + 4 * layout.grad_at[p] as u64;
                src += &put_cpp(addr, &bits(data));
            }
            let mut views = Vec::new();
            let mut keep = Vec::new();
            for rows in &touched {
                let buffer = pool.alloc::<u32>(rows.len().max(1)).unwrap();
                let view = buffer.view().slice(0..rows.len()).unwrap();
                src += &put_cpp(view.device_ptr(), rows);
                views.push(view);
                keep.push(buffer);
            }
            let segments = state.plan.segments(&views).unwrap();
            let max = config.clip_norm.unwrap_or(f64::INFINITY);
            src += &norm_cpp(ns, &state, &segments, max, 0);
            let args = UpdateArgs::for_step(config, step);
            src += &update_cpp(ns, *spec, &state, &segments, &args);
            let _ = writeln!(
                src,
                "    dump({values_at}ull, {total});\n    dump({}ull, 2);",
                state.words.view().device_ptr()
            );
        }
        expected.push(steps);
    }
    src += "    return 0;\n}\n";
    let Some(output) = run_on_host("compare", &src) else {
        return;
    };

    let mut lines = output.into_iter();
    let tables: Vec<(usize, usize, usize)> = TABLES
        .iter()
        .map(|&p| {
            let at: usize = shapes[..p].iter().map(|s| s.0).sum();
            (p, at, shapes[p].1.unwrap_or(1))
        })
        .collect();
    for (c, config) in configs.iter().enumerate() {
        let mut before = flat(&initial);
        for (step, (want, want_norm)) in expected[c].iter().enumerate() {
            let got: Vec<f32> = lines
                .next()
                .unwrap()
                .into_iter()
                .map(f32::from_bits)
                .collect();
            let norm = lines.next().unwrap();
            let what = format!("{config:?}, step {}", step + 1);
            assert_eq!(got.len(), total);
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{what}: value {i}: kernel {g} vs host {w}"
                );
            }
            // untouched table rows did not move
            let (_, touched) = step_data(&model, step as u64 + 1);
            for (t, &(p, at, width)) in tables.iter().enumerate() {
                let rows = shapes[p].0 / width;
                for r in (0..rows as u32).filter(|r| !touched[t].contains(r)) {
                    let range = at + r as usize * width..at + (r as usize + 1) * width;
                    assert_eq!(
                        got[range.clone()],
                        before[range],
                        "{what}: row {r} of table {p}"
                    );
                }
            }
            if let Some(want_norm) = want_norm {
                let norm = f64::from_bits(u64::from(norm[0]) | (u64::from(norm[1]) << 32));
                assert!(
                    (norm - want_norm).abs() <= 1e-12 * want_norm,
                    "{what}: norm {norm} vs host {want_norm}"
                );
                assert!(norm > 1.0, "{what}: the clipping threshold is crossed");
            }
            before = got;
        }
    }
}

#[test]
fn generated_kernels_match_the_host_reference_bit_for_bit() {
    let mut configs = Vec::new();
    for clip in [None, Some(1.0)] {
        configs.push(config(OptimizerKind::Sgd, 0.1, 0.01, clip));
        configs.push(config(OptimizerKind::Adagrad, 0.1, 0.001, clip));
        configs.push(config(OptimizerKind::Adam, 0.01, 0.0, clip));
        configs.push(config(OptimizerKind::Adam, 0.01, 0.1, clip)); // AdamW
    }
    compare_with_host(&configs, &[]);
}

/// Per-parameter multipliers of the rate (a frozen table, a slower one, a
/// dense parameter of its own rate, which splits its run): the kernels
/// still match the host reference bit for bit.
#[test]
fn rate_multipliers_match_the_host_reference_bit_for_bit() {
    let model = test_model();
    let mut scales = vec![1.0; model.params.len()];
    scales[TABLES[0]] = 0.0;
    scales[*TABLES.last().unwrap()] = 0.5;
    // a dense parameter whose run goes on into the next one
    let dense = (0..scales.len() - 1)
        .find(|p| !TABLES.contains(p) && !TABLES.contains(&(p + 1)))
        .unwrap();
    scales[dense] = 0.25;
    let mut configs = Vec::new();
    for clip in [None, Some(1.0)] {
        configs.push(config(OptimizerKind::Sgd, 0.1, 0.01, clip));
        configs.push(config(OptimizerKind::Adagrad, 0.1, 0.001, clip));
        configs.push(config(OptimizerKind::Adam, 0.01, 0.1, clip));
    }
    compare_with_host(&configs, &scales);
    // the split: the scaled dense parameter runs on its own
    let pool = fake_pool();
    let layout = engine_layout(&pool, &test_shapes(&model));
    let plain = Plan::new(&layout.slots, None, None).unwrap();
    let scales: Vec<f32> = scales.iter().map(|&s| s as f32).collect();
    let scaled = Plan::with_scales(&layout.slots, &scales, None, None).unwrap();
    assert!(scaled.runs.len() > plain.runs.len());
    assert_eq!(scaled.tables.len(), plain.tables.len());
    assert_eq!(scaled.tables[0].lr_scale, 0.0f32.to_bits());
}

/// More segments than one launch takes: the norm's last block is in
/// the last launch and sums every launch's partial sums; the update
/// reaches every segment. Two steps check that the counter re-arms.
#[test]
fn the_norm_and_update_span_several_launches() {
    // 37 dense parameters and 3 tables, interleaved so that nothing merges
    let mut shapes = Vec::new();
    for p in 0..40usize {
        shapes.push(if p % 13 == 5 {
            (12 * 4, Some(4))
        } else {
            (1 + p * 37 % 300, None)
        });
    }
    // gaps between dense gradients keep the parameters separate runs
    let pool = fake_pool();
    let total: usize = shapes.iter().map(|s| s.0).sum();
    let values = pool.alloc::<f32>(total).unwrap();
    let grads = pool.alloc::<f32>(2 * total).unwrap();
    let mut slots = Vec::new();
    let (mut v, mut g) = (0, 0);
    for &(len, width) in &shapes {
        slots.push(ParamSlot {
            value: values.view().slice(v..v + len).unwrap(),
            grad: grads.view().slice(g..g + len).unwrap(),
            layout: width.map_or(GradLayout::Dense, |width| GradLayout::Rows { width }),
        });
        v += len;
        g += 2 * len;
    }
    let state = State::new(&pool, OptimizerKind::Sgd, &slots).unwrap();
    assert_eq!((state.plan.runs.len(), state.plan.tables.len()), (37, 3));
    let rows = pool.alloc::<u32>(3).unwrap();
    let touched = [
        rows.view().slice(0..1).unwrap(),
        rows.view().slice(1..3).unwrap(),
        rows.view().slice(3..3).unwrap(),
    ];
    let segments = state.plan.segments(&touched).unwrap();
    assert_eq!(segments.len(), 39);
    assert_eq!(
        launch_chunks(&segments, MAX_NORM_BLOCKS).unwrap().0.len(),
        3
    );

    let cfg = config(OptimizerKind::Sgd, 0.5, 0.0, Some(2.0));
    let spec = UpdateKernelSpec::of(&cfg);
    let mut src = host_program(&[("c0".to_string(), spec)]);
    src += "    std::memset(mem, 0, 1 << 20);\n";
    src += &put_cpp(rows.view().device_ptr(), &[7, 2, 11]);
    let mut expected = Vec::new();
    for step in 1..=2u64 {
        let all = ramus_conformance::fixtures::values(2 * total, 1000 + step);
        src += &put_cpp(grads.view().device_ptr(), &bits(&all));
        src += &norm_cpp("c0", &state, &segments, 2.0, 0);
        src += &update_cpp(
            "c0",
            spec,
            &state,
            &segments,
            &UpdateArgs::for_step(&cfg, step),
        );
        let _ = writeln!(
            src,
            "    dump({}ull, {total});\n    dump({}ull, 2);",
            values.view().device_ptr(),
            state.words.view().device_ptr()
        );
        // the reference: every dense gradient, rows 7 of table 0 and 2
        // and 11 of table 1
        let mut sum = 0.0f64;
        let mut read = Vec::new(); // (value index, grad index)
        let (mut v, mut g, mut table) = (0, 0, 0);
        for &(len, width) in &shapes {
            match width {
                None => read.extend((0..len).map(|i| (v + i, g + i))),
                Some(w) => {
                    let picked: &[usize] = [&[7][..], &[2, 11][..], &[][..]][table];
                    for &r in picked {
                        read.extend((0..w).map(|i| (v + r * w + i, g + r * w + i)));
                    }
                    table += 1;
                }
            }
            v += len;
            g += 2 * len;
        }
        for &(_, gi) in &read {
            sum += f64::from(all[gi]) * f64::from(all[gi]);
        }
        let norm = sum.sqrt();
        let scale = if norm > 2.0 { (2.0 / norm) as f32 } else { 1.0 };
        expected.push((norm, scale, read, all));
    }
    src += "    return 0;\n}\n";
    let Some(output) = run_on_host("chunks", &src) else {
        return;
    };
    let mut lines = output.into_iter();
    let mut now = vec![0.0f32; total];
    for (step, (norm, scale, read, all)) in expected.iter().enumerate() {
        for &(vi, gi) in read {
            now[vi] -= 0.5 * (all[gi] * scale);
        }
        let got: Vec<f32> = lines
            .next()
            .unwrap()
            .into_iter()
            .map(f32::from_bits)
            .collect();
        let words = lines.next().unwrap();
        let got_norm = f64::from_bits(u64::from(words[0]) | (u64::from(words[1]) << 32));
        assert!(
            (got_norm - norm).abs() <= 1e-12 * norm,
            "step {step}: norm {got_norm} vs {norm}"
        );
        assert_eq!(bits(&got), bits(&now), "step {step}");
    }
}

// ------------------------------------------------------------------
// Non-finite steps
// ------------------------------------------------------------------

/// What a poisoned step of [`a_nonfinite_step_changes_nothing`] puts in:
/// (parameter, touched row or element, value) and whether the loss is NaN.
type Poison = (Vec<(usize, usize, f32)>, bool);

/// Steps 2 to 5 poisoned: NaN in `W_out` (inside the run that starts at
/// `b`) and in a touched `tags` row; +inf in a touched `tags` row (step 3
/// touches none, so the step is clean); a NaN loss with finite gradients;
/// -inf in a touched `emb` row. Step 1 and 6 are clean.
fn poison(step: u64) -> Poison {
    match step {
        2 => (vec![(3, 7, f32::NAN), (4, 0, f32::NAN)], false),
        3 => (vec![(4, 0, f32::INFINITY)], false),
        4 => (Vec::new(), true),
        5 => (vec![(1, 2, f32::NEG_INFINITY)], false),
        _ => (Vec::new(), false),
    }
}

/// The generated kernels against the host reference over poisoned steps:
/// a step whose loss or a touched gradient is not finite changes no value
/// and no moment, raises the skip flag and names, through the reported
/// key, the parameter `ramus_exec`'s check names first; the step count the
/// update is given (the host's applied steps) keeps both sides equal after.
#[test]
fn a_nonfinite_step_changes_nothing() {
    use ramus_exec::nonfinite::first_nonfinite;
    let model = test_model();
    let shapes = test_shapes(&model);
    let total: usize = shapes.iter().map(|s| s.0).sum();
    let configs = [
        config(OptimizerKind::Sgd, 0.1, 0.01, None),
        config(OptimizerKind::Adagrad, 0.1, 0.0, Some(1.0)),
        config(OptimizerKind::Adam, 0.01, 0.1, None),
    ];
    let modules: Vec<(String, UpdateKernelSpec)> = configs
        .iter()
        .enumerate()
        .map(|(c, config)| (format!("c{c}"), UpdateKernelSpec::of(config)))
        .collect();
    let mut src = host_program(&modules);
    let initial = Params::<f32>::init(&model, 7);
    // per config and step: the host's values, whether it applied the step,
    // the parameter its check names
    let mut expected = Vec::new();
    let mut layouts = Vec::new();
    for (config, (ns, spec)) in configs.iter().zip(&modules) {
        let pool = fake_pool();
        let layout = engine_layout(&pool, &shapes);
        let state = State::new(&pool, config.kind, &layout.slots).unwrap();
        let loss = pool.alloc::<f32>(1).unwrap();
        src += "    std::memset(mem, 0, 1 << 20);\n";
        src += &put_cpp(layout.values.view().device_ptr(), &bits(&flat(&initial)));
        let mut params = initial.clone();
        let mut host = Optimizer::new(*config, &params);
        let mut steps = Vec::new();
        for step in 1..=6 {
            let (mut grads, touched) = step_data(&model, step);
            let (poisoned, nan_loss) = poison(step);
            for &(p, at, value) in &poisoned {
                let element = match TABLES.iter().position(|&t| t == p) {
                    // the first in-range touched row, if the step has one
                    Some(t) => match touched[t]
                        .iter()
                        .find(|&&r| (r as usize) * shapes[p].1.unwrap() < shapes[p].0)
                    {
                        Some(&row) => row as usize * shapes[p].1.unwrap() + at,
                        None => at, // an untouched row: read by neither side
                    },
                    None => at,
                };
                grads[p][element] = value;
            }
            let g = host_grads(&model, &grads, &touched);
            let named = first_nonfinite(&model, &params, Some(&g)).map(|n| n.index);
            let args = UpdateArgs::for_step(config, host.steps() + 1);
            let applied = !nan_loss && host.step_if_finite(&mut params, &g);
            let loss_value = if nan_loss {
                f32::NAN
            } else {
                0.25 * step as f32
            };
            steps.push((flat(&params), applied, named, loss_value));

            for (p, data) in grads.iter().enumerate() {
                let addr = layout.grads.view().device_ptr() + 4 * layout.grad_at[p] as u64;
                src += &put_cpp(addr, &bits(data));
            }
            src += &put_cpp(loss.view().device_ptr(), &bits(&[loss_value]));
            let mut views = Vec::new();
            let mut keep = Vec::new();
            for rows in &touched {
                let buffer = pool.alloc::<u32>(rows.len().max(1)).unwrap();
                let view = buffer.view().slice(0..rows.len()).unwrap();
                src += &put_cpp(view.device_ptr(), rows);
                views.push(view);
                keep.push(buffer);
            }
            let segments = state.plan.segments(&views).unwrap();
            let max = config.clip_norm.unwrap_or(f64::INFINITY);
            src += &norm_cpp(ns, &state, &segments, max, loss.view().device_ptr());
            src += &update_cpp(ns, *spec, &state, &segments, &args);
            let _ = writeln!(
                src,
                "    dump({}ull, {total});",
                layout.values.view().device_ptr()
            );
            for moments in [&state.first, &state.second] {
                let at = moments
                    .as_ref()
                    .map_or(layout.values.view().device_ptr(), |m| m.view().device_ptr());
                let _ = writeln!(src, "    dump({at}ull, {total});");
            }
            let _ = writeln!(
                src,
                "    dump({}ull, {STATUS_WORDS});",
                state.words.view().device_ptr()
            );
        }
        expected.push(steps);
        layouts.push((pool, layout));
    }
    src += "    return 0;\n}\n";
    let Some(output) = run_on_host("nonfinite", &src) else {
        return;
    };
    let mut lines = output.into_iter();
    for (c, config) in configs.iter().enumerate() {
        let mut before: Option<(Vec<u32>, Vec<u32>)> = None;
        let mut skipped = 0;
        for (step, (want, applied, named, loss)) in expected[c].iter().enumerate() {
            let what = format!("{config:?}, step {}", step + 1);
            let values = lines.next().unwrap();
            let moments = (lines.next().unwrap(), lines.next().unwrap());
            let status = status::decode(&lines.next().unwrap(), &layouts[c].1.slots);
            assert_eq!(values, bits(want), "{what}: values");
            assert_eq!(status.applied, *applied, "{what}: skip flag");
            assert_eq!(
                status.loss.to_bits(),
                loss.to_bits(),
                "{what}: the loss checked"
            );
            if !applied {
                skipped += 1;
                assert_eq!(Some(&moments), before.as_ref(), "{what}: moments moved");
                assert_eq!(
                    status.nonfinite_gradient, *named,
                    "{what}: the parameter named"
                );
            }
            before = Some(moments);
        }
        // step 3's poison sits in an untouched row: that step is applied
        assert_eq!(skipped, 3, "{config:?}");
    }
}

/// Buffers are kept before a step and restored only if it was skipped.
#[test]
fn buffers_come_back_only_after_a_skipped_step() {
    let pool = fake_pool();
    let buf = pool.alloc::<f32>(64).unwrap();
    let (dense, frozen) = (GradLayout::Dense, GradLayout::Frozen);
    // two adjacent buffers (one segment), a dense slot, one more buffer
    let slots = slots_in(
        &buf,
        &[
            (0..4, 32..36, frozen),
            (4..8, 36..40, frozen),
            (8..12, 40..44, dense),
            (12..15, 44..47, frozen),
        ],
    );
    let state = State::new(&pool, OptimizerKind::Sgd, &slots).unwrap();
    assert_eq!(state.buffers.len(), 2);
    assert_eq!((state.buffers[0].len, state.buffers[1].len), (8, 3));
    let spec = UpdateKernelSpec::of(&config(OptimizerKind::Sgd, 0.1, 0.0, None));
    let mut src = host_program(&[("c0".to_string(), spec)]);
    src += "    std::memset(mem, 0, 1 << 20);\n";
    let first: Vec<f32> = (0..15).map(|i| i as f32).collect();
    let status = state.status().unwrap().device_ptr();
    for skip in [0u32, 1] {
        src += &put_cpp(buf.view().device_ptr(), &bits(&first));
        src += &keep_cpp("c0", &state, false);
        // the forward pass blends the batch into the statistics
        src += &put_cpp(buf.view().device_ptr(), &bits(&[-1.0; 15]));
        src += &put_cpp(status, &[skip]);
        src += &keep_cpp("c0", &state, true);
        let _ = writeln!(src, "    dump({}ull, 15);", buf.view().device_ptr());
    }
    src += "    return 0;\n}\n";
    let Some(output) = run_on_host("buffers", &src) else {
        return;
    };
    assert_eq!(
        output[0],
        bits(&[-1.0; 15]),
        "an applied step keeps the new statistics"
    );
    let mut want = bits(&first);
    want[8..12].copy_from_slice(&bits(&[-1.0; 4])); // not a buffer: not restored
    assert_eq!(output[1], want, "a skipped step restores every buffer");
}
