//! Tree-LSTM training traces: a batch of random binary trees, one batched
//! op per level (vertices of equal height) upwards, the head over the
//! roots, the levels' backward top-down, the optimizer.

use super::recorder::{DeviceSpeed, Optimizer, Recorder};
use crate::trace::{Phase, TensorId, TensorKind, Trace, TraceError};

/// A child-sum Tree-LSTM over a batch of random binary trees, scheduled as
/// Cavs does: one batched op per level (vertices of equal height).
#[derive(Clone, Debug, PartialEq)]
pub struct TreeSpec {
    /// Trees per batch.
    pub trees: usize,
    /// Leaves per tree.
    pub leaves: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Seed of the tree shapes.
    pub seed: u64,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Bytes per element.
    pub elem_bytes: u64,
    /// Op durations.
    pub speed: DeviceSpeed,
}

/// SplitMix64: a small deterministic generator for tree shapes.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `1..n` (n >= 2).
    fn split(&mut self, n: usize) -> usize {
        1 + (self.next() % (n as u64 - 1)) as usize
    }
}

/// Builds a random binary tree over `leaves` leaves (uniform random
/// splits); records vertices per height and which child heights each
/// height gathers from. Returns the root's height.
fn grow(
    leaves: usize,
    rng: &mut SplitMix,
    count: &mut Vec<u64>,
    children: &mut Vec<Vec<bool>>,
) -> usize {
    // Iterative post-order to stay safe on deep trees.
    enum Frame {
        Enter(usize),
        Exit,
    }
    let mut stack = vec![Frame::Enter(leaves)];
    let mut heights: Vec<usize> = Vec::new();
    while let Some(f) = stack.pop() {
        match f {
            Frame::Enter(1) => {
                if count.is_empty() {
                    count.push(0);
                    children.push(Vec::new());
                }
                count[0] += 1;
                heights.push(0);
            }
            Frame::Enter(n) => {
                let k = rng.split(n);
                stack.push(Frame::Exit);
                stack.push(Frame::Enter(n - k));
                stack.push(Frame::Enter(k));
            }
            Frame::Exit => {
                let r = heights.pop().unwrap_or(0);
                let l = heights.pop().unwrap_or(0);
                let hgt = 1 + l.max(r);
                while count.len() <= hgt {
                    count.push(0);
                    children.push(Vec::new());
                }
                count[hgt] += 1;
                for c in [l, r] {
                    if children[hgt].len() <= c {
                        children[hgt].resize(c + 1, false);
                    }
                    children[hgt][c] = true;
                }
                heights.push(hgt);
            }
        }
    }
    heights.pop().unwrap_or(0)
}

/// The shape of a batch of trees by level (height): vertices per level,
/// which lower levels each level gathers children from, and the levels of
/// the roots.
struct Levels {
    count: Vec<u64>,
    children: Vec<Vec<bool>>,
    roots: Vec<usize>,
}

impl Levels {
    /// The levels of `spec`'s random trees.
    fn grow(spec: &TreeSpec) -> Levels {
        let mut rng = SplitMix(spec.seed);
        let mut count = Vec::new();
        let mut children: Vec<Vec<bool>> = Vec::new();
        let mut roots = Vec::new();
        for _ in 0..spec.trees {
            roots.push(grow(
                spec.leaves.max(1),
                &mut rng,
                &mut count,
                &mut children,
            ));
        }
        roots.sort_unstable();
        roots.dedup();
        Levels {
            count,
            children,
            roots,
        }
    }

    fn len(&self) -> usize {
        self.count.len()
    }

