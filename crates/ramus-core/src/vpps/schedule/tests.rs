//! The scheduler's tests, with [`simulate`] as the oracle.

use super::*;
use crate::vpps::isa::OP_FIRST_ENGINE;
use crate::vpps::simulator::{simulate, simulate_with};
use crate::vpps::wide::{wide_tiles, wide_work};

fn task(op: u8, operands: &[u32], deps: &[u32], load: u64, placement: Placement) -> VppTask {
    VppTask {
        op,
        arg: 0,
        operands: operands.to_vec(),
        deps: deps.to_vec(),
        load,
        placement,
    }
}

/// Four VPPs; matrix 0 cached on all of them, matrix 1 on VPPs 1 and 2
/// (the setting of VPPS Fig. 6d).
fn fig6_scheduler() -> Scheduler {
    Scheduler {
        vpps: 4,
        holders: vec![vec![0, 1, 2, 3], vec![1, 2]],
        holder_rows: vec![vec![8; 4], vec![8; 2]],
        matrix_load_factor: 1,
        chain: false,
        defer_terminal: false,
        // the figure balances the batch's accumulated load
        balance_per_level: false,
        record: true,
        holder_item: 0,
        wide_items: None,
        matrix_shapes: Vec::new(),
    }
}

fn fig6_graph() -> VppTaskGraph {
    let h0 = Placement::Holders { matrix: 0 };
    let mut g = VppTaskGraph::new();
    g.push(task(20, &[100], &[], 5, Placement::Any)).unwrap();
    g.push(task(16, &[10, 11], &[], 4, h0)).unwrap();
    g.push(task(16, &[12, 13], &[], 4, h0)).unwrap();
    g.push(task(
        16,
        &[14, 15],
        &[],
        2,
        Placement::Holders { matrix: 1 },
    ))
    .unwrap();
    g.push(task(21, &[200], &[0, 1], 1, Placement::Any))
        .unwrap();
    g.push(task(30, &[], &[4], 1, Placement::Every)).unwrap();
    g
}

#[test]
fn wide_products_go_to_a_rotating_range_of_vpps_one_per_tile() {
    let mut scheduler = fig6_scheduler();
    scheduler.holder_item = 3;
    scheduler.wide_items = Some(3);
    // matrix 1: 128 rows, so a product has two row tiles (32 columns:
    // too shallow a reduction to split)
    scheduler.matrix_shapes = vec![(8, 8), (128, 32)];
    let h1 = Placement::Holders { matrix: 1 };
    let mut g = VppTaskGraph::new();
    // three items on matrix 1 (held by VPPs 1 and 2): wide, two tiles;
    // then two items on it a level later: narrow, on the holders
    g.push(task(OP_FIRST_ENGINE, &[1, 2, 3, 4, 5, 6], &[], 1, h1))
        .unwrap();
    g.push(task(OP_FIRST_ENGINE, &[7, 8, 9], &[], 1, h1))
        .unwrap();
    g.push(task(17, &[10, 11, 12, 13, 14, 15], &[0, 1], 1, h1))
        .unwrap();
    let s = scheduler.schedule(&g).unwrap();
    assert_eq!(wide_tiles(OP_FIRST_ENGINE, 128, 32, 3, 4), 2);
    let p = |op, len, arg| preamble(op, len, arg);
    let wide = [
        p(OP_FIRST_ENGINE, 12, 0),
        3 | INLINE_ITEMS | WIDE_ITEMS,
        2 << 16, // VPPs 0 and 1
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        9,
    ];
    let narrow = [p(17, 8, 0), 2 | INLINE_ITEMS, 10, 11, 12, 13, 14, 15];
    let (signal, wait) = (p(OP_SIGNAL, 1, 0), p(OP_WAIT, 1, 0));
    assert_eq!(s.packed.script(0), &[&wide[..], &[signal]].concat()[..]);
    assert_eq!(
        s.packed.script(1),
        &[&wide[..], &[signal, wait], &narrow[..]].concat()[..]
    );
    assert_eq!(s.packed.script(2), &[&[wait][..], &narrow[..]].concat()[..]);
    assert!(s.packed.script(3).is_empty());
    assert_eq!(s.packed.barrier_expects(), &[2]);
    assert_eq!(s.task_vpps[0], vec![0, 1]);
    assert_eq!(s.task_vpps[2], vec![1, 2]);
    assert_eq!(simulate(&s, &g).unwrap().len(), 3);
    // a long list goes to the operand pool; two wide products of a
    // level share the VPPs in proportion to their work
    let items: Vec<u32> = (0..30).collect();
    let mut g = VppTaskGraph::new();
    g.push(task(OP_FIRST_ENGINE, &items, &[], 1, h1)).unwrap();
    g.push(task(OP_FIRST_ENGINE + 1, &items, &[], 1, h1))
        .unwrap();
    g.push(task(OP_FIRST_ENGINE + 1, &items[..3], &[], 1, h1))
        .unwrap();
    scheduler.matrix_shapes = vec![(8, 8), (64, 96)];
    let s = scheduler.schedule(&g).unwrap();
    // MATVEC (10 items) gets one VPP of four, MATVEC_T (the one-item
    // task merged in: 11 items) the other three: one row tile on VPP 0,
    // its reduction not split; 2 column tiles on VPPs 1 and 2
    let first = [p(OP_FIRST_ENGINE, 4, 0), 10 | WIDE_ITEMS, 1 << 16, 0];
    let second = [
        p(OP_FIRST_ENGINE + 1, 4, 0),
        11 | WIDE_ITEMS,
        1 | 2 << 16,
        30,
    ];
    assert_eq!(s.packed.script(0), &first[..]);
    assert_eq!(s.packed.script(1), &second[..]);
    assert_eq!(s.task_vpps[1], vec![1, 2]);
    assert!(s.packed.script(3).is_empty());
    assert_eq!(simulate(&s, &g).unwrap().len(), 3);
}

