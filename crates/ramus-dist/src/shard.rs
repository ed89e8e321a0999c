//! Each rank's part of an epoch. Every rank draws the same shuffled order
//! (the same seed), cuts it into global batches of `world × per_rank`
//! graphs, and takes its own contiguous part of each: so N ranks with
//! batches of B see exactly the batches of one run with batches of N·B,
//! each graph exactly once per epoch. The last global batch, when shorter,
//! is split as evenly as it goes; a rank may then get no graph, and still
//! takes part in the step (see `ramus_exec::data_parallel`).

use crate::error::{DistError, Result};

/// A rank among `world` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// Rank `rank` of `world`; refuses a rank outside the world.
    pub fn new(rank: usize, world: usize) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(DistError::Config(format!(
                "rank {rank} is not one of {world} ranks"
            )));
        }
        Ok(Shard { rank, world })
    }

    /// The part of each global step of `order` that falls to this rank,
    /// with `per_rank` graphs a rank per full step: one slice per step
    /// (empty where a short last step has fewer graphs than ranks).
    pub fn batches<'a>(&self, order: &'a [usize], per_rank: usize) -> Result<Vec<&'a [usize]>> {
        let global = self.global_batch(per_rank)?;
        Ok(order
            .chunks(global)
            .map(|step| &step[self.part(step.len())])
            .collect())
    }

    /// Graphs per global step: `world × per_rank`.
    pub fn global_batch(&self, per_rank: usize) -> Result<usize> {
        if per_rank == 0 {
            return Err(DistError::Config("batch size must be at least 1".into()));
        }
        per_rank.checked_mul(self.world).ok_or_else(|| {
            DistError::Config(format!(
                "batch size {per_rank} times {} ranks overflows",
                self.world
            ))
        })
    }

    /// How many global steps an epoch of `len` graphs has.
    pub fn steps(&self, len: usize, per_rank: usize) -> Result<usize> {
        Ok(len.div_ceil(self.global_batch(per_rank)?))
    }

    /// This rank's range of a step of `len` graphs: `len / world` each, the
    /// first `len % world` ranks one more (a full step: `per_rank` each).
    fn part(&self, len: usize) -> std::ops::Range<usize> {
        let (base, extra) = (len / self.world, len % self.world);
        let start = self.rank * base + self.rank.min(extra);
        start..start + base + usize::from(self.rank < extra)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_steps_give_each_rank_its_block_in_rank_order() {
        let order: Vec<usize> = (0..12).collect();
        let per_rank: Vec<Vec<&[usize]>> = (0..3)
            .map(|r| Shard::new(r, 3).unwrap().batches(&order, 2).unwrap())
            .collect();
        assert_eq!(per_rank[0], vec![&[0, 1][..], &[6, 7]]);
        assert_eq!(per_rank[1], vec![&[2, 3][..], &[8, 9]]);
        assert_eq!(per_rank[2], vec![&[4, 5][..], &[10, 11]]);
    }

    #[test]
    fn a_short_last_step_is_split_evenly_and_may_leave_a_rank_empty() {
        let order: Vec<usize> = (0..9).collect();
        let last: Vec<&[usize]> = (0..4)
            .map(|r| {
                *Shard::new(r, 4)
                    .unwrap()
                    .batches(&order, 2)
                    .unwrap()
                    .last()
                    .unwrap()
            })
            .collect();
        assert_eq!(last, vec![&[8][..], &[], &[], &[]]);
        assert_eq!(Shard::new(0, 4).unwrap().steps(9, 2).unwrap(), 2);
    }

    #[test]
    fn nonsense_is_refused() {
        assert!(Shard::new(2, 2).is_err());
        assert!(Shard::new(0, 0).is_err());
        let err = Shard::new(0, 2).unwrap().batches(&[1, 2], 0).unwrap_err();
        assert!(err.to_string().contains("batch size"), "{err}");
    }
}
