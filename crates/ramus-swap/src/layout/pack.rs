//! Packing: offsets for blocks whose lifetimes and sizes are known, in an
//! arena as small as the heuristics manage (see the [parent](super) docs).

use crate::plan::{Block, Layout};
use crate::trace::TensorId;

/// A block's lifetime and size, before it has an offset.
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    pub(super) tensor: usize,
    pub(super) bytes: u64,
    pub(super) from: usize,
    pub(super) until: usize,
    /// Until the replay found the copy complete (offloaded blocks; else
    /// `until`): memory reused before then makes the reuse wait.
    pub(super) soft_until: usize,
}

/// The most bytes alive at once.
fn max_live(spans: &[Span], n: usize) -> u64 {
    let mut delta = vec![0i128; n + 2];
    for s in spans {
        delta[s.from] += i128::from(s.bytes);
        delta[s.until.min(n + 1)] -= i128::from(s.bytes);
    }
    let mut live = 0i128;
    let mut best = 0i128;
    for d in delta {
        live += d;
        best = best.max(live);
    }
    u64::try_from(best).unwrap_or(u64::MAX)
}

/// For each span, the spans it coexists with, each living until `until`.
fn conflicts(spans: &[Span], until: impl Fn(&Span) -> usize) -> Vec<Vec<usize>> {
    let mut by_from: Vec<usize> = (0..spans.len()).collect();
    by_from.sort_by_key(|&i| spans[i].from);
    let mut conf = vec![Vec::new(); spans.len()];
    for (k, &i) in by_from.iter().enumerate() {
        // later-starting spans that start before this one ends
        for &j in &by_from[k + 1..] {
            if spans[j].from >= until(&spans[i]) {
                break;
            }
            conf[i].push(j);
            conf[j].push(i);
        }
    }
    conf
}

/// The offset for `bytes` among the sorted `busy` ranges: the lowest gap
/// (first fit) or the tightest (best fit) ending at most at `limit`, the
/// space between the last range and `limit` included; `None` if none.
fn fit(busy: &[(u64, u64)], bytes: u64, best_fit: bool, limit: u64) -> Option<u64> {
    let mut at = None::<(u64, u64)>; // (gap, offset)
    let mut cursor = 0u64;
    let gaps = busy
        .iter()
        .map(|&(lo, hi)| (lo, hi))
        .chain(std::iter::once((limit, limit)));
    for (lo, hi) in gaps {
        let lo = lo.min(limit);
        if lo > cursor {
            let gap = lo - cursor;
            if gap >= bytes && at.is_none_or(|(g, _)| best_fit && gap < g) {
                at = Some((gap, cursor));
                if !best_fit {
                    break;
                }
            }
        }
        cursor = cursor.max(hi);
        if cursor >= limit {
            break;
        }
    }
    at.map(|(_, o)| o)
}

/// The spans' conflicts: those alive at once (`hard`: they must not
/// share bytes) and, with reuse waits avoided where possible, those alive
/// at once until their copies complete (`soft`, a superset).
struct Conflicts {
    hard: Vec<Vec<usize>>,
    soft: Option<Vec<Vec<usize>>>,
}

/// Offsets for `spans` placed in `order`, keeping the offsets `previous`
/// gave the first `keep` of them (placed in the same order before, so they
/// come out the same). Each span goes to the lowest gap (first fit) or the
/// tightest (best fit) among the spans it coexists with — with soft
/// conflicts, first among gaps clear of them too, then among those clear
/// of the hard ones, in both cases without raising the arena — else on top.
/// Returns the offsets, the arena size and the span that reaches the top.
fn place_from(
    spans: &[Span],
    conf: &Conflicts,
    order: &[usize],
    best_fit: bool,
    keep: usize,
    previous: &[u64],
) -> (Vec<u64>, u64, usize) {
    let mut offset: Vec<Option<u64>> = vec![None; spans.len()];
    let mut arena = 0;
    let mut top = 0;
    let keep = keep.min(order.len());
    for &i in &order[..keep] {
        let o = previous.get(i).copied().unwrap_or_default();
        offset[i] = Some(o);
        if o + spans[i].bytes > arena {
            arena = o + spans[i].bytes;
            top = i;
        }
    }
    let mut busy: Vec<(u64, u64)> = Vec::new();
    for &i in &order[keep..] {
        let bytes = spans[i].bytes;
        let mut at = None;
        if let Some(soft) = &conf.soft {
            busy_ranges(spans, &mut busy, &soft[i], &offset);
            at = fit(&busy, bytes, best_fit, arena);
        }
        busy_ranges(spans, &mut busy, &conf.hard[i], &offset);
        if at.is_none() && conf.soft.is_some() {
            at = fit(&busy, bytes, best_fit, arena);
        }
        let o = at
            .or_else(|| fit(&busy, bytes, best_fit, u64::MAX))
            .unwrap_or(arena);
        offset[i] = Some(o);
        if o + bytes > arena {
            arena = o + bytes;
            top = i;
        }
    }
    (
        offset.into_iter().map(Option::unwrap_or_default).collect(),
        arena,
        top,
    )
}

/// The ranges the spans `with` hold at their offsets, sorted, in `busy`.
/// Kept out of line: inlined into [`place_from`]'s loop, it makes the loop
/// slower.
#[inline(never)]
fn busy_ranges(spans: &[Span], busy: &mut Vec<(u64, u64)>, with: &[usize], offset: &[Option<u64>]) {
    busy.clear();
    busy.extend(
        with.iter()
            .filter_map(|&j| offset[j].map(|o| (o, o + spans[j].bytes))),
    );
    busy.sort_unstable();
}

