//! Launch phases: a batch's task DAG cut at its *host tasks* (work the
//! host enqueues between two launches of the persistent kernel, such as a
//! wide level's product as one cuBLAS GEMM) into the kernel launches around
//! them.
//!
//! A kernel task runs in the first launch after everything it depends on:
//! the launch of a kernel dependency, or the launch after a host
//! dependency. A host task runs after the launch of its last kernel
//! dependency (host tasks after one launch run in task order, so one may
//! depend on another). Each launch's tasks keep their order and have their
//! dependencies renumbered within the launch; dependencies on earlier
//! launches and on host tasks are dropped, since the stream orders them.

use super::isa::OP_HOST;
use super::task::{VppTask, VppTaskGraph};
use crate::{CoreError, Result};

/// One launch of the kernel and the host work that follows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Launch {
    /// The launch's tasks (may be empty: then only its host work runs).
    pub graph: VppTaskGraph,
    /// First operands of the host tasks to run after the launch, in order.
    pub host_after: Vec<u32>,
}

/// Splits `g` at its host tasks (see the module docs). A graph without
/// host tasks is one launch, moved, not copied. Errors for a host task
/// without an operand naming its work.
pub fn split_launches(g: VppTaskGraph) -> Result<Vec<Launch>> {
    if !g.tasks.iter().any(|t| t.op == OP_HOST) {
        return Ok(vec![Launch {
            graph: g,
            host_after: Vec::new(),
        }]);
    }
    // each task's launch (kernel tasks) or the launch it follows (host)
    let mut launch_of = vec![0usize; g.tasks.len()];
    for (i, t) in g.tasks.iter().enumerate() {
        let host = t.op == OP_HOST;
        launch_of[i] = t
            .deps
            .iter()
            .map(|&d| {
                let d = d as usize;
                let after_host = g.tasks[d].op == OP_HOST && !host;
                launch_of[d] + usize::from(after_host)
            })
            .max()
            .unwrap_or(0);
    }
    let count = launch_of.iter().max().map_or(1, |&l| l + 1);
    let mut launches = vec![Launch::default(); count];
    // a kernel task's id within its launch
    let mut local = vec![u32::MAX; g.tasks.len()];
    for (i, t) in g.tasks.into_iter().enumerate() {
        let at = launch_of[i];
        if t.op == OP_HOST {
            let work = *t.operands.first().ok_or_else(|| {
                CoreError::vpps("launches", format!("host task {i} names no work"))
            })?;
            launches[at].host_after.push(work);
            continue;
        }
        let deps = t
            .deps
            .iter()
            .filter(|&&d| local[d as usize] != u32::MAX && launch_of[d as usize] == at)
            .map(|&d| local[d as usize])
            .collect();
        local[i] = launches[at].graph.push(VppTask { deps, ..t })?;
    }
    Ok(launches)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vpps::task::Placement;
    use crate::vpps::OP_FIRST_ENGINE;

    fn task(op: u8, operands: Vec<u32>, deps: Vec<u32>) -> VppTask {
        VppTask {
            op,
            arg: 0,
            operands,
            deps,
            load: 1,
            placement: Placement::Any,
        }
    }

    fn kernel(id: u32, deps: Vec<u32>) -> VppTask {
        task(OP_FIRST_ENGINE, vec![id], deps)
    }

    fn graph(tasks: Vec<VppTask>) -> VppTaskGraph {
        let mut g = VppTaskGraph::new();
        for t in tasks {
            g.push(t).unwrap();
        }
        g
    }

    /// The kernel tasks' first operands per launch, and the host work.
    fn shape(launches: &[Launch]) -> Vec<(Vec<u32>, Vec<u32>)> {
        launches
            .iter()
            .map(|l| {
                let ids = l.graph.tasks.iter().map(|t| t.operands[0]).collect();
                (ids, l.host_after.clone())
            })
            .collect()
    }

    #[test]
    fn a_graph_without_host_tasks_is_one_launch_unchanged() {
        let g = graph(vec![kernel(0, vec![]), kernel(1, vec![0])]);
        let launches = split_launches(g.clone()).unwrap();
        assert_eq!(launches.len(), 1);
        assert_eq!(launches[0].graph, g);
        assert!(launches[0].host_after.is_empty());
    }

    #[test]
    fn kernel_work_after_a_host_task_moves_to_the_next_launch() {
        // 0 -> host(7) -> 2 -> 3;  1 independent;  4 depends on 1 and 3
        let g = graph(vec![
            kernel(0, vec![]),
            kernel(1, vec![]),
            task(OP_HOST, vec![7], vec![0]),
            kernel(2, vec![2]),
            kernel(3, vec![3]),
            kernel(4, vec![1, 4]),
        ]);
        let launches = split_launches(g).unwrap();
        assert_eq!(
            shape(&launches),
            vec![(vec![0, 1], vec![7]), (vec![2, 3, 4], vec![])]
        );
        // renumbered within the launch; the dependency on task 1 (launch 0)
        // is dropped, the one on 3 kept as local id 1
        let second = &launches[1].graph.tasks;
        assert_eq!(second[0].deps, Vec::<u32>::new());
        assert_eq!(second[1].deps, vec![0]);
        assert_eq!(second[2].deps, vec![1]);
    }

    #[test]
    fn chained_host_tasks_follow_one_launch_in_order() {
        // 0 -> host(5) -> host(6) -> 1; host(8) without dependencies
        let g = graph(vec![
            kernel(0, vec![]),
            task(OP_HOST, vec![5], vec![0]),
            task(OP_HOST, vec![6], vec![1]),
            task(OP_HOST, vec![8], vec![]),
            kernel(1, vec![2]),
            task(OP_HOST, vec![9], vec![4]),
            kernel(2, vec![5, 0]),
        ]);
        let launches = split_launches(g).unwrap();
        assert_eq!(
            shape(&launches),
            vec![
                (vec![0], vec![5, 6, 8]),
                (vec![1], vec![9]),
                (vec![2], vec![])
            ]
        );
    }

    #[test]
    fn a_host_task_without_work_is_named() {
        let g = graph(vec![kernel(0, vec![]), task(OP_HOST, vec![], vec![0])]);
        let e = split_launches(g).unwrap_err().to_string();
        assert!(e.contains("host task 1"), "{e}");
    }
}
