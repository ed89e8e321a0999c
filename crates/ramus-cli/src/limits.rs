//! Sizes that cannot fit are refused before anything large is allocated.
//! Each command adds up what it is about to allocate — the model state
//! and the activations of its largest batch, computed from the model
//! ([`ramus_exec::memory`] documents how and what it leaves out) — and
//! compares it with the host memory available (`MemAvailable` in
//! `/proc/meminfo` on Linux, or `--host-memory-budget`; unchecked on other
//! systems) and, on CUDA, with what the device engine can still take. A
//! run that cannot fit is an error naming what to change: `--hidden` (or
//! the label or `--classes` behind a huge class count) when the model
//! alone is too large, the `file:line` of an input too large even alone,
//! else `--batch-size` with the largest that fits. Inputs built from a
//! line superlinearly (the time-delay pyramids) are checked before they
//! are built, by a [`BuildGuard`] the readers consult.

use ramus_core::Model;
use ramus_exec::memory::{
    largest_param, packed_weight_bytes, param_bytes, token_table_bytes, training_state,
    ActivationCost, BatchExtra, DeviceNeed, DeviceRoom, Fitted, GraphCosts, Pass,
};
use ramus_exec::{OptimizerKind, TrainEngine};
use ramus_graph::sequence::{pyramid_shape, pyramid_shape_of_tree};
use ramus_graph::{GraphShape, InputGraph};
use ramus_swap::human_bytes;

use crate::data::Splits;
use crate::device::Device;

/// `--host-memory-budget`, shared by the commands that allocate.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct HostBudgetArgs {
    /// Host memory a run may need, in bytes; a run estimated to need more
    /// is refused before it starts [default: MemAvailable from
    /// /proc/meminfo on Linux; unchecked elsewhere].
    #[arg(long)]
    pub host_memory_budget: Option<u64>,
}

/// A memory limit and where it comes from.
struct Limit {
    /// `host memory` or `device memory`, which errors start with.
    memory: &'static str,
    bytes: u64,
    /// How messages name it, e.g. `the 12.00 GiB of host memory available (MemAvailable)`.
    name: String,
}

impl HostBudgetArgs {
    /// The host limit: the flag, else `MemAvailable` (Linux), else none.
    fn limit(self) -> Option<Limit> {
        match self.host_memory_budget {
            Some(b) => Some(Limit {
                memory: "host memory",
                bytes: b,
                name: format!(
                    "the host memory budget of {} (--host-memory-budget)",
                    human_bytes(b)
                ),
            }),
            None => mem_available().map(|b| Limit {
                memory: "host memory",
                bytes: b,
                name: format!(
                    "the {} of host memory available (MemAvailable)",
                    human_bytes(b)
                ),
            }),
        }
    }
}

/// The activations of `pass` the host holds: all of them on the CPU; on
/// CUDA the schedule and the scores brought back.
fn host_cost(model: &Model, pass: Pass, device: Device) -> ActivationCost {
    match device {
        Device::Cpu => ActivationCost::new(model, pass),
        Device::Cuda => ActivationCost::host_side(model, pass),
    }
}

/// Refuses graphs whose size follows from their input before they are
/// built. A time-delay pyramid's size follows from its sentence's word
/// count ([`pyramid_shape_of_tree`]) and grows with its square, so one long
/// line would exhaust the memory while the data is read, before
/// [`Training`] or [`Inference`] could check it; `bench`'s synthetic grids
/// and perfect trees follow from flags. Graphs are refused when they and
/// the forward activations of a batch of them alone (the least any
/// command needs for them) exceed the limit, and pyramids when their graphs
/// together do.
pub struct BuildGuard<'a> {
    limit: Option<Limit>,
    /// What else to change, besides the input, for a larger limit.
    raise: &'static str,
    /// The model that reads the graphs and its forward costs on the host
    /// (none: the graphs alone are checked).
    reader: Option<(&'a Model, ActivationCost)>,
    /// Bytes of the graphs admitted so far, and how many.
    held: u64,
    admitted: u64,
}

