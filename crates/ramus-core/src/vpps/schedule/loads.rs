//! The least-loaded VPP, over the batch ([`MinLoad`]) or per level
//! ([`LevelLoads`]): the scheduler's lookups for `Any` tasks.

/// Minimum-load lookup over VPPs: a tournament tree whose nodes hold the
/// index of the least-loaded VPP below them (ties to the lower index).
/// Cached-matrix work adds load to a hundred holders at once; those adds
/// ([`MinLoad::add_lazy`]) only mark the leaves, and the tree catches up
/// at a lookup when few are marked, else every [`MinLoad::FLUSH_EVERY`]
/// lookups.
pub(super) struct MinLoad {
    size: usize,
    tree: Vec<u32>,
    pub(super) loads: Vec<u64>,
    dirty: Vec<bool>,
    dirty_list: Vec<u32>,
    lookups: u32,
}

impl MinLoad {
    const NONE: u32 = u32::MAX;

    pub(super) fn new(n: usize) -> Self {
        let size = n.max(1).next_power_of_two();
        let mut tree = vec![Self::NONE; 2 * size];
        for (i, slot) in tree[size..size + n].iter_mut().enumerate() {
            *slot = i as u32;
        }
        let mut m = MinLoad {
            size,
            tree,
            loads: vec![0; n],
            dirty: vec![false; n],
            dirty_list: Vec::new(),
            lookups: 0,
        };
        for k in (1..size).rev() {
            m.tree[k] = lighter(&m.loads, m.tree[2 * k], m.tree[2 * k + 1]);
        }
        m
    }

    /// Lookups between two catch-ups of lazily added load.
    const FLUSH_EVERY: u32 = 16;

    /// Fewer lazily added leaves than this are caught up at every lookup.
    const FLUSH_SMALL: usize = 32;

    pub(super) fn argmin(&mut self) -> u32 {
        self.lookups += 1;
        if self.lookups >= Self::FLUSH_EVERY || self.dirty_list.len() <= Self::FLUSH_SMALL {
            self.flush();
        }
        self.tree[1]
    }

    /// Brings the tree up to date with every lazily added load.
    fn flush(&mut self) {
        self.lookups = 0;
        while let Some(v) = self.dirty_list.pop() {
            self.dirty[v as usize] = false;
            self.update(v as usize);
        }
    }

    pub(super) fn add(&mut self, vpp: usize, amount: u64) {
        self.loads[vpp] = self.loads[vpp].saturating_add(amount);
        self.update(vpp);
    }

    /// Adds load without updating the tree until the next catch-up.
    pub(super) fn add_lazy(&mut self, vpp: usize, amount: u64) {
        self.loads[vpp] = self.loads[vpp].saturating_add(amount);
        if !self.dirty[vpp] {
            self.dirty[vpp] = true;
            self.dirty_list.push(vpp as u32);
        }
    }

    fn update(&mut self, vpp: usize) {
        repick_above(&mut self.tree, &self.loads, vpp);
    }
}

/// Of two entries of a load tree (VPP indices, or [`MinLoad::NONE`]), the
/// one with less load (ties to `a`).
fn lighter(loads: &[u64], a: u32, b: u32) -> u32 {
    match (a, b) {
        (MinLoad::NONE, _) => b,
        (_, MinLoad::NONE) => a,
        _ if loads[b as usize] < loads[a as usize] => b,
        _ => a,
    }
}

/// Re-picks the nodes of the load tree `tree` (a power-of-two leaf count:
/// half its length) on the path above leaf `vpp`.
fn repick_above(tree: &mut [u32], loads: &[u64], vpp: usize) {
    let mut k = (tree.len() / 2 + vpp) / 2;
    while k >= 1 {
        tree[k] = lighter(loads, tree[2 * k], tree[2 * k + 1]);
        k /= 2;
    }
}

/// Per level, the `Any` load of every VPP and a tournament tree over it
/// (see [`MinLoad`]; no lazy adds): the levels' trees side by side in one
/// buffer, a new level's copied from the all-zero template.
pub(super) struct LevelLoads {
    n: usize,
    size: usize,
    template: Vec<u32>,
    trees: Vec<u32>,
    pub(super) loads: Vec<u64>,
}

impl LevelLoads {
    pub(super) fn new(n: usize) -> Self {
        let zero = MinLoad::new(n);
        LevelLoads {
            n,
            size: zero.size,
            template: zero.tree,
            trees: Vec::new(),
            loads: Vec::new(),
        }
    }

    /// Makes room for `level` (levels appear at most one past the deepest).
    fn reach(&mut self, level: usize) {
        while self.loads.len() <= level * self.n {
            self.trees.extend_from_slice(&self.template);
            self.loads.resize(self.loads.len() + self.n, 0);
        }
    }

    pub(super) fn argmin(&mut self, level: usize) -> u32 {
        self.reach(level);
        self.trees[level * 2 * self.size + 1]
    }

    pub(super) fn add(&mut self, level: usize, vpp: usize, amount: u64) {
        self.reach(level);
        let loads = &mut self.loads[level * self.n..(level + 1) * self.n];
        loads[vpp] = loads[vpp].saturating_add(amount);
        let tree = &mut self.trees[level * 2 * self.size..(level + 1) * 2 * self.size];
        repick_above(tree, loads, vpp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_load_matches_a_scan() {
        for n in [1usize, 2, 3, 5, 8, 13] {
            let mut m = MinLoad::new(n);
            let mut naive = vec![0u64; n];
            for step in 0..200u64 {
                let want = (0..n).min_by_key(|&v| (naive[v], v)).unwrap_or(0);
                assert_eq!(m.argmin() as usize, want, "n {n} step {step}");
                let v = ((step * 7 + 3) % n as u64) as usize;
                let amount = (step * 31) % 11;
                m.add(v, amount);
                naive[v] += amount;
            }
        }
    }
}
