//! A CPU simulator of a batch's packed scripts, checking every executed
//! instruction against the task graph: the scheduler's tests use it as the
//! oracle.

use super::isa::{INLINE_ITEMS, OP_FIRST_ENGINE, OP_SIGNAL, OP_WAIT, WIDE_ITEMS};
use super::schedule::BatchScripts;
use super::script::Instr;
use super::task::{check_task, Placement, VppTask, VppTaskGraph};
use crate::error::{CoreError, Result};

/// What a simulated run did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Simulation {
    /// Task ids in the order they completed (on the last of their VPPs).
    pub order: Vec<u32>,
    /// Every `(vpp, task)` execution, in simulated time order.
    pub executions: Vec<(u32, u32)>,
    /// Final signal count of each barrier.
    pub barrier_counts: Vec<u32>,
    /// Instructions executed, control instructions included.
    pub steps: usize,
}

/// Runs `schedule`'s packed scripts on the CPU, one instruction per turn,
/// visiting the VPPs round-robin, and returns the order in which tasks
/// completed. See [`simulate_with`] for the checks.
pub fn simulate(schedule: &BatchScripts, g: &VppTaskGraph) -> Result<Vec<u32>> {
    let mut last: Option<u32> = None;
    let sim = simulate_with(schedule, g, |runnable| {
        let at = last
            .and_then(|p| runnable.iter().position(|&v| v > p))
            .unwrap_or(0);
        last = runnable.get(at).copied();
        at
    })?;
    Ok(sim.order)
}

/// One VPP's place in its decoded script.
struct Cursor {
    instrs: Vec<Instr>,
    pc: usize,
    task: usize,
}

fn sim_err(message: String) -> CoreError {
    CoreError::vpps("simulation", message)
}

/// Runs `schedule`'s packed scripts on the CPU. Before each instruction,
/// `choose` gets the VPPs that can run (not finished, not blocked on a `WAIT`
/// whose barrier is short of its expectation), ascending, and returns the
/// position of the one that runs next (taken modulo the list's length).
///
/// Errors when the graph has a forward dependency, the scripts deadlock, a
/// barrier is unknown or signalled more often than expected, an instruction
/// does not match the task [`BatchScripts::vpp_tasks`] says it runs (opcode, arg,
/// operands, or for a merged instruction the operand-pool slice), a task runs
/// before all its dependencies completed on all their VPPs, or a task does
/// not run on exactly the VPPs of [`BatchScripts::task_vpps`].
pub fn simulate_with(
    schedule: &BatchScripts,
    g: &VppTaskGraph,
    mut choose: impl FnMut(&[u32]) -> usize,
) -> Result<Simulation> {
    let (mut run, mut cursors) = Run::new(schedule, g)?;
    let mut runnable: Vec<u32> = Vec::with_capacity(schedule.packed.vpps);
    loop {
        let blocked = run.runnable(&cursors, &mut runnable)?;
        if runnable.is_empty() {
            if blocked.is_empty() {
                break;
            }
            return Err(sim_err(format!("deadlock: {}", blocked.join("; "))));
        }
        let v = runnable[choose(&runnable) % runnable.len()] as usize;
        run.step(v, &mut cursors[v])?;
    }
    run.finish(&cursors)
}

/// A simulated run in progress: barrier counts, and per task how many of
/// its VPPs ran it.
struct Run<'a> {
    schedule: &'a BatchScripts,
    g: &'a VppTaskGraph,
    expect: &'a [u32],
    pool: &'a [u32],
    counts: Vec<u32>,
    done: Vec<usize>,
    sim: Simulation,
}

impl<'a> Run<'a> {
    /// Checks that `schedule` and `g` go together and decodes every
    /// script.
    fn new(schedule: &'a BatchScripts, g: &'a VppTaskGraph) -> Result<(Self, Vec<Cursor>)> {
        let packed = &schedule.packed;
        let n = g.tasks.len();
        if schedule.task_vpps.len() != n || schedule.vpp_tasks.len() != packed.vpps {
            return Err(sim_err(format!(
                "schedule for {} tasks on {} VPPs does not match a graph of {n} tasks and {} \
                 scripts",
                schedule.task_vpps.len(),
                schedule.vpp_tasks.len(),
                packed.vpps
            )));
        }
        for (i, t) in g.tasks.iter().enumerate() {
            check_task(i, t)?;
        }
        let mut cursors = Vec::with_capacity(packed.vpps);
        for v in 0..packed.vpps {
            cursors.push(Cursor {
                instrs: packed.decode_script(v)?,
                pc: 0,
                task: 0,
            });
        }
        let run = Run {
            schedule,
            g,
            expect: packed.barrier_expects(),
            pool: packed.operand_pool(),
            counts: vec![0u32; packed.barriers],
            done: vec![0usize; n],
            sim: Simulation {
                order: Vec::new(),
                executions: Vec::new(),
                barrier_counts: Vec::new(),
                steps: 0,
            },
        };
        Ok((run, cursors))
    }