impl HostBudgetArgs {
    /// The guard for graphs `reader` (a model and its device) will read;
    /// with no reader, the graphs alone are checked.
    pub fn build_guard(self, reader: Option<(&Model, Device)>) -> BuildGuard<'_> {
        BuildGuard {
            limit: self.limit(),
            raise: match self.host_memory_budget {
                Some(_) => "raise --host-memory-budget",
                None => "free host memory",
            },
            reader: reader.map(|(m, device)| (m, host_cost(m, Pass::Infer, device))),
            held: 0,
            admitted: 0,
        }
    }
}

impl BuildGuard<'_> {
    /// The bytes of `count` graphs of `shape` and of the forward
    /// activations of a batch of them alone.
    fn need(&self, shape: &GraphShape, count: u64) -> (u64, u64) {
        let run = self.reader.as_ref().map_or(0, |(m, cost)| {
            let each = cost.shape_bytes(m, shape);
            cost.fixed().saturating_add(each.saturating_mul(count))
        });
        (shape.input_bytes().saturating_mul(count), run)
    }

    /// `count` graphs of `shape` and a batch of them, when more than the
    /// limit: `(limit, graphs' bytes, batch's bytes, in all)`.
    fn over(&self, shape: &GraphShape, count: u64) -> Option<(&Limit, u64, u64, u64)> {
        let limit = self.limit.as_ref()?;
        let (graphs, run) = self.need(shape, count);
        let all = graphs.saturating_add(run);
        (all > limit.bytes).then_some((limit, graphs, run, all))
    }

    /// Counts `count` graphs of `shape` as built.
    fn hold(&mut self, shape: &GraphShape, count: u64) {
        let graphs = shape.input_bytes().saturating_mul(count);
        self.held = self.held.saturating_add(graphs);
        self.admitted = self.admitted.saturating_add(count);
    }

    /// Checks `count` graphs of `shape` that `what` (a flag and its
    /// value) is about to build, to run in one batch; an error names
    /// `what` and `change`, what to lower.
    pub fn admit(
        &mut self,
        what: &str,
        shape: &GraphShape,
        count: u64,
        change: &str,
    ) -> Result<(), String> {
        if let Some((limit, graphs, run, all)) = self.over(shape, count) {
            return Err(format!(
                "{}: {what}: {count} graph(s) of {} vertices and {} edges need at least {} \
                 ({} for the graphs, {} to run them in one batch), more than {}; {change}, or {}",
                limit.memory,
                shape.vertex_count(),
                shape.edge_count(),
                human_bytes(all),
                human_bytes(graphs),
                human_bytes(run),
                limit.name,
                self.raise
            ));
        }
        self.hold(shape, count);
        Ok(())
    }

    /// Checks the pyramid over `tree`'s leaves (graph `index` of its file)
    /// before it is built; an error names the tree's `file:line`, its word
    /// count and the longest sentence that fits.
    pub fn admit_pyramid(&mut self, tree: &InputGraph, index: usize) -> Result<(), String> {
        let (words, shape) = pyramid_shape_of_tree(tree);
        let labelled = shape.labelled > 0;
        if let Some((limit, graph, run, all)) = self.over(&shape, 1) {
            // the need grows with the word count: the longest that fits
            let (mut lo, mut hi) = (0u64, words);
            while lo + 1 < hi {
                let mid = lo + (hi - lo) / 2;
                match self.over(&pyramid_shape(mid, labelled), 1) {
                    None => lo = mid,
                    Some(_) => hi = mid,
                }
            }
            return Err(format!(
                "{}: {}: a sentence of {words} words makes a time-delay pyramid of {} vertices \
                 and {} edges, which alone needs at least {} ({} for the graph, {} to run \
                 it), more than {}; split the line into sentences of at most {lo} words, or {}",
                limit.memory,
                tree.describe(index),
                shape.vertex_count(),
                shape.edge_count(),
                human_bytes(all),
                human_bytes(graph),
                human_bytes(run),
                limit.name,
                self.raise
            ));
        }
        self.hold(&shape, 1);
        match &self.limit {
            Some(limit) if self.held > limit.bytes => Err(format!(
                "{}: {}: the time-delay pyramids of the {} sentences read up to this line take {}, \
                 more than {}; use shorter or fewer sentences, or {}",
                limit.memory,
                tree.describe(index),
                self.admitted,
                human_bytes(self.held),
                limit.name,
                self.raise
            )),
            _ => Ok(()),
        }
    }
}