#[test]
fn wide_ranges_share_the_vpps_the_level_leaves_idle() {
    let product = |count| WideProduct {
        op: OP_FIRST_ENGINE,
        rows: 1024,
        cols: 64,
        count,
    };
    // 32 tiles each: more than any share, so each fills its share
    assert_eq!(wide_tiles(OP_FIRST_ENGINE, 1024, 64, 100, 8), 32);
    let mut ranges = Vec::new();
    let mut next = 5;
    // VPPs 0 and 7 busy: the region is 1..=6, shared 1 : 3 by work
    // (1.5 and 4.5 rounded down, the spare VPP to the heavier)
    let mut busy = [false; 8];
    busy[0] = true;
    busy[7] = true;
    deal_wide_ranges(&busy, &mut next, &[product(100), product(300)], &mut ranges);
    assert_eq!(ranges, vec![(1, 1), (2, 5)]);
    // the idle run may wrap around: VPPs 3 and 4 busy, region 5..=2
    let mut busy = [false; 8];
    busy[3] = true;
    busy[4] = true;
    deal_wide_ranges(&busy, &mut next, &[product(100)], &mut ranges);
    assert_eq!(ranges, vec![(5, 6)]);
    // nothing else at the level: every VPP, from where the last range
    // ended; a product with fewer pieces than VPPs takes only those
    next = 6;
    let small = WideProduct {
        op: OP_FIRST_ENGINE,
        rows: 128,
        cols: 32,
        count: 3,
    };
    assert_eq!(wide_tiles(OP_FIRST_ENGINE, 128, 32, 3, 8), 2);
    deal_wide_ranges(&[false; 8], &mut next, &[small], &mut ranges);
    assert_eq!(ranges, vec![(6, 2)]);
    assert_eq!(next, 0);
    // less than half idle: every VPP again (the level's other work is
    // spread over them), from `next`
    let mut busy = [true; 8];
    busy[2] = false;
    deal_wide_ranges(&busy, &mut next, &[product(100), product(100)], &mut ranges);
    assert_eq!(ranges, vec![(0, 4), (4, 4)]);
    // more products than VPPs: each may use all of them
    deal_wide_ranges(&[false; 2], &mut next, &[small, small, small], &mut ranges);
    assert_eq!(ranges.len(), 3);
    assert!(ranges.iter().all(|&(_, n)| (1..=2).contains(&n)));
}

