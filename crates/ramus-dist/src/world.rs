//! Where this process stands among the ranks of a run, read from the
//! variables launchers set: `torchrun` (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`), Slurm's `srun` (`SLURM_PROCID`,
//! `SLURM_NTASKS`, `SLURM_LOCALID`), Open MPI's `mpirun`
//! (`OMPI_COMM_WORLD_RANK`, `…_SIZE`, `…_LOCAL_RANK`) and MPICH / Intel MPI
//! (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`). The first variable of each
//! list that is set wins; the rendezvous address is always
//! `MASTER_ADDR:MASTER_PORT` (a batch script exports them under `srun` or
//! `mpirun`).

use crate::error::{DistError, Result};

/// The variables each value is read from, in order of precedence.
pub const RANK_VARS: [&str; 4] = ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"];
pub const WORLD_VARS: [&str; 4] = [
    "WORLD_SIZE",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
];
pub const LOCAL_RANK_VARS: [&str; 4] = [
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
];

/// This process's place in a run of several ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    /// This rank, `0..size`.
    pub rank: usize,
    /// How many ranks the run has.
    pub size: usize,
    /// This rank among the ranks of its machine: the GPU it takes.
    pub local_rank: usize,
    /// Where rank 0 listens for the rendezvous (`MASTER_ADDR`).
    pub master_addr: String,
    /// Its port (`MASTER_PORT`).
    pub master_port: u16,
}

impl World {
    /// The run this process belongs to, from its environment; `None` when
    /// no launcher set a rank (a single-process run).
    pub fn from_env() -> Result<Option<World>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) over any source of variables.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<World>> {
        let Some((rank_var, rank)) = first(&get, &RANK_VARS)? else {
            return Ok(None);
        };
        let (world_var, size) = first(&get, &WORLD_VARS)?.ok_or_else(|| {
            DistError::Env(format!(
                "{rank_var}={rank} is set but none of {} is: the number of ranks is unknown",
                WORLD_VARS.join(", ")
            ))
        })?;
        if size == 0 || rank >= size {
            return Err(DistError::Env(format!(
                "{rank_var}={rank} must be below {world_var}={size}"
            )));
        }
        let local_rank = match first(&get, &LOCAL_RANK_VARS)? {
            Some((_, local)) => local,
            None if size == 1 => 0,
            None => {
                return Err(DistError::Env(format!(
                    "{rank_var}={rank} of {world_var}={size}, but none of {} says which GPU of \
                     its machine this rank takes",
                    LOCAL_RANK_VARS.join(", ")
                )))
            }
        };
        let needed = |name: &str| {
            get(name).filter(|v| !v.trim().is_empty()).ok_or_else(|| {
                DistError::Env(format!(
                    "{name} is not set: rank 0's address for the rendezvous (torchrun sets \
                     MASTER_ADDR and MASTER_PORT; under srun or mpirun, export them in the job \
                     script)"
                ))
            })
        };
        let master_addr = needed("MASTER_ADDR")?.trim().to_string();
        let port = needed("MASTER_PORT")?;
        let master_port = port
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| {
                DistError::Env(format!("MASTER_PORT={port} is not a port (1 to 65535)"))
            })?;
        Ok(Some(World {
            rank,
            size,
            local_rank,
            master_addr,
            master_port,
        }))
    }

    /// `MASTER_ADDR:MASTER_PORT`, for messages and connecting.
    pub fn master(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
}

/// The first of `names` that is set, with its value as a count.
fn first(
    get: &impl Fn(&str) -> Option<String>,
    names: &[&'static str],
) -> Result<Option<(&'static str, usize)>> {
    for &name in names {
        if let Some(value) = get(name) {
            let n = value.trim().parse::<usize>().map_err(|_| {
                DistError::Env(format!("{name}={value} is not a non-negative whole number"))
            })?;
            return Ok(Some((name, n)));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn world(vars: &[(&str, &str)]) -> Result<Option<World>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_vars(|name| map.get(name).cloned())
    }

    const MASTER: [(&str, &str); 2] = [("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")];

    #[test]
    fn no_launcher_is_a_single_process_run() {
        assert_eq!(world(&MASTER).unwrap(), None);
    }

    #[test]
    fn torchrun_variables() {
        let mut vars = vec![("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")];
        vars.extend(MASTER);
        let w = world(&vars).unwrap().unwrap();
        assert_eq!((w.rank, w.size, w.local_rank), (3, 4, 1));
        assert_eq!(w.master(), "10.0.0.1:29500");
    }

    #[test]
    fn slurm_and_mpi_variables_when_torchrun_s_are_absent() {
        let mut vars = vec![
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
        ];
        vars.extend(MASTER);
        let w = world(&vars).unwrap().unwrap();
        assert_eq!((w.rank, w.size, w.local_rank), (5, 8, 1));
        let mut vars = vec![
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("SLURM_PROCID", "9"),
        ];
        vars.extend(MASTER);
        // SLURM_PROCID comes before OMPI_COMM_WORLD_RANK
        let err = world(&vars).unwrap_err().to_string();
        assert!(err.contains("SLURM_PROCID=9"), "{err}");
    }

    #[test]
    fn errors_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=x"),
            (&[("RANK", "1")], "WORLD_SIZE"),
            (
                &[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
                "RANK=2 must be below WORLD_SIZE=2",
            ),
            (&[("RANK", "1"), ("WORLD_SIZE", "2")], "LOCAL_RANK"),
            (
                &[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")],
                "MASTER_ADDR is not set",
            ),
            (
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "1"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "70000"),
                ],
                "MASTER_PORT=70000",
            ),
        ];
        for (vars, want) in cases {
            let err = world(vars).unwrap_err().to_string();
            assert!(err.contains(want), "{vars:?}: {err}");
        }
    }
}