/// `MemAvailable` of `/proc/meminfo` in bytes (`None` where there is none).
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => Some(n.saturating_mul(1024)),
        None => Some(n),
        Some(_) => None,
    }
}

/// A device's room as the limit messages name.
fn device_limit(room: DeviceRoom) -> Limit {
    let bytes = room.bytes();
    let name = match room.budget {
        Some(b) => format!(
            "the {} the device can still give within --device-memory-budget {b}",
            human_bytes(bytes)
        ),
        None => format!("the {} the device has free", human_bytes(bytes)),
    };
    Limit {
        memory: "device memory",
        bytes,
        name,
    }
}

/// The room of a CUDA run's batched `engine`, which is checked once it
/// exists (`None` on the CPU, and with a note where the engine does not
/// say).
fn batched_room(
    device: Device,
    engine: &dyn TrainEngine<f32>,
    budget: Option<u64>,
) -> Option<DeviceRoom> {
    if device != Device::Cuda {
        return None;
    }
    let Some(free) = engine.device_memory_room() else {
        device_unchecked("the engine does not report its device memory");
        return None;
    };
    Some(DeviceRoom { free, budget })
}

/// Says on stderr that a CUDA run's device memory is not checked ahead.
pub fn device_unchecked(why: &str) {
    eprintln!("note: device memory is not checked ahead ({why})");
}

/// The batches a command runs over one data set.
struct Batches<'a> {
    /// e.g. `training batches`.
    what: &'static str,
    graphs: &'a [InputGraph],
    costs: GraphCosts,
    batch_size: usize,
    /// The flag that sets the batch size, if any.
    flag: Option<&'static str>,
    /// Whether batches are shuffled (else taken in order).
    shuffled: bool,
    /// Bytes an earlier pass leaves allocated beside these batches.
    retained: u64,
}

impl<'a> Batches<'a> {
    fn new(
        what: &'static str,
        cost: &ActivationCost,
        model: &Model,
        graphs: &'a [InputGraph],
        batch_size: usize,
        flag: Option<&'static str>,
    ) -> Self {
        Batches {
            what,
            graphs,
            costs: cost.graph_costs(model, graphs),
            batch_size,
            flag,
            shuffled: false,
            retained: 0,
        }
    }

    /// The most one of these batches needs.
    fn largest(&self) -> u64 {
        let batch = if self.shuffled {
            self.costs.largest_batch(self.batch_size)
        } else {
            self.costs.largest_chunk(self.batch_size)
        };
        batch.saturating_add(self.retained)
    }
}

/// What a command is about to allocate in one memory.
struct Need<'a> {
    /// Model-sized parts, by name.
    parts: Vec<(&'static str, u64)>,
    batches: Vec<Batches<'a>>,
    /// What to change when the model alone does not fit.
    model_hint: String,
}

