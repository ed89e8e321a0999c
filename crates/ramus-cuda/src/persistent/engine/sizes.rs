//! The sizes of the persistent engine's device buffers, as functions used
//! both where the engine allocates them and in its estimate of what a run
//! needs ([`need`]), so that the two cannot drift apart:
//!
//! * the pool buffer: the parameter region ([`ParamLayout`]: values,
//!   gradients, moments), then a batch's regions, which [`layout_terms`]
//!   counts per row, edge and head row from the layout `unroll_batch`
//!   allocates (node by node through the same `node_region`, plus its
//!   index arrays); sized once for the largest batch a check found to fit
//!   ([`buffer_floats`]), else grown as batches need;
//! * a script buffer per batch in flight and the barrier counters, whose
//!   sizes only scheduling gives: [`need`]'s `train_extra` schedules the
//!   largest batch for every plan the engine may build, as
//!   [`schedule_batch`] does for every batch it prepares;
//! * each kernel's tables ([`kernel_tables`]), which name where each cached
//!   matrix's slots lie in the parameter region ([`matrix_slots`]).
//!
//! [`ParamLayout`]: crate::persistent::program::ParamLayout

use std::sync::{Arc, Mutex};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use ramus_codegen::persistent::{TRACE_AT, TRACE_WORDS_PER_CTA};
use ramus_core::graph::{NodeKind, Role, Source, Space};
use ramus_core::vpps::{plan, split_launches, BatchScripts, RegisterPlan, Scheduler};
use ramus_core::Model;
use ramus_exec::memory::{ActivationCost, BatchExtra, CostTerms, DeviceNeed, Pass, ELEMENT_BYTES};
use ramus_graph::InputGraph;

use super::batch::{schedule_graphs, LaunchScripts};
use super::options::model_err;
use super::variant::{variant_scheduler, VariantBuild, VariantChoice};
use crate::error::Result;
use crate::memory::block_bytes;
use crate::persistent::program::{graph_keys, PersistentProgram};
use crate::persistent::unroll::{node_region, unroll_batch, BatchProgram, Lowering};
use crate::persistent::{kernel_tables, MatrixSlots};

/// Floats of batch values the pool buffer starts with when no check sized
/// it (it grows as batches need).
pub(super) const BATCH_HEADROOM: usize = 16 << 20;

/// Barrier counters the engine starts with.
pub(super) const INITIAL_BARRIERS: usize = 1024;

/// Floats of the pool buffer: the parameter region, then room for a batch
/// of `batch_bytes` (a check's largest batch; 0: [`BATCH_HEADROOM`]).
pub(super) fn buffer_floats(params_total: usize, batch_bytes: u64) -> usize {
    let batch = match batch_bytes {
        0 => BATCH_HEADROOM,
        b => usize::try_from(b.div_ceil(ELEMENT_BYTES)).unwrap_or(usize::MAX),
    };
    params_total.saturating_add(batch)
}

/// Floats the pool buffer grows to for a batch ending at float `needed`
/// (one larger than every check counted: by powers of two, so that a few
/// growths cover an epoch).
pub(super) fn grown_buffer_floats(needed: usize) -> usize {
    needed.next_power_of_two()
}

/// Words of a slot's script buffer for scripts of `words` (kept for the
/// slot's later batches, so by powers of two).
pub(super) fn script_buffer_words(words: usize) -> usize {
    words.next_power_of_two()
}

/// Batches whose scripts are on the device at once at most, each in a slot
/// with a script buffer of its own: a window being queued while the window
/// before still runs.
pub(super) fn slots_in_flight() -> usize {
    2 * crate::persistent::prepared_ahead()
}

