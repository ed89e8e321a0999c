//! Property tests of the persistent engine's host side (`ramus_core::vpps`):
//! script encoding round trips, the round-robin register plan (VPPS Fig. 4),
//! and level schedules of random task DAGs checked by running the packed
//! scripts in the CPU simulator under random and adversarial interleavings.

use std::collections::BTreeSet;

use proptest::prelude::*;
use proptest::test_runner::Config;
use ramus_core::vpps::regplan::{plan, valid_rpws, TABLE_WORDS};
use ramus_core::vpps::script::{decode, Instr, MAX_OPERANDS};
use ramus_core::vpps::simulate_with;
use ramus_core::vpps::{
    BatchScripts, DeviceLimits, MatrixSpec, Placement, PlanRequest, RegisterPlan, Scheduler,
    Simulation, VppTask, VppTaskGraph, WARPS_PER_CTA,
};
use ramus_core::CoreError;

fn matrices_strategy() -> impl Strategy<Value = Vec<MatrixSpec>> {
    prop::collection::vec((1usize..300, 1usize..400), 1..8).prop_map(|dims| {
        dims.into_iter()
            .enumerate()
            .map(|(i, (rows, cols))| MatrixSpec {
                param: 100 + i,
                rows,
                cols,
            })
            .collect()
    })
}

/// Checks the Fig. 4 layout of `p` against the formula, independently of how
/// `plan` built it.
fn check_round_robin(p: &RegisterPlan) {
    let rows_per_piece = WARPS_PER_CTA * p.rpw;
    // Every row is held exactly once, by one warp.
    let mut held: Vec<Vec<u32>> = p.matrices.iter().map(|m| vec![0; m.rows]).collect();
    for piece in &p.pieces {
        assert!(piece.rows >= 1 && piece.rows <= rows_per_piece, "{piece:?}");
        assert!(piece.partition < p.partitions, "{piece:?}");
        assert_eq!(p.piece_at(piece.cta, piece.partition), Some(piece));
        for w in 0..WARPS_PER_CTA {
            for r in piece.warp_rows(w, p.rpw) {
                held[piece.matrix][r] += 1;
            }
        }
    }
    assert!(held.iter().flatten().all(|&c| c == 1), "rows held {held:?}");
    // The formula: piece i = (rows before in order) / rows_per_piece goes to
    // CTA i % ctas, partition i / ctas; warp (r mod piece rows) / rpw.
    let mut base = 0;
    for (m, spec) in p.matrices.iter().enumerate() {
        for r in 0..spec.rows {
            let i = base + r / rows_per_piece;
            let (cta, partition) = (i % p.ctas, i / p.ctas);
            let warp = (r % rows_per_piece) / p.rpw;
            let piece = p.piece_at(cta, partition).expect("piece present");
            assert_eq!(piece.matrix, m);
            assert!(piece.warp_rows(warp, p.rpw).contains(&r), "row {r} of {m}");
        }
        base += spec.rows.div_ceil(rows_per_piece);
    }
    assert_eq!(base, p.pieces.len());
    // Balance: CTA piece counts differ by at most one.
    let mut per_cta = vec![0usize; p.ctas];
    for piece in &p.pieces {
        per_cta[piece.cta] += 1;
    }
    let (lo, hi) = (per_cta.iter().min(), per_cta.iter().max());
    assert!(hi.zip(lo).is_some_and(|(h, l)| h - l <= 1), "{per_cta:?}");
    assert_eq!(p.partitions, p.pieces.len().div_ceil(p.ctas));
    assert!(p.weight_regs_per_thread() + p.grad_regs_per_thread() <= p.available_regs_per_thread);
    // The device table agrees with piece_at.
    let table = p.table();
    assert_eq!(table.len(), p.ctas * p.partitions * TABLE_WORDS);
    for cta in 0..p.ctas {
        for part in 0..p.partitions {
            let at = (cta * p.partitions + part) * TABLE_WORDS;
            let want = p
                .piece_at(cta, part)
                .map_or([u32::MAX, 0], |q| [q.matrix as u32, q.first_row as u32]);
            assert_eq!(&table[at..at + TABLE_WORDS], &want[..]);
        }
    }
    // Shares add up; holders are the CTAs with a share.
    for (m, spec) in p.matrices.iter().enumerate() {
        let shares: Vec<usize> = (0..p.ctas).map(|c| p.load_share(m, c)).collect();
        assert_eq!(shares.iter().sum::<usize>(), spec.rows);
        let holders: Vec<u32> = (0..p.ctas as u32)
            .filter(|&c| shares[c as usize] > 0)
            .collect();
        assert_eq!(p.holders(m), holders);
    }
}

