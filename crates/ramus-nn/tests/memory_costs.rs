//! `ramus_exec::memory`'s costs on the zoo's models: parameter and optimizer
//! state sizes, a pyramid's cost from its word count, and a batch's cost
//! from its largest graphs (the models come from `ramus-nn`, so these tests
//! live here rather than beside the code in `ramus-exec`).

use ramus_exec::memory::{largest_param, optimizer_copies, param_bytes, ActivationCost, Pass};
use ramus_exec::OptimizerKind;
use ramus_graph::InputGraph;
use ramus_nn::{build_model, ModelConfig};

fn cfg(hidden: usize) -> ModelConfig {
    ModelConfig {
        vocab: 10,
        hidden,
        classes: 5,
    }
}

#[test]
fn parameters_and_optimizer_state_scale_with_the_model() {
    let m = build_model("treelstm", &cfg(8)).unwrap();
    let by_hand: u64 = m
        .params
        .iter()
        .map(|p| p.shape.iter().product::<usize>() as u64 * 4)
        .sum();
    assert_eq!(param_bytes(&m), by_hand);
    let (i, b) = largest_param(&m).unwrap();
    assert_eq!(b, m.params[i].shape.iter().product::<usize>() as u64 * 4);
    assert_eq!(optimizer_copies(OptimizerKind::Adam), 2);
    // absurd sizes saturate rather than wrap
    let huge = build_model("treelstm", &cfg(1 << 31)).unwrap();
    assert!(param_bytes(&huge) > 1 << 60);
}

#[test]
fn a_pyramids_cost_from_its_word_count_is_the_built_pyramids() {
    use ramus_graph::sequence::{pyramid, pyramid_shape};
    for name in ["td-rnn", "td-lstm"] {
        let m = build_model(name, &cfg(8)).unwrap();
        for pass in [Pass::Train, Pass::Evaluate, Pass::Infer] {
            let cost = ActivationCost::new(&m, pass);
            for words in [1u32, 2, 5, 17] {
                let tokens: Vec<u32> = (0..words).map(|t| t % 10).collect();
                let built = pyramid(&tokens, 3).unwrap();
                let shape = pyramid_shape(u64::from(words), true);
                let want = cost.graph_bytes(&m, &built);
                assert_eq!(
                    cost.shape_bytes(&m, &shape),
                    want,
                    "{name} {pass:?} {words}"
                );
                assert!(want > 0);
            }
        }
        // a line of 30000 words: hundreds of GiB, computed at once
        let cost = ActivationCost::new(&m, Pass::Infer);
        let long = cost.shape_bytes(&m, &pyramid_shape(30_000, true));
        assert!(long > 100 << 30, "{long}");
    }
}

#[test]
fn a_batch_costs_its_largest_graphs_and_training_costs_more() {
    let m = build_model("treelstm-nary", &cfg(8)).unwrap();
    let mut small = InputGraph::new();
    let a = small.push_vertex(&[], 1, 2).unwrap();
    let b = small.push_vertex(&[], 2, 2).unwrap();
    small.push_vertex(&[a, b], 0, 3).unwrap();
    let single = InputGraph::chain(&[1], &[0]).unwrap();
    let train = ActivationCost::new(&m, Pass::Train);
    let infer = ActivationCost::new(&m, Pass::Infer);
    assert!(train.graph_bytes(&m, &small) > infer.graph_bytes(&m, &small));
    assert!(train.graph_bytes(&m, &small) > train.graph_bytes(&m, &single));
    let costs = train.graph_costs(&m, &[single.clone(), small.clone(), single.clone()]);
    let (big, _) = costs.costliest().unwrap();
    assert_eq!(big, 1);
    assert_eq!(
        costs.cheapest(),
        Some(train.fixed() + train.graph_bytes(&m, &single))
    );
    let one = train.graph_bytes(&m, &small);
    assert_eq!(costs.largest_batch(1), train.fixed() + one);
    assert!(costs.largest_batch(2) > costs.largest_batch(1));
    assert_eq!(costs.largest_batch(9), costs.largest_batch(3));
    assert_eq!(costs.fitting_batch(3, costs.largest_batch(2)), 2);
    assert_eq!(costs.fitting_batch(3, train.fixed()), 0);
    // in order, batches of two are [single, small] and [single]
    assert_eq!(costs.largest_chunk(2), costs.largest_batch(2));
    assert!(costs.largest_chunk(1) == costs.largest_batch(1));
    let ordered = train.graph_costs(&m, &[small.clone(), single.clone(), single.clone(), small]);
    assert!(ordered.largest_chunk(2) < ordered.largest_batch(2));
}
