//! Gradient buckets: parameters grouped, in the order a backward pass
//! finishes their gradients (reverse declaration order), into runs of at
//! most a byte budget each, so that one all-reduce per bucket can start as
//! soon as its last gradient is done while the backward pass goes on, and
//! small tensors travel together instead of one call each. PyTorch's
//! `DistributedDataParallel` buckets the same way (25 MiB by default).

use crate::error::{DistError, Result};

/// The default bucket budget, as PyTorch's (`bucket_cap_mb = 25`).
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// One bucket: parameters (indices in declaration order) reduced together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// In reverse declaration order.
    pub params: Vec<usize>,
    pub bytes: usize,
}

/// Buckets of the trained parameters whose gradient sizes in bytes are
/// `bytes` (declaration order; `None` for a parameter that is not reduced,
/// such as a batch-norm buffer), at most `cap` bytes each unless one
/// parameter alone is larger (it then has a bucket of its own).
pub fn plan(bytes: &[Option<usize>], cap: usize) -> Result<Vec<Bucket>> {
    if cap == 0 {
        return Err(DistError::Config(
            "bucket size must be at least 1 byte".into(),
        ));
    }
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut open = Bucket {
        params: Vec::new(),
        bytes: 0,
    };
    for (p, size) in bytes.iter().enumerate().rev() {
        let Some(size) = *size else { continue };
        if !open.params.is_empty() && open.bytes + size > cap {
            buckets.push(std::mem::replace(
                &mut open,
                Bucket {
                    params: Vec::new(),
                    bytes: 0,
                },
            ));
        }
        open.params.push(p);
        open.bytes += size;
    }
    if !open.params.is_empty() {
        buckets.push(open);
    }
    Ok(buckets)
}
