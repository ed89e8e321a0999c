//! Union-find over graph nodes and the cycle-safe merges of the fusion pass.

use crate::graph::NodeId;

/// Union-find over graph nodes (union by size); each root holds its members.
pub(super) struct Groups {
    parent: Vec<NodeId>,
    pub(super) members: Vec<Vec<NodeId>>,
}

impl Groups {
    pub(super) fn new(n: usize) -> Self {
        Groups {
            parent: (0..n).collect(),
            members: (0..n).map(|i| vec![i]).collect(),
        }
    }
    /// The root of `x`'s group (union by size keeps the chains short).
    pub(super) fn find(&self, mut x: NodeId) -> NodeId {
        while self.parent[x] != x {
            x = self.parent[x];
        }
        x
    }
    fn union(&mut self, a: NodeId, b: NodeId) {
        let (big, small) = if self.members[a].len() >= self.members[b].len() {
            (a, b)
        } else {
            (b, a)
        };
        self.parent[small] = big;
        let moved = std::mem::take(&mut self.members[small]);
        self.members[big].extend(moved);
    }
}

/// State of the fusion pass over one graph.
pub(super) struct Fuser {
    pub(super) users: Vec<Vec<NodeId>>,
    pub(super) groups: Groups,
    /// Scratch for reachability searches.
    pub(super) seen: Vec<bool>,
    pub(super) stack: Vec<NodeId>,
}

impl Fuser {
    /// True if some path leaves unit `from`, passes through a third unit and
    /// reaches unit `to` (both roots). In the graph of units (a group is one
    /// unit, every other node its own) such a path would close a cycle once
    /// `from` and `to` are merged; direct edges `from → to` are harmless.
    fn path_through_other(&mut self, from: NodeId, to: NodeId) -> bool {
        let Fuser {
            users,
            groups,
            seen,
            stack,
        } = self;
        seen.iter_mut().for_each(|s| *s = false);
        stack.clear();
        for &m in &groups.members[from] {
            stack.extend(users[m].iter().copied().filter(|&u| {
                let r = groups.find(u);
                r != from && r != to
            }));
        }
        while let Some(w) = stack.pop() {
            if seen[w] {
                continue;
            }
            let r = groups.find(w);
            if r == to {
                return true;
            }
            // reaching a unit means waiting for all of it: go on from every member
            for &m in &groups.members[r] {
                seen[m] = true;
                stack.extend(users[m].iter().copied().filter(|&u| !seen[u]));
            }
        }
        false
    }

    /// Merges the groups of `producer` and its user `consumer` unless that
    /// closes a cycle. Only a path producer group → third unit → consumer
    /// group can: a path back from the consumer's group to the producer's
    /// would already be a cycle through the edge `producer → consumer`.
    pub(super) fn try_merge(&mut self, producer: NodeId, consumer: NodeId) -> bool {
        let (rp, rc) = (self.groups.find(producer), self.groups.find(consumer));
        if rp == rc || self.path_through_other(rp, rc) {
            return false;
        }
        self.groups.union(rp, rc);
        true
    }

    /// Merges the groups of `a` and `b`, two readers of a common value,
    /// unless that closes a cycle. Neither group need feed the other, so
    /// paths through a third unit are ruled out in both directions.
    pub(super) fn try_merge_siblings(&mut self, a: NodeId, b: NodeId) -> bool {
        let (ra, rb) = (self.groups.find(a), self.groups.find(b));
        if ra == rb || self.path_through_other(ra, rb) || self.path_through_other(rb, ra) {
            return false;
        }
        self.groups.union(ra, rb);
        true
    }
}