/// The options `plan` tries when it chooses, in preference order.
const OPTIONS: [(usize, bool); 4] = [(2, true), (1, true), (2, false), (1, false)];

fn forced(rpw: usize, (ctas_per_sm, grads): (usize, bool)) -> PlanRequest {
    PlanRequest {
        rpw,
        ctas_per_sm: Some(ctas_per_sm),
        grads_in_registers: Some(grads),
    }
}

/// One generated task before it is tied to a graph: dependency seeds,
/// placement kind, matrix seed, opcode offset, arg, load, operand count.
type RawTask = (Vec<u32>, u8, u16, u8, u16, u64, u8);

fn raw_tasks(max: usize) -> impl Strategy<Value = Vec<RawTask>> {
    prop::collection::vec(
        (
            prop::collection::vec(any::<u32>(), 0..4),
            0u8..10,
            any::<u16>(),
            0u8..3,
            0u16..2,
            0u64..50,
            0u8..4,
        ),
        0..max,
    )
}

/// Builds a DAG from raw tasks. `Holders` tasks take `1 + op offset` operands
/// so that tasks merged by `(op, arg, matrix)` agree on their width; every
/// operand is unique so that mix-ups show in the simulator.
fn build_graph(raw: &[RawTask], matrices: usize, any_only: bool) -> VppTaskGraph {
    let mut g = VppTaskGraph::new();
    for (i, (dep_seeds, kind, mseed, op_off, arg, load, nops)) in raw.iter().enumerate() {
        let mut deps: Vec<u32> = if i == 0 {
            Vec::new()
        } else {
            dep_seeds.iter().map(|s| s % i as u32).collect()
        };
        deps.sort_unstable();
        deps.dedup();
        let placement = match kind {
            _ if any_only || matrices == 0 => Placement::Any,
            0..=5 => Placement::Any,
            6..=8 => Placement::Holders {
                matrix: mseed % matrices as u16,
            },
            _ => Placement::Every,
        };
        let width = match placement {
            Placement::Holders { .. } => 1 + usize::from(*op_off),
            _ => usize::from(*nops),
        };
        let operands = (0..width as u32).map(|j| i as u32 * 16 + j).collect();
        let task = VppTask {
            op: 16 + op_off,
            arg: *arg,
            operands,
            deps,
            load: *load,
            placement,
        };
        g.push(task).expect("valid task");
    }
    g
}

/// A chooser that replays `choices` cyclically.
fn replay(choices: &[usize]) -> impl FnMut(&[u32]) -> usize + '_ {
    let mut at = 0;
    move |_runnable: &[u32]| {
        let c = choices.get(at % choices.len().max(1)).copied().unwrap_or(0);
        at += 1;
        c
    }
}

/// Checks properties (a)–(d) of a simulated run against the graph itself:
/// placements, dependency order and barrier counts.
fn check_run(
    g: &VppTaskGraph,
    s: &BatchScripts,
    sim: &Simulation,
    holders: &[Vec<u32>],
    vpps: usize,
) {
    let n = g.tasks.len();
    let mut ran_on: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); n];
    let mut first = vec![usize::MAX; n];
    let mut last = vec![0usize; n];
    for (step, &(v, t)) in sim.executions.iter().enumerate() {
        let t = t as usize;
        assert!(ran_on[t].insert(v), "task {t} ran twice on vpp {v}");
        first[t] = first[t].min(step);
        last[t] = last[t].max(step);
    }
    // which tasks a task other than a sink (one depending on every task
    // before it, past the first two) waits for
    let mut waited = vec![false; n];
    for (i, task) in g.tasks.iter().enumerate() {
        if i < 2 || task.deps.len() != i {
            for &d in &task.deps {
                waited[d as usize] = true;
            }
        }
    }
    for (t, task) in g.tasks.iter().enumerate() {
        // (b) exactly the VPPs the placement says.
        match task.placement {
            Placement::Any => assert_eq!(ran_on[t].len(), 1, "task {t}"),
            Placement::Holders { matrix } => {
                let want: BTreeSet<u32> = holders[usize::from(matrix)].iter().copied().collect();
                assert_eq!(ran_on[t], want, "task {t}");
            }
            Placement::Every => assert_eq!(ran_on[t].len(), vpps, "task {t}"),
        }
        let scheduled: BTreeSet<u32> = s.task_vpps[t].iter().copied().collect();
        assert_eq!(ran_on[t], scheduled, "task {t}");
        // (c) after every execution of every dependency.
        for &d in &task.deps {
            assert!(last[d as usize] < first[t], "task {t} before dep {d}");
        }
        // Levels are longest dependency chains, except that an `Any` task
        // whose latest dependencies all ran on its own VPP may run in their
        // level, after them (chaining).
        let latest = task.deps.iter().map(|&d| s.task_levels[d as usize]).max();
        let chained = latest.is_some_and(|l| {
            s.task_levels[t] == l
                && task.placement == Placement::Any
                && task
                    .deps
                    .iter()
                    .filter(|&&d| s.task_levels[d as usize] == l)
                    .all(|&d| s.task_vpps[d as usize] == s.task_vpps[t])
        });
        // A task only sinks wait for (not one on every VPP) may be
        // deferred to a later level.
        let deferred = task.placement != Placement::Every && !waited[t];
        if deferred && !chained {
            assert!(s.task_levels[t] >= latest.map_or(0, |l| l + 1), "task {t}");
        } else if !chained {
            assert_eq!(s.task_levels[t], latest.map_or(0, |l| l + 1), "task {t}");
        }
    }
    assert_eq!(sim.order.len(), n);
    // (d) barrier counts meet their expectations exactly.
    assert_eq!(sim.barrier_counts, s.packed.barrier_expects());
    assert_eq!(s.packed.barriers, s.levels.saturating_sub(1));
    assert!(s.packed.barrier_expects().iter().all(|&e| e >= 1));
}