    /// The lower levels level `l` gathers children from.
    fn kids(&self, l: usize) -> Vec<usize> {
        self.children
            .get(l)
            .map(|c| {
                c.iter()
                    .enumerate()
                    .filter(|(_, &on)| on)
                    .map(|(i, _)| i)
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The Tree-LSTM generator: the recorder, the levels and each level's
/// tensors.
struct TreeGen<'a> {
    spec: &'a TreeSpec,
    r: Recorder,
    levels: Levels,
    /// Per level: the gates, cell and hidden states of its vertices.
    gs: Vec<TensorId>,
    cs: Vec<TensorId>,
    hs: Vec<TensorId>,
}

impl TreeSpec {
    /// A batch of large trees with Adam.
    pub fn new(
        trees: usize,
        leaves: usize,
        hidden: usize,
        seed: u64,
        speed: DeviceSpeed,
    ) -> TreeSpec {
        TreeSpec {
            trees,
            leaves,
            hidden,
            seed,
            optimizer: Optimizer::Adam,
            elem_bytes: 4,
            speed,
        }
    }

    /// Generates the iteration: the leaves' op, one op per level upwards,
    /// the head over the roots, the levels' backward ops top-down, the
    /// optimizer.
    pub fn trace(&self) -> Result<Trace, TraceError> {
        if self.trees == 0 || self.leaves == 0 {
            return Err(TraceError::Spec(format!(
                "a tree batch needs at least one tree and one leaf ({} trees of {} leaves)",
                self.trees, self.leaves
            )));
        }
        let (h, eb) = (self.hidden as u64, self.elem_bytes);
        let mut g = TreeGen {
            spec: self,
            r: Recorder::new(self.speed, self.optimizer, eb),
            levels: Levels::grow(self),
            gs: Vec::new(),
            cs: Vec::new(),
            hs: Vec::new(),
        };
        let leaf = g.r.params("leaf", &[("w", 3 * h * h), ("b", 3 * h)]);
        let internal =
            g.r.params("internal", &[("u", 5 * h * 2 * h), ("b", 5 * h)]);
        let leaves = g.levels.count.first().copied().unwrap_or(0);
        let tokens = g.r.tensor("tokens", leaves * 8, TensorKind::Activation);
        g.level_tensors();
        g.forward(tokens, &leaf.0, &internal.0);
        let (dh, dc) = g.head();
        g.backward(&dh, &dc, tokens, &leaf.1, &internal);
        g.r.finish()
    }
}

impl TreeGen<'_> {
    /// Each level's gates, cell and hidden states.
    fn level_tensors(&mut self) {
        let (h, eb) = (self.spec.hidden as u64, self.spec.elem_bytes);
        for (l, &v) in self.levels.count.iter().enumerate() {
            let gates = if l == 0 { 3 } else { 5 };
            self.gs.push(self.r.tensor(
                format!("level{l}.gates"),
                v * gates * h * eb,
                TensorKind::Activation,
            ));
            self.cs.push(
                self.r
                    .tensor(format!("level{l}.c"), v * h * eb, TensorKind::Activation),
            );
            self.hs.push(
                self.r
                    .tensor(format!("level{l}.h"), v * h * eb, TensorKind::Activation),
            );
        }
    }

    /// FLOPs of level `l`'s forward op.
    fn level_flops(&self, l: usize) -> f64 {
        let h = self.spec.hidden as u64;
        let v = self.levels.count[l] as f64;
        if l == 0 {
            2.0 * v * (3 * h * h) as f64
        } else {
            2.0 * v * (5 * h * 2 * h) as f64
        }
    }

    /// The leaves' op over `tokens` with the leaf parameters `lp`, then one
    /// op per level upwards with the internal parameters `ip`.
    fn forward(&mut self, tokens: TensorId, lp: &[TensorId], ip: &[TensorId]) {
        let leaf_flops = self.level_flops(0);
        self.r.op(
            "leaves",
            Phase::Forward,
            &[tokens, lp[0], lp[1]],
            &[self.gs[0], self.cs[0], self.hs[0]],
            leaf_flops,
        );
        for l in 1..self.levels.len() {
            let mut reads: Vec<TensorId> = Vec::new();
            for k in self.levels.kids(l) {
                reads.push(self.hs[k]);
                reads.push(self.cs[k]);
            }
            reads.extend([ip[0], ip[1]]);
            let flops = self.level_flops(l);
            self.r.op(
                format!("level{l}"),
                Phase::Forward,
                &reads,
                &[self.gs[l], self.cs[l], self.hs[l]],
                flops,
            );
        }
    }

    /// The head over the roots, the loss and the head's backward; returns
    /// every level's hidden and cell state gradients.
    fn head(&mut self) -> (Vec<TensorId>, Vec<TensorId>) {
        let (h, eb) = (self.spec.hidden as u64, self.spec.elem_bytes);
        let r = &mut self.r;
        let classes = 5u64;
        let (hp, hg) = r.params("head", &[("w", classes * h)]);
        let nroots = self.spec.trees as u64;
        let l = r.loss_tensors(nroots, classes);
        let roots = &self.levels.roots;
        let mut reads: Vec<TensorId> = roots.iter().map(|&l| self.hs[l]).collect();
        reads.push(hp[0]);
        let head_flops = 2.0 * (nroots * classes * h) as f64;
        r.op("head", Phase::Forward, &reads, &[l.logits], head_flops);
        r.softmax_xent(&l);
        let count = &self.levels.count;
        let mut level_grads = |what: &str| -> Vec<TensorId> {
            (0..count.len())
                .map(|l| {
                    r.tensor(
                        format!("level{l}.{what}.grad"),
                        count[l] * h * eb,
                        TensorKind::Gradient,
                    )
                })
                .collect()
        };
        let dh = level_grads("h");
        let dc = level_grads("c");
        let mut reads = vec![l.dlogits, hp[0]];
        reads.extend(roots.iter().map(|&l| self.hs[l]));
        let mut writes: Vec<TensorId> = roots.iter().map(|&l| dh[l]).collect();
        writes.push(hg[0]);
        r.op(
            "head.bwd",
            Phase::Backward,
            &reads,
            &writes,
            2.0 * head_flops,
        );
        (dh, dc)
    }

    /// The levels' backward ops top-down, then the leaves', accumulating
    /// into the gradients `lg` of the leaf parameters and `ig` of the
    /// internal parameters `ip`.
    fn backward(
        &mut self,
        dh: &[TensorId],
        dc: &[TensorId],
        tokens: TensorId,
        lg: &[TensorId],
        (ip, ig): &(Vec<TensorId>, Vec<TensorId>),
    ) {
        let levels = self.levels.len();
        for l in (1..levels).rev() {
            let mut reads = vec![dh[l], self.gs[l], self.cs[l], ip[0], ig[0], ig[1]];
            if l + 1 < levels {
                reads.push(dc[l]);
            }
            let mut writes = vec![ig[0], ig[1]];
            for k in self.levels.kids(l) {
                reads.extend([self.hs[k], self.cs[k], dh[k], dc[k]]);
                writes.extend([dh[k], dc[k]]);
            }
            let flops = 2.0 * self.level_flops(l);
            self.r.op(
                format!("level{l}.bwd"),
                Phase::Backward,
                &reads,
                &writes,
                flops,
            );
        }
        let flops = 2.0 * self.level_flops(0);
        self.r.op(
            "leaves.bwd",
            Phase::Backward,
            &[dh[0], dc[0], self.gs[0], self.cs[0], tokens, lg[0], lg[1]],
            &[lg[0], lg[1]],
            flops,
        );
    }
}