#[test]
fn a_levels_wide_products_share_the_vpps_by_tile_steps() {
    use crate::vpps::wide::split_depth;
    // a Tree-LSTM level at h 512: U_iou h over 17 parents, U_f h over
    // their 34 children; one row of tiles each, U_iou three times the
    // tiles, so 3/4 of the VPPs (by multiply-adds it had 3/5: pieces 6
    // steps deep against U_f's 3)
    let u_iou = WideProduct {
        op: OP_FIRST_ENGINE,
        rows: 1536,
        cols: 512,
        count: 17,
    };
    let u_f = WideProduct {
        rows: 512,
        count: 34,
        ..u_iou
    };
    assert_eq!(wide_work(OP_FIRST_ENGINE, 1536, 512, 17), 24 * 32);
    assert_eq!(wide_work(OP_FIRST_ENGINE, 512, 512, 34), 8 * 32);
    let mut ranges = Vec::new();
    deal_wide_ranges(&[false; 264], &mut 0, &[u_iou, u_f], &mut ranges);
    assert_eq!(ranges, vec![(0, 192), (198, 64)]);
    // both split 512 columns 64 deep: 4 steps a piece
    assert_eq!(split_depth(512, 192 / 24), (8, 64));
    assert_eq!(split_depth(512, 64 / 8), (8, 64));
}

#[test]
fn fig6_scripts() {
    let g = fig6_graph();
    let s = fig6_scheduler().schedule(&g).unwrap();
    assert_eq!(s.levels, 3);
    assert_eq!(s.task_levels, vec![0, 0, 0, 0, 1, 2]);
    let p = |op, len, arg| preamble(op, len, arg);
    let merged0 = [p(16, 3, 0), 2, 0];
    let merged1 = [p(16, 3, 0), 1, 4];
    let (s0, w0, s1, w1) = (p(1, 1, 0), p(2, 1, 0), p(1, 1, 1), p(2, 1, 1));
    let update = p(30, 1, 0);
    let vpp0 = [&merged0[..], &[p(20, 2, 0), 100, s0, w1, update]].concat();
    let vpp1 = [&merged0[..], &merged1[..], &[s0, w1, update]].concat();
    let vpp3 = [&merged0[..], &[s0, w0, p(21, 2, 0), 200, s1, w1, update]].concat();
    assert_eq!(s.packed.script(0), &vpp0[..]);
    assert_eq!(s.packed.script(1), &vpp1[..]);
    assert_eq!(s.packed.script(2), &vpp1[..]);
    assert_eq!(s.packed.script(3), &vpp3[..]);
    assert_eq!(s.packed.barrier_expects(), &[4, 1]);
    assert_eq!(s.packed.operand_pool(), &[10, 11, 12, 13, 14, 15]);
    // Holder loads: 8 x 8/32 = 2 each, matrix 1: 2 x 8/16 = 1; then the
    // Any tasks go to VPP 0 (tie, lowest index) and VPP 3.
    assert_eq!(s.loads, vec![8, 4, 4, 4]);
    assert_eq!(s.task_vpps[0], vec![0]);
    assert_eq!(s.task_vpps[3], vec![1, 2]);
    assert_eq!(s.task_vpps[4], vec![3]);
    assert_eq!(s.task_vpps[5], vec![0, 1, 2, 3]);
    assert_eq!(s.vpp_tasks[1], vec![1, 2, 3, 5]);
    let order = simulate(&s, &g).unwrap();
    assert_eq!(order.len(), 6);
    assert_eq!(order.last(), Some(&5));
}