/// Schedules `batch` (lowered for a plan with `in_registers`): each launch's
/// scripts (`None`: host work only), at its offset in the slot's script
/// buffer, and without register gradients the matrices' update. The task
/// graphs are freed as they are scheduled.
pub(super) fn schedule_batch(
    scheduler: &Scheduler,
    batch: &mut BatchProgram,
    lowering: Lowering,
) -> Result<(Vec<LaunchScripts>, Option<BatchScripts>)> {
    let graph = std::mem::take(&mut batch.graph);
    let mut launches = Vec::new();
    let mut at = 0;
    for launch in split_launches(graph)? {
        let scripts = (!launch.graph.is_empty())
            .then(|| scheduler.schedule(&launch.graph))
            .transpose()?;
        let words = scripts.as_ref().map_or(0, |s| s.packed.words.len());
        launches.push(LaunchScripts {
            scripts,
            at,
            host_after: launch.host_after,
        });
        at += words;
    }
    // the cached matrices' updates, a launch of their own (none when the
    // updates are deferred)
    let updates = (!lowering.grads_in_registers && !lowering.defer_updates)
        .then(|| scheduler.schedule(&batch.matrix_updates))
        .transpose()?;
    Ok((launches, updates))
}

/// Words of a batch's scripts: every launch's, then the update's.
pub(super) fn script_words(launches: &[LaunchScripts], updates: Option<&BatchScripts>) -> usize {
    launches
        .iter()
        .filter_map(|l| l.scripts.as_ref())
        .chain(updates)
        .map(|s| s.packed.words.len())
        .sum()
}

/// Barrier counters a batch's launches need (a traced kernel of
/// `traced_ctas` CTAs writes its records behind them).
pub(super) fn barrier_words(
    launches: &[LaunchScripts],
    updates: Option<&BatchScripts>,
    traced_ctas: Option<usize>,
) -> usize {
    match traced_ctas {
        Some(ctas) => TRACE_AT + TRACE_WORDS_PER_CTA * ctas,
        None => launches
            .iter()
            .filter_map(|l| l.scripts.as_ref())
            .chain(updates)
            .map(|s| s.packed.barriers)
            .max()
            .unwrap_or(0)
            .max(1),
    }
}

/// Bytes a batch's regions take per function row and child edge, per head
/// row and whatever the batch, as `unroll_batch` lays them out: every node
/// buffer `node_region` gives a region (its space's rows of its width,
/// at least one float), then the upload region's index arrays. An upper
/// bound: each buffer's "at least one float" and the rows' touched-row
/// lists (at most one entry a row) are counted in full.
pub(crate) fn layout_terms(model: &Model, prog: &PersistentProgram) -> Result<CostTerms> {
    let mut t = CostTerms::zero(model.functions.len());
    for key in graph_keys(model) {
        let g = key.graph(model);
        for (n, node) in g.nodes.iter().enumerate() {
            if node_region(model, prog, key, n)?.is_none() {
                continue;
            }
            let w = node.ty.width() as u64;
            t.fixed += 1;
            match (key.function(), node.ty.space) {
                (_, Space::Static) => t.fixed += w,
                (Some(f), Space::Vertex) => t.per_row[f] += w,
                (Some(f), Space::Edge) => t.per_edge[f] += w,
                (None, Space::Vertex) => t.per_head_row += w,
                (None, Space::Edge) => {}
            }
        }
    }
    // the index arrays, function by function: tokens, edge offsets (one
    // more than the rows), edge parents, gathered children (a row per edge
    // or per vertex), child-gradient destinations, touched rows
    for (f, func) in model.functions.iter().enumerate() {
        let fwd = &func.forward;
        t.per_row[f] += 1 + u64::from(fwd.input_node(Source::Token).is_some());
        t.fixed += 1;
        t.per_edge[f] += 1;
        for node in &fwd.nodes {
            match node.kind {
                NodeKind::Input(Source::GatherAll) => t.per_edge[f] += 1,
                NodeKind::Input(Source::Gather(_)) => t.per_row[f] += 1,
                _ => {}
            }
        }
        for o in &func.backward.outputs {
            match o.role {
                Role::ChildGradAll => t.per_edge[f] += 1,
                Role::ChildGrad(_) => t.per_row[f] += 1,
                Role::ParamRowGrad(p) if prog.row_grad_params.contains(&p) => t.per_row[f] += 1,
                _ => {}
            }
        }
    }
    // the head's labels, the pushed rows it reads and where their
    // gradients go
    let labels = model.head.forward.input_node(Source::Label).is_some();
    t.per_head_row += 2 + u64::from(labels);
    let bytes = |floats: u64| floats * ELEMENT_BYTES;
    Ok(CostTerms {
        per_row: t.per_row.into_iter().map(bytes).collect(),
        per_edge: t.per_edge.into_iter().map(bytes).collect(),
        per_head_row: bytes(t.per_head_row),
        per_vertex: 0,
        per_any_edge: 0,
        fixed: bytes(t.fixed),
    })
}

