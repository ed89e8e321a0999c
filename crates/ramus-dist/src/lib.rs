//! The pieces of Ramus's data-parallel training that need no device: each
//! backend-neutral, each tested without a GPU.
//!
//! | what | where |
//! |---|---|
//! | this process's rank, the world size and rank 0's address, from the launcher's variables (`torchrun`, `srun`, `mpirun`) | [`world`] |
//! | each rank's part of an epoch's global batches | [`shard`] |
//! | the TCP rendezvous handing out a communicator id (NCCL's unique id) | [`rendezvous`] |
//! | ranks as threads of one process, summing host buffers | [`local`] |
//!
//! The training side (the split step an engine implements, the collective
//! contract, the [`DataParallel`](ramus_exec::data_parallel::DataParallel)
//! wrapper) is in `ramus_exec::data_parallel`, gradient buckets in
//! `ramus_exec::bucket`; the NCCL collective is in
//! `ramus-cuda`.
//!
//! ```
//! use ramus_dist::shard::Shard;
//!
//! // 10 graphs in the epoch's shuffled order, 2 ranks, 3 graphs a rank:
//! // global batches of 6, and a last one of 4 split 2 + 2.
//! let order = [7, 2, 9, 0, 4, 1, 8, 3, 6, 5];
//! let rank1 = Shard::new(1, 2).unwrap().batches(&order, 3).unwrap();
//! assert_eq!(rank1, vec![&[0, 4, 1][..], &[6, 5][..]]);
//! ```

pub mod error;
pub mod local;
pub mod rendezvous;
pub mod shard;
pub mod world;

pub use error::{DistError, Result};
pub use local::{local_group, LocalRank};
pub use shard::Shard;
pub use world::World;