impl Need<'_> {
    /// An error naming what to change when this cannot fit in `limit`.
    fn check(&self, limit: Option<&Limit>) -> Result<(), String> {
        match limit {
            Some(limit) => self
                .fits(limit)
                .map_err(|e| format!("{}: {e}", limit.memory)),
            None => Ok(()),
        }
    }

    fn fits(&self, limit: &Limit) -> Result<(), String> {
        let state = self.parts.iter().fold(0u64, |s, p| s.saturating_add(p.1));
        let worst = self.batches.iter().max_by_key(|b| b.largest());
        let activations = worst.map_or(0, Batches::largest);
        if state.saturating_add(activations) <= limit.bytes {
            return Ok(());
        }
        // the model is to blame when it does not fit alone, or when not
        // even the smallest input fits beside it and the model is larger
        let smallest = self.batches.iter().filter_map(|b| b.costs.cheapest()).min();
        let smallest = smallest.unwrap_or(0);
        if state > limit.bytes
            || (state.saturating_add(smallest) > limit.bytes && state >= smallest)
        {
            let parts: Vec<String> = self
                .parts
                .iter()
                .filter(|p| p.1 > 0)
                .map(|(what, b)| format!("{what} {}", human_bytes(*b)))
                .collect();
            return Err(format!(
                "the model needs {} ({}), more than {}; {}",
                human_bytes(state),
                parts.join(" + "),
                limit.name,
                self.model_hint
            ));
        }
        let room = limit.bytes - state;
        let costliest = self
            .batches
            .iter()
            .filter_map(|b| b.costs.costliest().map(|(i, one)| (b, i, one)))
            .max_by_key(|&(_, _, one)| one);
        if let Some((b, i, one)) = costliest.filter(|&(_, _, one)| one > room) {
            let g = &b.graphs[i];
            return Err(format!(
                "{}: this input ({} vertices) alone needs {} for its activations, which with \
                 the model's {} is more than {}; shorten or split it, or remove it",
                g.describe(i),
                g.len(),
                human_bytes(one),
                human_bytes(state),
                limit.name
            ));
        }
        let Some(b) = worst else {
            return Ok(());
        };
        let needs = format!(
            "needs {} for its activations, which with the model's {} is more than {}",
            human_bytes(activations),
            human_bytes(state),
            limit.name
        );
        // an evaluation that fits but for the buffers training leaves:
        // the training batch size is what to lower
        let evaluated = b.largest() - b.retained;
        let flagged = self.batches.iter().find(|t| t.flag.is_some());
        let (b, room) = match flagged {
            Some(t) if b.flag.is_none() && evaluated <= room => {
                (t, (room - evaluated).saturating_sub(t.retained))
            }
            _ => (b, room.saturating_sub(b.retained)),
        };
        match (b.flag, b.costs.costliest()) {
            (Some(flag), _) => {
                let fit = b.costs.fitting_batch(b.batch_size, room);
                Err(format!(
                    "{flag} {}: the largest of the {} {needs}; at most {fit} input(s) a batch fit",
                    b.batch_size, b.what
                ))
            }
            // no flag sets this batch size: name the input that costs most
            (None, Some((i, _))) => Err(format!(
                "the largest of the {} ({} at a time) {needs}; the largest input is {}",
                b.what,
                b.batch_size,
                b.graphs[i].describe(i)
            )),
            (None, None) => Err(format!("the largest of the {} {needs}", b.what)),
        }
    }
}

/// Checks `run` — the batches a command gives a device engine, the first
/// of them its training batches if `trains` — against `limit`, with what
/// the engine's `need` adds: the largest training batch kept beside the
/// evaluation batches, and what the largest training and evaluation
/// batches need beyond their linear costs (measured on their costliest
/// graphs, once the rest fits). What fits, for the engine to size its
/// buffers.
fn fit(
    mut run: Need<'_>,
    need: &DeviceNeed,
    limit: &Limit,
    trains: bool,
) -> Result<Fitted, String> {
    let trained = usize::from(trains).min(run.batches.len());
    let largest_train = run.batches[..trained].iter().map(Batches::largest).sum();
    if need.train_kept {
        for e in &mut run.batches[trained..] {
            e.retained = largest_train;
        }
    }
    run.check(Some(limit))?;
    // what the costliest graphs of `batches` need beyond their costs
    let measure = |extra: &Option<BatchExtra>, batches: &[Batches]| -> Result<u64, String> {
        let Some(extra_of) = extra else {
            return Ok(0);
        };
        let mut most = 0;
        for b in batches {
            let costliest = b.costs.costliest_graphs(b.batch_size);
            let graphs: Vec<&InputGraph> = costliest.into_iter().map(|i| &b.graphs[i]).collect();
            if !graphs.is_empty() {
                most = most.max(extra_of(&graphs)?);
            }
        }
        Ok(most)
    };
    let (train, evals) = run.batches.split_at(trained);
    let (train_extra, eval_extra) = (
        measure(&need.train_extra, train)?,
        measure(&need.eval_extra, evals)?,
    );
    if train_extra + eval_extra > 0 {
        for (i, b) in run.batches.iter_mut().enumerate() {
            let extra = match i < trained {
                true => train_extra,
                false if need.train_kept => train_extra + eval_extra,
                false => eval_extra,
            };
            b.retained = b.retained.saturating_add(extra);
        }
        run.check(Some(limit))?;
    }
    let own = |b: &Batches| b.largest() - b.retained;
    let (train, evals) = run.batches.split_at(trained);
    Ok(Fitted {
        train_batch: train.iter().map(own).sum(),
        train_extra,
        eval_batch: evals.iter().map(own).max().unwrap_or(0),
        eval_extra,
    })
}