#[test]
fn simulator_catches_broken_scripts() {
    let g = fig6_graph();
    let s = fig6_scheduler().schedule(&g).unwrap();
    let repack = |s: &BatchScripts, scripts: Vec<Vec<u32>>, expect: &[u32], pool: &[u32]| {
        let mut t = s.clone();
        t.packed = PackedScripts::pack(&scripts, expect, pool).unwrap();
        t
    };
    let scripts: Vec<Vec<u32>> = (0..4).map(|v| s.packed.script(v).to_vec()).collect();
    let pool = s.packed.operand_pool().to_vec();
    // VPP 3 without its WAIT 0, running ahead of everyone else.
    let mut broken = scripts.clone();
    broken[3].remove(4);
    let t = repack(&s, broken, &[4, 1], &pool);
    let err = simulate_with(&t, &g, |r| r.len() - 1).unwrap_err();
    assert!(err.to_string().contains("before its dependency"), "{err}");
    // A graph that is not the scheduled one (and not a DAG).
    let mut other = g.clone();
    other.tasks[0].deps = vec![5];
    let err = simulate(&s, &other).unwrap_err();
    assert!(
        err.to_string().contains("task 0 depends on task 5"),
        "{err}"
    );
    // An expectation nobody meets.
    let t = repack(&s, scripts.clone(), &[4, 2], &pool);
    let err = simulate(&t, &g).unwrap_err();
    assert!(err.to_string().contains("deadlock"), "{err}");
    // Over-signalling.
    let t = repack(&s, scripts.clone(), &[3, 1], &pool);
    assert!(simulate(&t, &g).is_err());
    // A corrupted operand pool.
    let mut bad_pool = pool.clone();
    bad_pool[3] += 1;
    let t = repack(&s, scripts.clone(), &[4, 1], &bad_pool);
    let err = simulate(&t, &g).unwrap_err();
    assert!(err.to_string().contains("merged operand items"), "{err}");
    // A task dropped from a VPP's script.
    let mut broken = scripts;
    broken[0].truncate(3);
    let t = repack(&s, broken, &[4, 1], &pool);
    assert!(simulate(&t, &g).is_err());
}

#[test]
fn invalid_graphs_are_rejected() {
    let mut g = VppTaskGraph::new();
    let err = g.push(task(16, &[], &[0], 1, Placement::Any)).unwrap_err();
    assert!(
        err.to_string().contains("task 0 depends on task 0"),
        "{err}"
    );
    let err = g
        .push(task(OP_WAIT, &[], &[], 1, Placement::Any))
        .unwrap_err();
    assert!(err.to_string().contains("opcode 2"), "{err}");
    let err = g
        .push(task(16, &[0; 255], &[], 1, Placement::Every))
        .unwrap_err();
    assert!(err.to_string().contains("255 operands"), "{err}");
    assert!(g.is_empty());
    // Many operands are fine through the pool.
    g.push(task(
        16,
        &[0; 300],
        &[],
        1,
        Placement::Holders { matrix: 1 },
    ))
    .unwrap();
    g.push(task(16, &[0; 2], &[], 1, Placement::Holders { matrix: 1 }))
        .unwrap();
    let err = fig6_scheduler().schedule(&g).unwrap_err();
    assert!(err.to_string().contains("300 and 2 operands"), "{err}");
    let err = Scheduler::with_vpps(4).schedule(&g).unwrap_err();
    assert!(
        err.to_string()
            .contains("task 0 runs on the holders of matrix 1"),
        "{err}"
    );
    // A hand-built graph with a forward edge.
    let g = VppTaskGraph {
        tasks: vec![
            task(16, &[], &[1], 1, Placement::Any),
            task(16, &[], &[], 1, Placement::Any),
        ],
    };
    let err = Scheduler::with_vpps(2).schedule(&g).unwrap_err();
    assert!(
        err.to_string().contains("task 0 depends on task 1"),
        "{err}"
    );
    let mut bad = fig6_scheduler();
    bad.holders[1] = vec![2, 1];
    assert!(bad.schedule(&VppTaskGraph::new()).is_err());
    bad.holders[1] = vec![1, 4];
    assert!(bad.schedule(&VppTaskGraph::new()).is_err());
    assert!(Scheduler::with_vpps(0)
        .schedule(&VppTaskGraph::new())
        .is_err());
}

#[test]
fn empty_graph_gives_empty_scripts() {
    let s = Scheduler::with_vpps(3)
        .schedule(&VppTaskGraph::new())
        .unwrap();
    assert_eq!((s.levels, s.packed.barriers, s.packed.vpps), (0, 0, 3));
    assert!(s.packed.script(1).is_empty());
    assert!(simulate(&s, &VppTaskGraph::new()).unwrap().is_empty());
}