    /// Fills `runnable` with the VPPs that can run, ascending; returns why
    /// the others that have not finished are blocked.
    fn runnable(&self, cursors: &[Cursor], runnable: &mut Vec<u32>) -> Result<Vec<String>> {
        runnable.clear();
        let mut blocked = Vec::new();
        for (v, c) in cursors.iter().enumerate() {
            let Some(instr) = c.instrs.get(c.pc) else {
                continue;
            };
            if instr.op == OP_WAIT {
                let b = usize::from(instr.arg);
                let (Some(&have), Some(&want)) = (self.counts.get(b), self.expect.get(b)) else {
                    return Err(sim_err(format!("vpp {v} waits on unknown barrier {b}")));
                };
                if have < want {
                    blocked.push(format!("vpp {v} waits on barrier {b} ({have} of {want})"));
                    continue;
                }
            }
            runnable.push(v as u32);
        }
        Ok(blocked)
    }

    /// Runs the next instruction of VPP `v`, whose place is `c`.
    fn step(&mut self, v: usize, c: &mut Cursor) -> Result<()> {
        let instr = &c.instrs[c.pc];
        c.pc += 1;
        self.sim.steps += 1;
        match instr.op {
            OP_WAIT => {}
            OP_SIGNAL => {
                let b = usize::from(instr.arg);
                let (Some(have), Some(&want)) = (self.counts.get_mut(b), self.expect.get(b)) else {
                    return Err(sim_err(format!("vpp {v} signals unknown barrier {b}")));
                };
                *have += 1;
                if *have > want {
                    return Err(sim_err(format!(
                        "vpp {v} signals barrier {b} beyond its expected {want}"
                    )));
                }
            }
            op if op < OP_FIRST_ENGINE => {
                return Err(sim_err(format!(
                    "vpp {v}: reserved opcode {op} at instruction {}",
                    c.pc - 1
                )));
            }
            _ => {
                let ran = self.tasks_run(v, instr, c.pc - 1, c.task)?;
                c.task += ran.len();
                self.complete(v, ran)?;
            }
        }
        Ok(())
    }