/// The hint for a model too large: its largest parameter, and the class
/// count (`classes`, from `class_source`) or `--hidden` behind it.
fn model_hint(model: &Model, hidden: usize, classes: Option<(usize, &str)>) -> String {
    let Some((p, bytes)) = largest_param(model) else {
        return "lower --hidden".into();
    };
    let spec = &model.params[p];
    let mut hint = format!(
        "its largest parameter is `{}` {:?} ({})",
        spec.name,
        spec.shape,
        human_bytes(bytes)
    );
    match classes {
        Some((k, from)) if k > hidden && spec.shape.contains(&k) => {
            hint += &format!(", a row per class: {k} classes come from {from}")
        }
        _ => hint += &format!(": lower --hidden (now {hidden})"),
    }
    hint
}

/// What `ramus train` is about to allocate; check the host with
/// [`Training::check_host`] before the parameters are made and the device
/// with [`Training::check_device`] once the engine exists.
pub struct Training<'a> {
    pub model: &'a Model,
    pub optimizer: OptimizerKind,
    pub data: &'a Splits,
    pub batch_size: usize,
    pub hidden: usize,
    /// Where the class count came from ([`crate::labels::source`]).
    pub class_source: Option<String>,
    pub device: Device,
}

/// Dev and test are evaluated in batches of this many during training.
const TRAIN_EVAL_BATCH: usize = 64;

