//! Sharding and the local group's failures, over many inputs.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use ramus_dist::{local_group, Shard};
use ramus_exec::data_parallel::{Collective, GradBuffer};

proptest! {
    /// Every graph exactly once per epoch across the ranks; each global
    /// step is the ranks' parts in rank order, which is the one-rank run's
    /// batch of `world × per_rank`; every rank takes the same steps.
    #[test]
    fn shards_cover_the_epoch_once_in_the_single_run_s_batches(
        len in 0usize..200, world in 1usize..9, per_rank in 1usize..17, seed in any::<u64>()
    ) {
        let mut order: Vec<usize> = (0..len).collect();
        // any permutation: the ranks only cut it
        let n = order.len().max(1);
        order.rotate_left((seed as usize) % n);
        let parts: Vec<Vec<&[usize]>> = (0..world)
            .map(|r| Shard::new(r, world).unwrap().batches(&order, per_rank).unwrap())
            .collect();
        let single: Vec<&[usize]> = order.chunks(world * per_rank).collect();
        for p in &parts {
            prop_assert_eq!(p.len(), single.len());
        }
        for (step, want) in single.iter().enumerate() {
            let joined: Vec<usize> = parts.iter().flat_map(|p| p[step].iter().copied()).collect();
            prop_assert_eq!(&joined[..], *want);
            let sizes: Vec<usize> = parts.iter().map(|p| p[step].len()).collect();
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            prop_assert!(hi - lo <= 1 && *hi <= per_rank, "{:?}", sizes);
        }
    }
}

#[test]
fn a_group_sums_identically_on_every_rank() {
    let ranks = local_group::<f32>(3, Duration::from_secs(10));
    type Out = (Vec<f32>, Vec<f64>);
    let results: Vec<Out> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut rank| {
                s.spawn(move || {
                    let r = rank.rank() as f32;
                    let mut a = vec![r, 1.0];
                    let mut b = vec![10.0 * r];
                    let buffers = vec![GradBuffer::Host(&mut a), GradBuffer::Host(&mut b)];
                    rank.sum_buffers(buffers, 0.5).unwrap();
                    a.extend(b);
                    let mut scalars = [r as f64 + 0.5];
                    rank.sum_scalars(&mut scalars).unwrap();
                    (a, scalars.to_vec())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (sums, scalars) in &results {
        // each rank's buffers halved, then summed: (0 + 1 + 2) / 2, 3 / 2, 30 / 2
        assert_eq!(sums, &vec![1.5, 1.5, 15.0]);
        assert_eq!(scalars, &vec![4.5]);
    }
}

#[test]
fn a_rank_that_never_arrives_is_named_after_the_timeout() {
    let mut ranks = local_group::<f32>(3, Duration::from_millis(300));
    let late = ranks.pop().unwrap();
    let start = Instant::now();
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut rank| s.spawn(move || rank.sum_scalars(&mut [1.0]).unwrap_err().to_string()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errors {
        assert!(e.contains("rank(s) 2 of 3 did not reach"), "{e}");
    }
    assert!(start.elapsed() < Duration::from_secs(5));
    drop(late);
}

#[test]
fn a_rank_that_leaves_makes_the_others_stop() {
    let mut ranks = local_group::<f32>(2, Duration::from_secs(30));
    let gone = ranks.pop().unwrap();
    let mut stays = ranks.pop().unwrap();
    let start = Instant::now();
    let err = std::thread::scope(|s| {
        let waiting = s.spawn(move || stays.sum_scalars(&mut [1.0]).unwrap_err().to_string());
        std::thread::sleep(Duration::from_millis(100));
        drop(gone);
        waiting.join().unwrap()
    });
    assert!(err.contains("rank 1 left the group"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));
}