#[test]
fn holder_tasks_of_item_pairs_merge_by_items() {
    let mut s = fig6_scheduler();
    s.holder_item = 2;
    let mut g = VppTaskGraph::new();
    let a = g
        .push(task(20, &[1, 2], &[], 1, Placement::Holders { matrix: 0 }))
        .unwrap();
    g.push(task(
        20,
        &[3, 4, 5, 6],
        &[],
        1,
        Placement::Holders { matrix: 0 },
    ))
    .unwrap();
    g.push(task(21, &[7], &[a], 1, Placement::Any)).unwrap();
    let sc = s.schedule(&g).unwrap();
    let first = sc.packed.decode_script(0).unwrap();
    assert_eq!(
        first[0].operands,
        [3 | INLINE_ITEMS, 1, 2, 3, 4, 5, 6],
        "three pairs inside one instruction"
    );
    assert!(sc.packed.operand_pool().is_empty());
    assert_eq!(simulate(&sc, &g).unwrap().len(), 3);
    // a list longer than the inline limit goes to the operand pool
    let mut long = g.clone();
    let many: Vec<u32> = (100..100 + MAX_INLINE_ITEM_WORDS as u32).collect();
    long.push(task(20, &many, &[], 1, Placement::Holders { matrix: 0 }))
        .unwrap();
    let sc = s.schedule(&long).unwrap();
    let first = sc.packed.decode_script(0).unwrap();
    let items = (6 + MAX_INLINE_ITEM_WORDS) / 2;
    assert_eq!(first[0].operands, [items as u32, 0]);
    assert_eq!(
        &sc.packed.operand_pool()[..8],
        &[1, 2, 3, 4, 5, 6, 100, 101]
    );
    assert_eq!(simulate(&sc, &long).unwrap().len(), 4);
    // the simulator checks inline items against the tasks'
    let mut bad = s.schedule(&g).unwrap();
    let mut scripts: Vec<Vec<u32>> = (0..bad.packed.vpps)
        .map(|v| bad.packed.script(v).to_vec())
        .collect();
    scripts[0][2] += 1;
    bad.packed = PackedScripts::pack(&scripts, bad.packed.barrier_expects(), &[]).unwrap();
    let err = simulate(&bad, &g).unwrap_err().to_string();
    assert!(err.contains("merged operand items"), "{err}");
    g.push(task(
        20,
        &[1, 2, 3],
        &[],
        1,
        Placement::Holders { matrix: 0 },
    ))
    .unwrap();
    let err = s.schedule(&g).unwrap_err().to_string();
    assert!(
        err.contains("not a positive multiple of 2-word items"),
        "{err}"
    );
}

#[test]
fn only_one_task_that_only_a_sink_waits_for_chains_per_processor_and_level() {
    // a producer, four siblings nothing but the sink waits for, the sink
    let mut g = VppTaskGraph::new();
    g.push(task(16, &[0], &[], 1, Placement::Any)).unwrap();
    for k in 1..=4 {
        g.push(task(16, &[k], &[0], 1, Placement::Any)).unwrap();
    }
    g.push(task(16, &[5], &[0, 1, 2, 3, 4], 1, Placement::Any))
        .unwrap();
    let s = Scheduler::with_vpps(4).schedule(&g).unwrap();
    assert_eq!(s.task_levels, vec![0, 0, 1, 1, 1, 2]);
    assert_eq!(s.task_vpps[1], s.task_vpps[0], "the first sibling chains");
    let spread: std::collections::BTreeSet<u32> = (2..5).map(|t| s.task_vpps[t][0]).collect();
    assert_eq!(spread.len(), 3, "the others run side by side");
    assert_eq!(simulate(&s, &g).unwrap().len(), 6);
}