/// Where each cached matrix of `prog` lives in the pool.
pub(super) fn matrix_slots(prog: &PersistentProgram) -> Result<Vec<MatrixSlots>> {
    prog.matrices
        .iter()
        .map(|m| {
            Ok(MatrixSlots {
                value: prog.params.value[m.param],
                first_moment: prog.params.first[m.param],
                second_moment: prog.params.second[m.param],
                gradient: prog.params.grad[m.param].ok_or_else(|| {
                    model_err(format!("cached parameter {} has no gradient slot", m.param))
                })?,
            })
        })
        .collect()
}

/// A graph as the scripts' estimate remembers it: its address and size.
type AskedGraph = (usize, usize);

/// The register plans the engine may build kernels for: each of `choices`'
/// first plan (the bridge kernel's is the first one's), once each.
fn plans(
    prog: &PersistentProgram,
    build: &VariantBuild,
    choices: &[VariantChoice],
) -> Vec<RegisterPlan> {
    let mut plans: Vec<RegisterPlan> = Vec::new();
    for choice in choices {
        let Ok(p) = plan(&prog.matrices, &build.limits, &choice.request()) else {
            continue;
        };
        let key = |p: &RegisterPlan| (p.rpw, p.ctas_per_sm, p.grads_in_registers);
        if !plans.iter().any(|q| key(q) == key(&p)) {
            plans.push(p);
        }
    }
    plans
}

