//! Gradient buckets: parameters grouped, in the order an engine's backward
//! pass finishes their gradients, into runs of at most a byte budget each,
//! so that one all-reduce per bucket can start as soon as its last
//! gradient is done while the backward pass goes on, and small tensors
//! travel together instead of one call each. PyTorch's
//! `DistributedDataParallel` buckets the same way (25 MiB by default).

use crate::error::{ExecError, Result};

/// The default bucket budget, as PyTorch's (`bucket_cap_mb = 25`).
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// One bucket: parameters reduced together, in the order they finish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub params: Vec<usize>,
    pub bytes: usize,
}

/// Buckets of the parameters `finished`, `(parameter, gradient bytes)` in
/// the order their gradients are final, at most `cap` bytes each unless
/// one parameter alone is larger (it then has a bucket of its own).
pub fn plan(finished: &[(usize, usize)], cap: usize) -> Result<Vec<Bucket>> {
    if cap == 0 {
        return Err(ExecError::Config(
            "bucket size must be at least 1 byte".into(),
        ));
    }
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut open = Bucket {
        params: Vec::new(),
        bytes: 0,
    };
    for &(p, size) in finished {
        if !open.params.is_empty() && open.bytes + size > cap {
            let next = Bucket {
                params: Vec::new(),
                bytes: 0,
            };
            buckets.push(std::mem::replace(&mut open, next));
        }
        open.params.push(p);
        open.bytes += size;
    }
    if !open.params.is_empty() {
        buckets.push(open);
    }
    Ok(buckets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Buckets hold every parameter once, in the order given, within
        /// the budget unless a parameter alone exceeds it, and close only
        /// when the next parameter would overflow them.
        #[test]
        fn buckets_keep_the_order_and_the_budget(
            sizes in prop::collection::vec(1usize..5000, 0..40),
            cap in 1usize..8000,
            seed in any::<u64>(),
        ) {
            // a scrambled order of the parameters
            let mut order: Vec<usize> = (0..sizes.len()).collect();
            order.sort_by_key(|&p| (p as u64).wrapping_mul(seed | 1).rotate_left(17));
            let finished: Vec<(usize, usize)> = order.iter().map(|&p| (p, sizes[p])).collect();
            let buckets = plan(&finished, cap).unwrap();
            let flat: Vec<usize> = buckets.iter().flat_map(|b| b.params.iter().copied()).collect();
            prop_assert_eq!(flat, order);
            for b in &buckets {
                let bytes: usize = b.params.iter().map(|&p| sizes[p]).sum();
                prop_assert_eq!(bytes, b.bytes);
                prop_assert!(b.bytes <= cap || b.params.len() == 1, "{:?} over {}", b, cap);
            }
            for pair in buckets.windows(2) {
                prop_assert!(pair[0].bytes + sizes[pair[1].params[0]] > cap);
            }
        }
    }

    #[test]
    fn a_zero_bucket_budget_is_refused() {
        assert!(plan(&[(0, 4)], 0).is_err());
    }
}