/// Iterations of the local search over packing orders, and how many it
/// tries without making the arena smaller before it stops.
const SEARCH_STEPS: usize = 400;
const SEARCH_PATIENCE: usize = 150;

/// A small deterministic generator (xorshift64*), so that a trace always
/// gets the same layout.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..=max`.
    fn up_to(&mut self, max: usize) -> usize {
        (self.next() % (max as u64 + 1)) as usize
    }
}

/// Packs the spans: the best of a few orders and both fits, then a local
/// search that moves the block reaching the top of the arena (or one it
/// sits on) earlier in the order, keeping every change that does not make
/// the arena larger, until the arena is as small as the bytes alive at
/// once (or `target`) or the steps run out. With `soft`, memory offloads
/// may still read is avoided where the arena allows (see [`place_from`]).
pub(super) fn pack_with(spans: &[Span], target: u64, soft: bool) -> Layout {
    let n = spans.iter().map(|s| s.soft_until).max().unwrap_or(0);
    let lower = max_live(spans, n);
    let conf = Conflicts {
        hard: conflicts(spans, |s| s.until),
        soft: soft.then(|| conflicts(spans, |s| s.soft_until)),
    };
    let Some(greedy) = best_greedy(spans, &conf) else {
        return Layout {
            arena_bytes: 0,
            max_live_bytes: 0,
            blocks: Vec::new(),
        };
    };
    let best = local_search(spans, &conf, greedy, lower.max(target));
    Layout {
        arena_bytes: best.arena,
        max_live_bytes: lower,
        blocks: spans
            .iter()
            .zip(best.offsets)
            .map(|(s, offset)| Block {
                tensor: TensorId(s.tensor as u32),
                offset,
                bytes: s.bytes,
                from_op: s.from,
                until_op: s.until,
            })
            .collect(),
    }
}

/// One packing: the order spans were placed in, the fit, the offsets it
/// gave them, the arena and the span that reaches its top.
struct Packing {
    order: Vec<usize>,
    best_fit: bool,
    offsets: Vec<u64>,
    arena: u64,
    top: usize,
}

/// The orders the greedy packing tries.
fn greedy_orders(spans: &[Span]) -> Vec<Vec<usize>> {
    let idx: Vec<usize> = (0..spans.len()).collect();
    let life = |s: &Span| (s.until - s.from) as u64;
    let mut orders: Vec<Vec<usize>> = Vec::new();
    // largest first, longer-lived first among equals
    let mut o = idx.clone();
    o.sort_by_key(|&i| {
        (
            std::cmp::Reverse(spans[i].bytes),
            std::cmp::Reverse(life(&spans[i])),
            i,
        )
    });
    orders.push(o);
    // largest area (bytes x ops) first
    let mut o = idx.clone();
    o.sort_by_key(|&i| {
        (
            std::cmp::Reverse(u128::from(spans[i].bytes) * u128::from(life(&spans[i]))),
            i,
        )
    });
    orders.push(o);
    // longest-lived first, then largest
    let mut o = idx.clone();
    o.sort_by_key(|&i| {
        (
            std::cmp::Reverse(life(&spans[i])),
            std::cmp::Reverse(spans[i].bytes),
            i,
        )
    });
    orders.push(o);
    // in allocation order (what an allocator at run time would see)
    orders.push(idx);
    orders
}

/// The greedy packing with the smallest arena over the orders of
/// [`greedy_orders`] and both fits (the first found among equals).
fn best_greedy(spans: &[Span], conf: &Conflicts) -> Option<Packing> {
    let mut best: Option<Packing> = None;
    for order in greedy_orders(spans) {
        for best_fit in [true, false] {
            let (offsets, arena, top) = place_from(spans, conf, &order, best_fit, 0, &[]);
            if best.as_ref().is_none_or(|b| arena < b.arena) {
                best = Some(Packing {
                    order: order.clone(),
                    best_fit,
                    offsets,
                    arena,
                    top,
                });
            }
        }
    }
    best
}

/// The local search of [`pack_with`] from packing `p`, until the arena is
/// at most `goal` or the steps or the patience run out.
fn local_search(spans: &[Span], conf: &Conflicts, mut p: Packing, goal: u64) -> Packing {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ spans.len() as u64);
    let mut position = vec![0; spans.len()];
    let mut since_better = 0;
    for _ in 0..SEARCH_STEPS {
        if p.arena <= goal || since_better >= SEARCH_PATIENCE {
            break;
        }
        since_better += 1;
        // the top block, or one of those below it that reach near the top
        let top = p.top;
        let near: Vec<usize> = conf.hard[top]
            .iter()
            .copied()
            .filter(|&j| p.offsets[j] + spans[j].bytes + spans[top].bytes > p.arena)
            .collect();
        let pick = if near.is_empty() || rng.next().is_multiple_of(2) {
            top
        } else {
            near[rng.up_to(near.len() - 1)]
        };
        for (k, &i) in p.order.iter().enumerate() {
            position[i] = k;
        }
        let from = position[pick];
        if from == 0 {
            continue;
        }
        let to = rng.up_to(from - 1);
        let mut candidate = p.order.clone();
        let moved = candidate.remove(from);
        candidate.insert(to, moved);
        // the spans before the moved one keep their offsets
        let (o, a, t) = place_from(spans, conf, &candidate, p.best_fit, to, &p.offsets);
        if a < p.arena {
            since_better = 0;
        }
        if a <= p.arena {
            p.order = candidate;
            p.offsets = o;
            p.arena = a;
            p.top = t;
        }
    }
    p
}