#[test]
fn tasks_only_a_sink_waits_for_run_at_the_end() {
    // a three-level chain, a sum of its first task's rows that only
    // the sink waits for, the sink
    let mut g = VppTaskGraph::new();
    g.push(task(16, &[0], &[], 1, Placement::Any)).unwrap();
    g.push(task(16, &[1], &[0], 1, Placement::Any)).unwrap();
    g.push(task(16, &[2], &[1], 1, Placement::Any)).unwrap();
    g.push(task(17, &[3], &[0], 1, Placement::Any)).unwrap();
    g.push(task(16, &[4], &[0, 1, 2, 3], 1, Placement::Any))
        .unwrap();
    let mut s = Scheduler::with_vpps(2);
    s.chain = false;
    let deferred = s.schedule(&g).unwrap();
    assert_eq!(deferred.task_levels, vec![0, 1, 2, 2, 3]);
    assert_ne!(
        deferred.task_vpps[3], deferred.task_vpps[2],
        "beside the last level's work"
    );
    assert_eq!(simulate(&deferred, &g).unwrap().len(), 5);
    s.defer_terminal = false;
    assert_eq!(s.schedule(&g).unwrap().task_levels, vec![0, 1, 2, 1, 3]);
}

#[test]
fn products_only_a_sink_waits_for_run_together_at_the_end() {
    // a backward pass's end: two levels' weight-gradient outer products
    // (tasks 1 and 4, on the holders of different matrices) that only
    // the sink waits for
    let mut g = VppTaskGraph::new();
    let (h0, h1) = (
        Placement::Holders { matrix: 0 },
        Placement::Holders { matrix: 1 },
    );
    g.push(task(20, &[0], &[], 1, Placement::Any)).unwrap();
    g.push(task(18, &[1], &[0], 1, h1)).unwrap();
    g.push(task(17, &[2], &[0], 1, h0)).unwrap();
    g.push(task(20, &[3], &[2], 1, Placement::Any)).unwrap();
    g.push(task(18, &[4], &[3], 1, h0)).unwrap();
    g.push(task(27, &[], &[0, 1, 2, 3, 4], 1, Placement::Any))
        .unwrap();
    let mut s = fig6_scheduler();
    s.defer_terminal = true;
    let deferred = s.schedule(&g).unwrap();
    assert_eq!(deferred.task_levels, vec![0, 3, 1, 2, 3, 4]);
    assert_eq!(simulate(&deferred, &g).unwrap().len(), 6);
    s.defer_terminal = false;
    assert_eq!(s.schedule(&g).unwrap().task_levels, vec![0, 1, 1, 2, 3, 4]);
    // an update on every VPP that waits for the outer product only
    // still runs after the transposed product nothing waits for (it
    // overwrites the weights that product reads)
    let mut g = VppTaskGraph::new();
    g.push(task(16, &[0], &[], 1, h0)).unwrap();
    g.push(task(17, &[1], &[0], 1, h0)).unwrap();
    g.push(task(18, &[2], &[0], 1, h0)).unwrap();
    g.push(task(19, &[], &[2], 1, Placement::Every)).unwrap();
    s.defer_terminal = true;
    assert_eq!(s.schedule(&g).unwrap().task_levels, vec![0, 1, 1, 2]);
}

#[test]
fn barrier_limit() {
    let chain = |n: u32| {
        let mut g = VppTaskGraph::new();
        for i in 0..n {
            let deps = if i == 0 { vec![] } else { vec![i - 1] };
            g.push(task(16, &[i], &deps, 1, Placement::Any)).unwrap();
        }
        g
    };
    let mut unchained = Scheduler::with_vpps(2);
    unchained.chain = false;
    let s = unchained.schedule(&chain(65536)).unwrap();
    assert_eq!(s.packed.barriers, MAX_BARRIERS);
    assert_eq!(s.packed.barrier_expect(65534), Some(1));
    let err = unchained.schedule(&chain(65537)).unwrap_err();
    assert!(err.to_string().contains("65537 levels"), "{err}");
    // chained, the same dependency chain is one processor's one level
    let s = Scheduler::with_vpps(2).schedule(&chain(65537)).unwrap();
    assert_eq!((s.levels, s.packed.barriers), (1, 0));
    assert!(s.task_vpps.iter().all(|v| v == &s.task_vpps[0]));
    assert_eq!(simulate(&s, &chain(65537)).unwrap().len(), 65537);
}