    /// The tasks engine instruction `instr` (number `at` of VPP `v`'s
    /// script) runs, its first one number `next` of the VPP's tasks,
    /// checked against the graph.
    fn tasks_run(&self, v: usize, instr: &Instr, at: usize, next: usize) -> Result<&'a [u32]> {
        let tasks = &self.schedule.vpp_tasks[v];
        let Some(&first) = tasks.get(next) else {
            return Err(sim_err(format!(
                "vpp {v}: instruction {at} has no scheduled task"
            )));
        };
        let task = self.g.tasks.get(first as usize).ok_or_else(|| {
            sim_err(format!(
                "vpp {v}: scheduled task {first} is not in the graph"
            ))
        })?;
        let mismatch = |what: &str| {
            sim_err(format!(
                "vpp {v}: instruction {at} does not match task {first}: {what}"
            ))
        };
        if instr.op != task.op || instr.arg != task.arg {
            return Err(mismatch("opcode or arg"));
        }
        if let Placement::Holders { .. } = task.placement {
            return self.merged_tasks(v, instr, next, task, mismatch);
        }
        if instr.operands != task.operands {
            return Err(mismatch("operands"));
        }
        Ok(std::slice::from_ref(&tasks[next]))
    }

    /// The tasks a merged instruction on a cached matrix runs (its first
    /// one `task`, number `next` of VPP `v`'s tasks), their operands
    /// checked against its items.
    fn merged_tasks(
        &self,
        v: usize,
        instr: &Instr,
        next: usize,
        task: &VppTask,
        mismatch: impl Fn(&str) -> CoreError,
    ) -> Result<&'a [u32]> {
        let g = self.g;
        let tasks = &self.schedule.vpp_tasks[v];
        // the merged items: inline after the count, or at an offset of the
        // operand pool (a wide one's VPP range follows the count)
        let skip = match instr.operands.first() {
            Some(&count) if count & WIDE_ITEMS != 0 => 1,
            _ => 0,
        };
        let (count, items): (u32, &[u32]) = match instr.operands[..] {
            [count, ..] if count & INLINE_ITEMS != 0 => (
                count & !(INLINE_ITEMS | WIDE_ITEMS),
                instr.operands.get(1 + skip..).unwrap_or(&[]),
            ),
            [count, .., offset] if instr.operands.len() == 2 + skip => (
                count & !WIDE_ITEMS,
                self.pool.get(offset as usize..).unwrap_or(&[]),
            ),
            _ => {
                return Err(mismatch(
                    "a merged instruction needs [count, offset] or inline items",
                ))
            }
        };
        // tasks merged into the instruction: `count` tasks, or as many as
        // carry `count` items
        let merged = match self.schedule.holder_item {
            0 => count as usize,
            item => {
                let (mut items, mut k) = (0usize, 0usize);
                while items < count as usize {
                    let t = tasks
                        .get(next + k)
                        .ok_or_else(|| mismatch("count runs past the scheduled tasks"))?;
                    let words = g.tasks.get(*t as usize).map_or(0, |x| x.operands.len());
                    items += words / item;
                    k += 1;
                }
                if items != count as usize {
                    return Err(mismatch("count splits a task's items"));
                }
                k
            }
        };
        let ran = tasks
            .get(next..next + merged)
            .ok_or_else(|| mismatch("count runs past the scheduled tasks"))?;
        let mut at = 0;
        for &t in ran {
            let other = g.tasks.get(t as usize).ok_or_else(|| {
                sim_err(format!("vpp {v}: scheduled task {t} is not in the graph"))
            })?;
            if other.op != task.op || other.arg != task.arg || other.placement != task.placement {
                return Err(mismatch("merged tasks differ in opcode, arg or matrix"));
            }
            let end = at + other.operands.len();
            if items.get(at..end) != Some(&other.operands[..]) {
                return Err(mismatch("merged operand items"));
            }
            at = end;
        }
        Ok(ran)
    }

    /// Records that VPP `v` ran tasks `ran`, each after its dependencies
    /// completed and on one of its VPPs.
    fn complete(&mut self, v: usize, ran: &[u32]) -> Result<()> {
        let schedule = self.schedule;
        for &t in ran {
            let tu = t as usize;
            for &d in &self.g.tasks[tu].deps {
                let du = d as usize;
                if self.done[du] < schedule.task_vpps[du].len() {
                    return Err(sim_err(format!(
                        "task {t} ran on vpp {v} before its dependency {d} completed \
                         ({} of {} VPPs)",
                        self.done[du],
                        schedule.task_vpps[du].len()
                    )));
                }
            }
            if !schedule.task_vpps[tu].contains(&(v as u32)) {
                return Err(sim_err(format!(
                    "task {t} ran on vpp {v}, not one of its VPPs {:?}",
                    schedule.task_vpps[tu]
                )));
            }
            self.done[tu] += 1;
            self.sim.executions.push((v as u32, t));
            if self.done[tu] == schedule.task_vpps[tu].len() {
                self.sim.order.push(t);
            }
        }
        Ok(())
    }

    /// Checks that every VPP ran all its tasks and every task ran on all
    /// its VPPs.
    fn finish(self, cursors: &[Cursor]) -> Result<Simulation> {
        let schedule = self.schedule;
        for (v, c) in cursors.iter().enumerate() {
            if c.task != schedule.vpp_tasks[v].len() {
                return Err(sim_err(format!(
                    "vpp {v} finished its script after {} of its {} tasks",
                    c.task,
                    schedule.vpp_tasks[v].len()
                )));
            }
        }
        let done = &self.done;
        if let Some(t) =
            (0..done.len()).find(|&t| done[t] != schedule.task_vpps[t].len() || done[t] == 0)
        {
            return Err(sim_err(format!(
                "task {t} ran {} times, scheduled on VPPs {:?}",
                done[t], schedule.task_vpps[t]
            )));
        }
        let mut sim = self.sim;
        sim.barrier_counts = self.counts;
        Ok(sim)
    }
}
