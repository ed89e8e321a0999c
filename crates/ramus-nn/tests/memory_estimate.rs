//! `ramus_exec::memory`'s estimate against what training really allocates:
//! a counting allocator records the peak of live heap bytes while a
//! Tree-LSTM is set up, trained for an epoch and evaluated, and the
//! estimate must lie within a small factor of it (this file holds one
//! test, so no other test's allocations are counted).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use ramus_core::Params;
use ramus_exec::memory::{packed_weight_bytes, training_state, ActivationCost, Pass};
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::{ptb, synthetic, VocabMode};
use ramus_nn::{build_model, ModelConfig, Trainer};

/// The system allocator, counting live bytes and their peak.
struct Counting;

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call forwards to `System` with the caller's layout and
// pointer unchanged; the counters do not affect the allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        grew(new_size);
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn the_estimate_is_within_a_small_factor_of_the_measured_peak() {
    let tb = synthetic::generate(7, (600, 200, 1));
    let mut vocab = ramus_graph::Vocab::new();
    let train =
        ptb::parse_trees(&tb.train.join("\n"), "train", VocabMode::Grow(&mut vocab)).unwrap();
    let dev = ptb::parse_trees(&tb.dev.join("\n"), "dev", VocabMode::Frozen(&vocab)).unwrap();
    let (batch, eval_batch) = (25, 64);
    for (name, hidden, opt) in [
        ("treelstm", 96, OptimizerKind::Adagrad),
        ("treelstm-nary", 64, OptimizerKind::Adam),
    ] {
        let cfg = ModelConfig {
            vocab: vocab.len(),
            hidden,
            classes: 5,
        };
        let model = build_model(name, &cfg).unwrap();
        let state: u64 = training_state(&model, opt).iter().map(|p| p.1).sum::<u64>()
            + packed_weight_bytes(&model);
        // as `ramus train` estimates a CPU run: the largest shuffled
        // training batch, or the largest evaluation batch (in order) beside
        // the backward buffers training left in the engine
        let train_cost = ActivationCost::new(&model, Pass::Train).graph_costs(&model, &train);
        let eval = ActivationCost::new(&model, Pass::Evaluate);
        let training = train_cost.largest_batch(batch);
        let retained = training - eval.graph_costs(&model, &train).largest_batch(batch);
        let evaluation = eval.graph_costs(&model, &dev).largest_chunk(eval_batch) + retained;
        let estimate = state + training.max(evaluation);

        let base = LIVE.load(Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        let params = Params::<f32>::init(&model, 1);
        let mut t = Trainer::new(model, params, OptimizerConfig::new(opt, 0.01));
        let mut rng = ramus_nn::train::rng(1);
        t.train_epoch(&train, batch, &mut rng, |_, _, _| {})
            .unwrap();
        t.evaluate(&dev, eval_batch).unwrap();
        let measured = PEAK.load(Ordering::Relaxed) - base;
        drop(t);
        let ratio = estimate as f64 / measured as f64;
        println!(
            "{name} h{hidden}: estimate {estimate} B, measured peak {measured} B, ratio {ratio:.2}"
        );
        assert!(
            (0.7..=1.4).contains(&ratio),
            "{name}: estimate {estimate} vs measured {measured} (ratio {ratio:.2})"
        );
    }
}