/// A pseudo-random task graph in the shape the engines emit: `Any` tasks,
/// products on cached matrices (`item`-word items, or `1 + op` operands
/// without items), an update on every VPP now and then, and a final sink
/// depending on every task before it.
fn mixed_graph(seed: u64, n: usize, matrices: u16, item: usize) -> VppTaskGraph {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut g = VppTaskGraph::new();
    let mut next = 0u32;
    let mut operands = |count: usize| -> Vec<u32> {
        next += count as u32;
        (next - count as u32..next).collect()
    };
    for i in 0..n as u32 {
        let mut deps: Vec<u32> = (0..rng.random_range(0..4u32))
            .filter(|_| i > 0)
            .map(|_| rng.random_range(0..i))
            .collect();
        deps.sort_unstable();
        deps.dedup();
        let op = OP_FIRST_ENGINE + rng.random_range(0..3u8);
        let (placement, count) = match rng.random_range(0..20u32) {
            0 => (Placement::Every, 0),
            1..=9 => (Placement::Any, rng.random_range(0..4usize)),
            _ => {
                let count = match item {
                    0 => 1 + usize::from(op - OP_FIRST_ENGINE),
                    _ => item * rng.random_range(1..6usize),
                };
                let matrix = rng.random_range(0..matrices);
                (Placement::Holders { matrix }, count)
            }
        };
        let mut t = task(
            op,
            &operands(count),
            &deps,
            rng.random_range(1..40),
            placement,
        );
        t.arg = rng.random_range(0..2);
        g.push(t).unwrap();
    }
    let all: Vec<u32> = (0..n as u32).collect();
    g.push(task(OP_FIRST_ENGINE + 5, &[], &all, 1, Placement::Any))
        .unwrap();
    g
}

/// The scripts and simulated runs of [`mixed_graph`]s under every switch
/// of the scheduler hash to the values recorded before the scheduler and
/// the simulator were split into named steps: a restructuring must not
/// change a word. (A deliberate change of the scripts records new values.)
#[test]
fn scripts_and_simulations_are_unchanged() {
    let mut all = String::new();
    // the graphs reach wide products and operand-pool lists
    let (mut wide_seen, mut pooled) = (false, false);
    for seed in 0..6u64 {
        for (item, wide) in [(0, None), (3, None), (3, Some(4))] {
            for switches in 0..8u32 {
                let s = Scheduler {
                    vpps: 6,
                    holders: vec![vec![0, 1, 2, 3, 4, 5], vec![1, 2, 4], vec![3]],
                    holder_rows: vec![vec![8, 8, 8, 8, 8, 4], vec![20, 20, 10], vec![32]],
                    matrix_load_factor: DEFAULT_MATRIX_LOAD_FACTOR,
                    chain: switches & 1 != 0,
                    defer_terminal: switches & 2 != 0,
                    balance_per_level: switches & 4 != 0,
                    record: true,
                    holder_item: item,
                    wide_items: wide,
                    matrix_shapes: vec![(64, 32), (128, 96), (32, 256)],
                };
                let g = mixed_graph(seed, 40 + 10 * seed as usize, 3, item);
                let scripts = s.schedule(&g).unwrap();
                wide_seen |= g.tasks.iter().zip(&scripts.task_vpps).any(|(t, v)| {
                    matches!(t.placement, Placement::Holders { matrix }
                        if *v != s.holders[usize::from(matrix)])
                });
                pooled |= scripts.packed.words.len() > scripts.packed.operands_at;
                let choices = [0, 3, 1, 2, 5, 1];
                let mut at = 0;
                let sim = simulate_with(&scripts, &g, |_| {
                    at += 1;
                    choices[at % choices.len()]
                })
                .unwrap();
                all += &format!("{scripts:?}\n{sim:?}\n");
            }
        }
    }
    assert!(wide_seen && pooled, "wide {wide_seen}, pooled {pooled}");
    // FNV-1a: stable across Rust versions, unlike the std hasher
    let hash = all.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    assert_eq!(
        (all.len(), hash),
        (1_270_984, 518_021_268_341_754_481),
        "scripts or simulations changed"
    );
}