proptest! {
    #![proptest_config(Config { cases: 128, ..Config::default() })]

    #[test]
    fn encode_decode_round_trip(
        raw in prop::collection::vec((any::<u8>(), any::<u16>(), prop::collection::vec(any::<u32>(), 0..20)), 0..20)
    ) {
        let instrs: Vec<Instr> = raw
            .into_iter()
            .map(|(op, arg, operands)| {
                if op == 1 || op == 2 { Instr::new(op, arg, Vec::new()) } else { Instr::new(op, arg, operands) }
            })
            .collect();
        let mut words = Vec::new();
        for i in &instrs {
            i.encode(&mut words).unwrap();
        }
        prop_assert_eq!(decode(&words).unwrap(), instrs);
    }

    #[test]
    fn decode_never_panics_and_reencodes(words in prop::collection::vec(any::<u32>(), 0..40)) {
        if let Ok(instrs) = decode(&words) {
            let mut again = Vec::new();
            for i in &instrs {
                prop_assert!(i.operands.len() <= MAX_OPERANDS);
                i.encode(&mut again).unwrap();
            }
            prop_assert_eq!(again, words);
        }
    }

    #[test]
    fn plans_are_round_robin(m in matrices_strategy(), sms in 1usize..6, rpw in 1usize..5) {
        let limits = DeviceLimits::hopper(sms);
        match plan(&m, &limits, &PlanRequest::new(rpw)) {
            Ok(p) => {
                check_round_robin(&p);
                // The first fitting option in preference order was taken.
                let chosen = OPTIONS.iter().position(|&o| o == (p.ctas_per_sm, p.grads_in_registers));
                let chosen = chosen.expect("a known option");
                for &o in &OPTIONS[..chosen] {
                    prop_assert!(plan(&m, &limits, &forced(rpw, o)).is_err());
                }
                let again = plan(&m, &limits, &forced(rpw, OPTIONS[chosen])).unwrap();
                prop_assert_eq!(again, p);
            }
            Err(e) => {
                prop_assert!(matches!(e, CoreError::NotOnChip { .. }), "{}", e);
                for o in OPTIONS {
                    prop_assert!(plan(&m, &limits, &forced(rpw, o)).is_err());
                }
            }
        }
    }

    #[test]
    fn valid_rpws_are_exactly_the_fitting_ones(m in matrices_strategy(), sms in 1usize..4) {
        let limits = DeviceLimits::hopper(sms);
        let rpws = valid_rpws(&m, &limits);
        let brute: Vec<usize> = (1..=200)
            .filter(|&r| plan(&m, &limits, &PlanRequest::new(r)).is_ok())
            .collect();
        prop_assert_eq!(rpws, brute);
    }

    #[test]
    fn random_dags_schedule_and_simulate(
        m in prop::collection::vec((1usize..120, 1usize..100), 1..4),
        sms in 1usize..4,
        rpw in 1usize..3,
        raw in raw_tasks(60),
        choices in prop::collection::vec(0usize..64, 1..32),
        factor in 0u64..6,
    ) {
        let matrices: Vec<MatrixSpec> = m
            .iter()
            .enumerate()
            .map(|(i, &(rows, cols))| MatrixSpec { param: i, rows, cols })
            .collect();
        let p = plan(&matrices, &DeviceLimits::hopper(sms), &PlanRequest::new(rpw)).unwrap();
        let mut scheduler = Scheduler::new(&p);
        scheduler.matrix_load_factor = factor;
        let g = build_graph(&raw, matrices.len(), false);
        let s = scheduler.schedule(&g).unwrap();
        for v in 0..s.packed.vpps {
            prop_assert!(s.packed.decode_script(v).is_ok());
        }
        // (a) no deadlock under random and adversarial interleavings.
        let runs = [
            simulate_with(&s, &g, replay(&choices)),
            simulate_with(&s, &g, |_| 0),
            simulate_with(&s, &g, |r| r.len() - 1),
        ];
        for run in runs {
            let sim = run.unwrap();
            check_run(&g, &s, &sim, &scheduler.holders, p.ctas);
        }
        prop_assert_eq!(ramus_core::vpps::simulate(&s, &g).unwrap().len(), g.tasks.len());
    }

    #[test]
    fn greedy_balance_for_any_tasks(
        vpps in 1usize..12,
        raw in raw_tasks(80),
        choices in prop::collection::vec(0usize..64, 1..8),
    ) {
        let g = build_graph(&raw, 0, true);
        // greedy placement only: chaining places by dependency, not load
        let mut scheduler = Scheduler::with_vpps(vpps);
        scheduler.chain = false;
        scheduler.balance_per_level = false;
        let s = scheduler.schedule(&g).unwrap();
        // (e) max load - min load <= max task load.
        let max_task = g.tasks.iter().map(|t| t.load).max().unwrap_or(0);
        let hi = s.loads.iter().copied().max().unwrap_or(0);
        let lo = s.loads.iter().copied().min().unwrap_or(0);
        prop_assert!(hi - lo <= max_task, "loads {:?}, max task {}", s.loads, max_task);
        prop_assert_eq!(s.loads.iter().sum::<u64>(), g.tasks.iter().map(|t| t.load).sum::<u64>());
        let sim = simulate_with(&s, &g, replay(&choices)).unwrap();
        check_run(&g, &s, &sim, &[], vpps);
    }

    #[test]
    fn greedy_balance_per_level(vpps in 1usize..12, raw in raw_tasks(80)) {
        let g = build_graph(&raw, 0, true);
        let mut scheduler = Scheduler::with_vpps(vpps);
        scheduler.chain = false;
        let s = scheduler.schedule(&g).unwrap();
        // (e') within every level, max load - min load <= max task load of
        // the level's `Any` tasks (`Every` tasks add the same everywhere)
        let mut per_level = vec![vec![0u64; vpps]; s.levels];
        let mut max_task = vec![0u64; s.levels];
        for (t, task) in g.tasks.iter().enumerate() {
            let l = s.task_levels[t] as usize;
            if task.placement == Placement::Any {
                per_level[l][s.task_vpps[t][0] as usize] += task.load;
                max_task[l] = max_task[l].max(task.load);
            }
        }
        for (l, loads) in per_level.iter().enumerate() {
            let hi = loads.iter().copied().max().unwrap_or(0);
            let lo = loads.iter().copied().min().unwrap_or(0);
            prop_assert!(hi - lo <= max_task[l], "level {} loads {:?}", l, loads);
        }
        let sim = simulate_with(&s, &g, |_| 0).unwrap();
        check_run(&g, &s, &sim, &[], vpps);
    }
}

#[test]
fn merged_holder_tasks_with_unequal_widths_are_rejected() {
    let matrices = [MatrixSpec {
        param: 3,
        rows: 64,
        cols: 64,
    }];
    let p = plan(&matrices, &DeviceLimits::hopper(2), &PlanRequest::new(1)).unwrap();
    let mut g = VppTaskGraph::new();
    for width in [2u32, 3] {
        g.push(VppTask {
            op: 20,
            arg: 1,
            operands: (0..width).collect(),
            deps: vec![],
            load: 1,
            placement: Placement::Holders { matrix: 0 },
        })
        .unwrap();
    }
    let err = Scheduler::new(&p).schedule(&g).unwrap_err().to_string();
    assert!(err.contains("tasks 0 and 1"), "{err}");
}