impl Training<'_> {
    /// The need of training with `train`'s costs and evaluating with
    /// `eval`'s; with `retains`, the engine keeps the training pass's
    /// backward buffers while it evaluates (the CPU engine's arenas; the
    /// CUDA engine's batch arena starts over each batch).
    fn need(
        &self,
        train: &ActivationCost,
        eval: &ActivationCost,
        retains: bool,
        parts: Vec<(&'static str, u64)>,
    ) -> Need<'_> {
        let (m, d, b) = (self.model, self.data, self.batch_size);
        let training = Batches {
            shuffled: true,
            ..Batches::new(
                "training batches",
                train,
                m,
                &d.train,
                b,
                Some("--batch-size"),
            )
        };
        let retained = if retains {
            let forward = eval.graph_costs(m, &d.train).largest_batch(b);
            training.largest().saturating_sub(forward)
        } else {
            0
        };
        let evaluation = |what, graphs| Batches {
            retained,
            ..Batches::new(what, eval, m, graphs, TRAIN_EVAL_BATCH, None)
        };
        let classes = self.class_source.as_deref().map(|s| (d.classes, s));
        Need {
            parts,
            batches: vec![
                training,
                evaluation("dev batches training evaluates", &d.dev),
                evaluation("test batches training evaluates", &d.test),
            ],
            model_hint: model_hint(m, self.hidden, classes),
        }
    }

    /// Refuses a run whose host memory cannot hold the parameters, their
    /// gradients, the optimizer state, the best epoch's copy and (on the
    /// CPU) the activations of the largest batch.
    pub fn check_host(&self, budget: HostBudgetArgs) -> Result<(), String> {
        let limit = budget.limit();
        if limit.is_none() {
            return Ok(());
        }
        let m = self.model;
        // on CUDA the trainer keeps host gradients and optimizer state
        // beside the device's, and stages the parameters for upload
        let mut parts = training_state(m, self.optimizer);
        parts.push(match self.device {
            Device::Cpu => ("packed weights", packed_weight_bytes(m)),
            Device::Cuda => ("upload staging", param_bytes(m)),
        });
        let train = host_cost(m, Pass::Train, self.device);
        let eval = host_cost(m, Pass::Evaluate, self.device);
        parts.push(("best epoch's copy", param_bytes(m)));
        self.need(&train, &eval, self.device == Device::Cpu, parts)
            .check(limit.as_ref())
    }

    /// Refuses a CUDA run on the batched `engine` whose device cannot hold
    /// the parameters, their gradients, the optimizer state and the largest
    /// batch's activations (not checked with swapping, which trains past
    /// the budget).
    pub fn check_device(
        &self,
        engine: &dyn TrainEngine<f32>,
        budget: Option<u64>,
        swapping: bool,
    ) -> Result<(), String> {
        if swapping {
            return Ok(());
        }
        let Some(room) = batched_room(self.device, engine, budget) else {
            return Ok(());
        };
        let need = ramus_cuda::memory::batched_need(self.model, Some(self.optimizer), Pass::Train);
        self.fit_device(&need, room).map(|_| ())
    }

    /// Checks what a CUDA engine will allocate (`need`) for this run
    /// against `room`: its model-sized parts, the largest training batch
    /// and the dev and test batches training evaluates (see [`fit`]). The
    /// check the persistent engine runs before it allocates.
    pub fn fit_device(&self, need: &DeviceNeed, room: DeviceRoom) -> Result<Fitted, String> {
        let (m, d) = (self.model, self.data);
        let mut batches = Vec::new();
        if let Some(cost) = &need.train {
            let flag = Some("--batch-size");
            let training =
                Batches::new("training batches", cost, m, &d.train, self.batch_size, flag);
            batches.push(Batches {
                shuffled: true,
                ..training
            });
        }
        if let Some(cost) = &need.eval {
            for (what, graphs) in [
                ("dev batches training evaluates", &d.dev),
                ("test batches training evaluates", &d.test),
            ] {
                batches.push(Batches::new(what, cost, m, graphs, TRAIN_EVAL_BATCH, None));
            }
        }
        let classes = self.class_source.as_deref().map(|s| (d.classes, s));
        let run = Need {
            parts: need.parts.clone(),
            batches,
            model_hint: model_hint(m, self.hidden, classes),
        };
        fit(run, need, &device_limit(room), need.train.is_some())
    }
}

/// What `eval`, `infer` and `bench` are about to allocate for a model whose
/// parameters are (or are about to be) made.
pub struct Inference<'a> {
    pub model: &'a Model,
    pub graphs: &'a [InputGraph],
    pub batch_size: usize,
    /// The flag that sets the batch size.
    pub batch_flag: &'static str,
    pub pass: Pass,
    /// Model-sized host allocations still to come (parameters not yet
    /// made, per-token tables), by name.
    pub host_parts: Vec<(&'static str, u64)>,
    /// What to change when those do not fit.
    pub model_hint: String,
    pub device: Device,
}

impl<'a> Inference<'a> {
    /// For a model read from a checkpoint (parameters already in memory),
    /// with per-token tables for `tables` tokens if the engine builds them.
    pub fn loaded(
        model: &'a Model,
        graphs: &'a [InputGraph],
        batch_size: usize,
        pass: Pass,
        tables: Option<usize>,
        device: Device,
    ) -> Self {
        let host_parts = tables
            .filter(|_| device == Device::Cpu)
            .map(|v| vec![("per-token tables", token_table_bytes(model, v))])
            .unwrap_or_default();
        Inference {
            model,
            graphs,
            batch_size,
            batch_flag: "--batch-size",
            pass,
            host_parts,
            model_hint: match tables {
                Some(_) => "leave the per-token tables out with --no-tables".into(),
                None => "the checkpoint's model is too large".into(),
            },
            device,
        }
    }