/// What the engine will allocate in its pool for `model` (its program
/// `prog`), building kernels for `choices` with `build`'s options: the
/// parameter region and the kernels' tables, a batch's regions per row
/// ([`layout_terms`]), and, measured by scheduling a batch for every plan,
/// the script buffers of the batches in flight and the barrier counters.
pub(super) fn need(
    model: &Model,
    prog: &Arc<PersistentProgram>,
    build: &VariantBuild,
    choices: &[VariantChoice],
    host_items: usize,
) -> Result<DeviceNeed> {
    let plans = plans(prog, build, choices);
    let mut tables = 0u64;
    // every variant built stays; the bridge is a variant of the first plan
    for p in plans.iter().chain(plans.first()) {
        let [parts, mats] = kernel_tables(p, &build.slots)?;
        tables += block_bytes(parts.len()) + block_bytes(mats.len());
    }
    let mut terms = layout_terms(model, prog)?;
    // the batch's regions share the parameters' block: its alignment
    terms.fixed += crate::ALIGNMENT;
    let schedulers: Vec<(Arc<Scheduler>, bool)> = plans
        .iter()
        .map(|p| (Arc::new(variant_scheduler(p, build)), p.grads_in_registers))
        .collect();
    let traced = build.trace.is_some();
    let params_total = prog.params.total;
    let (model_copy, prog) = (model.clone(), Arc::clone(prog));
    let slots = slots_in_flight() as u64;
    // a check asks again for the same batch once the device is open: the
    // last batch asked (its graphs' addresses and sizes) and its bytes
    let last: Mutex<Option<(Vec<AskedGraph>, u64)>> = Mutex::new(None);
    let scripts: BatchExtra = Arc::new(move |graphs: &[&InputGraph]| {
        let key: Vec<AskedGraph> = graphs
            .iter()
            .map(|g| (std::ptr::from_ref(*g) as usize, g.len()))
            .collect();
        let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, bytes)) = last.as_ref().filter(|(k, _)| *k == key) {
            return Ok(*bytes);
        }
        let schedule = schedule_graphs(&model_copy, graphs).map_err(|e| e.to_string())?;
        // each plan's scripts for the batch, in parallel: words, barriers
        let sizes = schedulers
            .par_iter()
            .map(|(scheduler, in_registers)| {
                // the dropout masks' values do not change any size
                let mut rng = ChaCha8Rng::seed_from_u64(0);
                let (vpps, in_registers) = (scheduler.vpps, *in_registers);
                let mut batch = unroll_batch(
                    &model_copy,
                    &prog,
                    &schedule,
                    in_registers,
                    vpps,
                    host_items,
                    &mut rng,
                )?;
                let lowering = Lowering {
                    grads_in_registers: in_registers,
                    defer_updates: false,
                };
                let (launches, updates) = schedule_batch(scheduler, &mut batch, lowering)?;
                let traced_ctas = traced.then_some(vpps);
                Ok((
                    script_words(&launches, updates.as_ref()),
                    barrier_words(&launches, updates.as_ref(), traced_ctas),
                ))
            })
            .collect::<Result<Vec<(usize, usize)>>>()
            .map_err(|e| e.to_string())?;
        let words = sizes.iter().map(|s| s.0).max().unwrap_or(0);
        let barriers = sizes.iter().map(|s| s.1).max().unwrap_or(0);
        // the counters grow (a new buffer before the old one goes) from
        // their first size
        let bytes = slots * block_bytes(script_buffer_words(words))
            + block_bytes(INITIAL_BARRIERS)
            + block_bytes(barriers.next_power_of_two());
        *last = Some((key, bytes));
        Ok(bytes)
    });
    Ok(DeviceNeed {
        engine: "cuda-persistent",
        parts: vec![
            (
                "parameters, gradients and optimizer moments",
                block_bytes(params_total),
            ),
            ("kernel tables", tables),
        ],
        train: Some(ActivationCost::from_terms(model, Pass::Train, terms)),
        eval: None,
        train_kept: false,
        train_extra: Some(scripts),
        eval_extra: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ramus_graph::random::random_tree;
    use ramus_graph::sequence::{pyramid, tagger_graph, WordInput};
    use ramus_nn::sequence_models::{build_sequence_model, SequenceConfig};
    use ramus_nn::{build_model_with, ModelConfig, ModelOptions};
    use rand::Rng;

    const VOCAB: u32 = 40;

    /// Makes an input of about `n` words for a model.
    type Maker = fn(&mut ChaCha8Rng, usize) -> InputGraph;

    /// The persistent engine's models at `hidden` units (dropout on, so
    /// that masks are uploaded), each with a maker of its inputs.
    fn models(hidden: usize) -> Vec<(Model, Maker)> {
        let cfg = ModelConfig {
            vocab: VOCAB as usize,
            hidden,
            classes: 5,
        };
        let opts = ModelOptions { dropout: 0.1 };
        let seq = SequenceConfig {
            mlp: 12,
            ..SequenceConfig::default()
        };
        let tree: Maker = |rng, n| random_tree(rng, n, &[2], VOCAB, 5).unwrap();
        let pyramid_of: Maker = |rng, n| {
            let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..VOCAB)).collect();
            pyramid(&tokens, 2).unwrap()
        };
        let sentence: Maker = |rng, n| {
            let words: Vec<WordInput<'_>> = (0..n)
                .map(|_| WordInput::Token(rng.random_range(0..VOCAB)))
                .collect();
            let tags: Vec<i32> = (0..n).map(|_| rng.random_range(0..5)).collect();
            tagger_graph(&words, &tags).unwrap()
        };
        let mut out = Vec::new();
        for name in ["treelstm", "treegru", "treefc"] {
            out.push((build_model_with(name, &cfg, &opts).unwrap(), tree));
        }
        for (name, make) in [
            ("rvnn", tree),
            ("td-rnn", pyramid_of),
            ("bilstm-tagger", sentence),
        ] {
            out.push((build_sequence_model(name, &cfg, &seq, &opts).unwrap(), make));
        }
        out
    }

    #[test]
    fn the_layout_terms_bound_the_batch_regions_the_lowering_allocates() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for hidden in [8, 33] {
            for (model, make) in models(hidden) {
                let prog = PersistentProgram::build(&model).unwrap();
                let terms = layout_terms(&model, &prog).unwrap();
                let cost = ActivationCost::from_terms(&model, Pass::Train, terms);
                for size in [1, 3, 12] {
                    let graphs: Vec<InputGraph> = (0..size)
                        .map(|_| {
                            let n = rng.random_range(1..12);
                            make(&mut rng, n)
                        })
                        .collect();
                    let refs: Vec<&InputGraph> = graphs.iter().collect();
                    let schedule = schedule_graphs(&model, &refs).unwrap();
                    let mut masks = ChaCha8Rng::seed_from_u64(1);
                    let batch =
                        unroll_batch(&model, &prog, &schedule, true, 6, usize::MAX, &mut masks)
                            .unwrap();
                    let actual = ELEMENT_BYTES * (batch.end - prog.params.total) as u64;
                    let counted = cost.graph_costs(&model, &graphs).largest_batch(size);
                    let what = format!("{} h{hidden}, {size} graphs", model.name);
                    assert!(counted >= actual, "{what}: {counted} < {actual}");
                    // the slack: a float a buffer, and the touched rows
                    assert!(
                        counted - actual <= actual / 100 + 1024,
                        "{what}: {counted} for {actual}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_scripts_counted_hold_what_every_plan_schedules_for_the_batch() {
        use ramus_codegen::persistent::UpdateRule;
        use ramus_core::vpps::DeviceLimits;
        use ramus_core::vpps::WIDE_PRODUCT_ITEMS;
        let (model, make) = models(24).remove(0);
        let prog = Arc::new(PersistentProgram::build(&model).unwrap());
        let build = VariantBuild {
            limits: DeviceLimits::hopper(132),
            ctas_per_sm: None,
            grads_in_registers: None,
            rule: UpdateRule::Adam,
            slots: matrix_slots(&prog).unwrap(),
            choice_file: None,
            trace: None,
            wide_items: WIDE_PRODUCT_ITEMS,
            vector_epilogue: true,
        };
        let choices = VariantChoice::candidates(&prog, &build);
        let host_items = super::super::options::HOST_PRODUCT_ITEMS;
        let need = need(&model, &prog, &build, &choices, host_items).unwrap();
        assert_eq!(need.parts[0].1, block_bytes(prog.params.total));
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let graphs: Vec<InputGraph> = (0..16).map(|_| make(&mut rng, 20)).collect();
        let refs: Vec<&InputGraph> = graphs.iter().collect();
        let extra = need.train_extra.as_ref().unwrap()(&refs).unwrap();
        // each plan's scripts for the batch, counted word by word
        let schedule = schedule_graphs(&model, &refs).unwrap();
        let mut most = 0;
        for choice in &choices {
            let p = plan(&prog.matrices, &build.limits, &choice.request()).unwrap();
            let scheduler = variant_scheduler(&p, &build);
            let mut masks = ChaCha8Rng::seed_from_u64(5);
            let in_registers = p.grads_in_registers;
            let batch = unroll_batch(
                &model,
                &prog,
                &schedule,
                in_registers,
                scheduler.vpps,
                host_items,
                &mut masks,
            )
            .unwrap();
            let mut words = 0;
            for launch in split_launches(batch.graph).unwrap() {
                if !launch.graph.is_empty() {
                    words += scheduler
                        .schedule(&launch.graph)
                        .unwrap()
                        .packed
                        .words
                        .len();
                }
            }
            if !in_registers {
                words += scheduler
                    .schedule(&batch.matrix_updates)
                    .unwrap()
                    .packed
                    .words
                    .len();
            }
            most = most.max(words);
        }
        let slots = slots_in_flight() as u64;
        assert!(extra >= slots * 4 * most as u64, "{extra} for {most} words");
        // powers of two at most double them; the barriers are a few KiB
        assert!(
            extra <= slots * 8 * most as u64 + (64 << 10),
            "{extra} for {most} words"
        );
    }

    #[test]
    fn the_buffers_start_at_the_checked_batch_and_grow_by_powers_of_two() {
        assert_eq!(buffer_floats(100, 0), 100 + BATCH_HEADROOM);
        assert_eq!(buffer_floats(100, 4000), 1100);
        assert_eq!(buffer_floats(100, 4001), 1101);
        assert_eq!(grown_buffer_floats(1100), 2048);
        assert_eq!(script_buffer_words(1025), 2048);
    }
}
