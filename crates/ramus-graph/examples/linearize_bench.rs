//! Host time of the linearizer per batch, to set against Cortex §7.5
//! (TreeLSTM on SST: 1.31 µs at batch size 1, 9.64 µs at 10; TreeFC on
//! perfect binary trees: 3.04 / 30.36 µs; DAG-RNN on 10×10 grids: 8.2 /
//! 95.14 µs).
//!
//! ```sh
//! cargo run --release -p ramus-graph --example linearize_bench
//! ```
//!
//! SST is read from `$RAMUS_DATA/sst/train.txt`, else
//! `<workspace>/../shared/data/sst/train.txt`; without it those rows are
//! skipped with a notice. Each row reuses one [`Linearizer`] (the steady
//! state of a serving loop) and reports the median of 7 timed trials of many repetitions;
//! "+ left/right" adds the dense binary child tables, and the Cavs
//! [`Schedule`] of the batched engines is timed on the same batches for
//! comparison.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ramus_graph::ptb::read_trees;
use ramus_graph::random::random_tree;
use ramus_graph::{BatchingPolicy, InputGraph, Linearizer, Schedule, Vocab, VocabMode};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Time of one call of `f` in µs: the median of 7 trials, each repeating
/// `f` for about `budget`.
fn time_us(budget: Duration, mut f: impl FnMut()) -> f64 {
    let mut reps = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        if t.elapsed() >= budget {
            break;
        }
        reps *= 2;
    }
    let mut trials: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed().as_secs_f64() * 1e6 / reps as f64
        })
        .collect();
    trials.sort_by(f64::total_cmp);
    trials[3]
}

/// Mean µs per batch over `batches`: linearize, linearize + dense binary
/// tables, Cavs schedule.
fn measure(batches: &[Vec<&InputGraph>]) -> (f64, f64, f64) {
    let budget = Duration::from_millis(50);
    let per = batches.len() as f64;
    let mut lin = Linearizer::new();
    let mut dense = Vec::new();
    let lin_us = time_us(budget, || {
        for b in batches {
            black_box(lin.linearize(black_box(b)).map(|lb| lb.num_internal()).ok());
        }
    }) / per;
    let dense_us = time_us(budget, || {
        for b in batches {
            if let Ok(lb) = lin.linearize(black_box(b)) {
                black_box(lb.dense_children(2.max(lb.max_children()), &mut dense).ok());
            }
        }
    }) / per;
    let sched_us = time_us(budget, || {
        for b in batches {
            black_box(
                Schedule::build(black_box(b), BatchingPolicy::Cavs, 2, |_, k| {
                    Ok(usize::from(k > 0))
                })
                .ok(),
            );
        }
    }) / per;
    (lin_us, dense_us, sched_us)
}

fn row(name: &str, bs: usize, batches: &[Vec<&InputGraph>]) {
    let nodes: usize = batches.iter().flatten().map(|g| g.len()).sum();
    let (l, d, s) = measure(batches);
    println!(
        "{name:<34} {bs:>3} {:>8.1} {l:>12.2} {d:>14.2} {s:>14.2}",
        nodes as f64 / batches.len() as f64
    );
}

fn batches_of(graphs: &[InputGraph], bs: usize, limit: usize) -> Vec<Vec<&InputGraph>> {
    graphs
        .chunks_exact(bs)
        .take(limit)
        .map(|c| c.iter().collect())
        .collect()
}

fn sst_path() -> PathBuf {
    match std::env::var_os("RAMUS_DATA") {
        Some(d) => PathBuf::from(d).join("sst/train.txt"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/sst/train.txt"),
    }
}

/// A `side`×`side` grid DAG: vertex (i, j) has children (i-1, j) and (i, j-1).
fn grid(side: usize) -> InputGraph {
    let mut g = InputGraph::new();
    for i in 0..side {
        for j in 0..side {
            let mut kids = Vec::new();
            if i > 0 {
                kids.push(((i - 1) * side + j) as u32);
            }
            if j > 0 {
                kids.push((i * side + j - 1) as u32);
            }
            // ids follow row-major order, so children are always earlier
            let _ = g.push_vertex(&kids, 1, 0);
        }
    }
    g
}

/// A perfect binary tree with `2^height` leaves.
fn perfect(height: u32) -> InputGraph {
    let mut g = InputGraph::new();
    let mut level: Vec<u32> = (0..1u32 << height)
        .filter_map(|t| g.push_vertex(&[], t + 1, 0).ok())
        .collect();
    while level.len() > 1 {
        level = level
            .chunks(2)
            .filter_map(|p| g.push_vertex(p, 0, 0).ok())
            .collect();
    }
    g
}

fn main() {
    println!(
        "{:<34} {:>3} {:>8} {:>12} {:>14} {:>14}",
        "batches", "bs", "nodes", "linearize µs", "+ left/right µs", "Schedule µs"
    );
    let path = sst_path();
    let mut vocab = Vocab::new();
    match read_trees(&path, VocabMode::Grow(&mut vocab)) {
        Ok(sst) => {
            for bs in [1, 10] {
                row(
                    &format!("SST train, first {bs}"),
                    bs,
                    &batches_of(&sst, bs, 1),
                );
                row(
                    &format!("SST train, all (mean of {})", sst.len() / bs),
                    bs,
                    &batches_of(&sst, bs, usize::MAX),
                );
            }
        }
        Err(e) => println!("skipping SST: {e}"),
    }
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let random: Vec<InputGraph> = (0..1000)
        .filter_map(|_| random_tree(&mut rng, 19, &[2], 20_000, 5).ok())
        .collect();
    let perfect10: Vec<InputGraph> = (0..10).map(|_| perfect(7)).collect();
    let grids: Vec<InputGraph> = (0..10).map(|_| grid(10)).collect();
    for bs in [1, 10] {
        row(
            "random binary, 19 leaves",
            bs,
            &batches_of(&random, bs, usize::MAX),
        );
        row(
            "perfect binary, 128 leaves",
            bs,
            &batches_of(&perfect10, bs, 1),
        );
        row("10x10 grid DAG", bs, &batches_of(&grids, bs, 1));
    }
}