    /// A bench's model, its parameters (and SGD's gradients) still to be
    /// made, with per-token tables for `vocab` tokens on the CPU.
    pub fn bench(
        model: &'a Model,
        graphs: &'a [InputGraph],
        batch_size: usize,
        pass: Pass,
        vocab: usize,
        hidden: usize,
        device: Device,
    ) -> Self {
        let p = param_bytes(model);
        let mut host_parts = vec![("parameters", p)];
        if pass == Pass::Train {
            host_parts.push(("gradients", p));
        }
        if device == Device::Cpu {
            host_parts.push(("per-token tables", token_table_bytes(model, vocab)));
        }
        Inference {
            model,
            graphs,
            batch_size,
            batch_flag: "--batch-sizes",
            pass,
            host_parts,
            model_hint: model_hint(model, hidden, None),
            device,
        }
    }

    fn need(&self, cost: &ActivationCost, parts: Vec<(&'static str, u64)>) -> Need<'_> {
        Need {
            parts,
            batches: vec![Batches::new(
                "batches",
                cost,
                self.model,
                self.graphs,
                self.batch_size,
                Some(self.batch_flag),
            )],
            model_hint: self.model_hint.clone(),
        }
    }

    /// Refuses a run whose host memory cannot hold what is still to be
    /// made and (on the CPU) the activations of the largest batch.
    pub fn check_host(&self, budget: HostBudgetArgs) -> Result<(), String> {
        let limit = budget.limit();
        if limit.is_none() {
            return Ok(());
        }
        let cost = host_cost(self.model, self.pass, self.device);
        self.need(&cost, self.host_parts.clone())
            .check(limit.as_ref())
    }

    /// Refuses a CUDA run on the batched `engine` whose device cannot hold
    /// the parameters (and their gradient buffer, which the engine
    /// allocates beside them) and the largest batch's activations.
    pub fn check_device(
        &self,
        engine: &dyn TrainEngine<f32>,
        budget: Option<u64>,
    ) -> Result<(), String> {
        let Some(room) = batched_room(self.device, engine, budget) else {
            return Ok(());
        };
        let need = ramus_cuda::memory::batched_need(self.model, None, self.pass);
        self.fit_device(&need, room).map(|_| ())
    }

    /// Checks what a CUDA engine will allocate (`need`) for these batches
    /// against `room` (see [`fit`]): its training batches where it trains
    /// (the persistent engine in `bench`), else its inference batches. The
    /// check the persistent and compiled engines run before they allocate.
    pub fn fit_device(&self, need: &DeviceNeed, room: DeviceRoom) -> Result<Fitted, String> {
        let cost = need.train.as_ref().or(need.eval.as_ref());
        let batches = cost
            .map(|c| {
                let flag = Some(self.batch_flag);
                Batches::new("batches", c, self.model, self.graphs, self.batch_size, flag)
            })
            .into_iter()
            .collect();
        let run = Need {
            parts: need.parts.clone(),
            batches,
            model_hint: self.model_hint.clone(),
        };
        fit(run, need, &device_limit(room), need.train.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use ramus_graph::Origin;
    use ramus_nn::{build_model, ModelConfig};

    fn model() -> Model {
        let cfg = ModelConfig {
            vocab: 50,
            hidden: 16,
            classes: 5,
        };
        build_model("treelstm", &cfg).unwrap()
    }

    /// Binary trees of `leaves[i]` leaves, line `i + 1` of `file`.
    fn trees(file: &str, leaves: &[usize]) -> Vec<InputGraph> {
        leaves
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let mut g = InputGraph::new();
                let mut level: Vec<u32> = (0..n)
                    .map(|t| g.push_vertex(&[], t as u32 % 50, 1).unwrap())
                    .collect();
                while level.len() > 1 {
                    level = level
                        .chunks(2)
                        .map(|pair| match pair {
                            [a, b] => g.push_vertex(&[*a, *b], 0, 2).unwrap(),
                            _ => pair[0],
                        })
                        .collect();
                }
                g.with_origin(Origin {
                    file: file.into(),
                    line: i + 1,
                })
            })
            .collect()
    }

    /// A need whose training batches the engine keeps while it evaluates,
    /// and whose measured extra is `extra` bytes; records how many graphs
    /// each measure was given and their vertices.
    fn kept_need(model: &Model, extra: u64) -> (DeviceNeed, Arc<Mutex<Vec<usize>>>) {
        let mut need =
            ramus_cuda::memory::batched_need(model, Some(OptimizerKind::Sgd), Pass::Train);
        need.train_kept = true;
        let asked = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&asked);
        need.train_extra = Some(Arc::new(move |graphs: &[&InputGraph]| {
            seen.lock().unwrap().extend(graphs.iter().map(|g| g.len()));
            Ok(extra)
        }));
        (need, asked)
    }

    #[test]
    fn a_device_engines_need_counts_its_kept_batch_and_what_it_measured() {
        let model = model();
        let data = Splits {
            source: "data".into(),
            train: trees("train.txt", &[3, 30, 5, 12, 40, 2]),
            dev: trees("dev.txt", &[7, 9]),
            test: trees("test.txt", &[4]),
            vocab: Default::default(),
            classes: 5,
            class_names: Vec::new(),
            image: None,
            tagged: None,
        };
        let run = Training {
            model: &model,
            optimizer: OptimizerKind::Sgd,
            data: &data,
            batch_size: 2,
            hidden: 16,
            class_source: None,
            device: Device::Cuda,
        };
        let (need, asked) = kept_need(&model, 1000);
        let (train, eval) = (need.train.as_ref().unwrap(), need.eval.as_ref().unwrap());
        let batch = train.graph_costs(&model, &data.train).largest_batch(2);
        let dev = eval.graph_costs(&model, &data.dev).largest_chunk(64);
        // the training batch (and what it needs beyond) stays beside the
        // evaluation batch
        let exact = need.parts_bytes() + batch + 1000 + dev;
        let room = |free| DeviceRoom { free, budget: None };
        let fitted = run.fit_device(&need, room(exact)).unwrap();
        assert_eq!(
            fitted,
            Fitted {
                train_batch: batch,
                train_extra: 1000,
                eval_batch: dev,
                eval_extra: 0,
            }
        );
        // measured on the two costliest training graphs
        let lens: Vec<usize> = [4, 1].iter().map(|&i| data.train[i].len()).collect();
        assert_eq!(&asked.lock().unwrap()[..2], &lens[..]);
        // a byte short: the evaluation batch does not fit beside the kept
        // training batch, whose size is what to lower
        let e = run.fit_device(&need, room(exact - 1)).unwrap_err();
        assert!(e.starts_with("device memory: --batch-size 2"), "{e}");
        assert!(e.contains("at most 1 input(s)"), "{e}");
        // the measure is asked only once the linear costs fit
        let before = asked.lock().unwrap().len();
        let alone = train
            .graph_costs(&model, &data.train)
            .costliest()
            .unwrap()
            .1;
        let e = run
            .fit_device(&need, room(need.parts_bytes() + alone - 1))
            .unwrap_err();
        assert_eq!(asked.lock().unwrap().len(), before, "{e}");
        assert!(
            e.contains("train.txt:5") && e.contains("alone needs"),
            "{e}"
        );
        let e = run.fit_device(&need, room(1000)).unwrap_err();
        assert!(
            e.contains("the model needs") && e.contains("--hidden"),
            "{e}"
        );
        // the budget is named
        let budget = DeviceRoom {
            free: u64::MAX,
            budget: Some(1000),
        };
        let e = run.fit_device(&need, budget).unwrap_err();
        assert!(e.contains("--device-memory-budget 1000"), "{e}");
    }

    #[test]
    fn reads_mem_available() {
        let text = "MemTotal:  100 kB\nMemAvailable:    2048 kB\nSwapTotal: 0 kB\n";
        assert_eq!(parse_mem_available(text), Some(2048 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: x kB\n"), None);
    }
}
