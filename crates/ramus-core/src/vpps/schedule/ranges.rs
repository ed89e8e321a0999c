//! Wide products: a level's large register products dealt over ranges of
//! VPPs, one per piece of their GEMM.

use crate::vpps::wide::{wide_tiles, wide_work};

/// A level's wide product: its opcode, matrix shape and item count.
#[derive(Clone, Copy, Debug)]
pub(super) struct WideProduct {
    pub(super) op: u8,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) count: usize,
}

/// Deals a level's wide products (`products`, in instruction order) over
/// VPP ranges, `ranges[i] = (first, n)`: VPPs `first, first + 1, …
/// (mod vpps)`, one per GEMM piece.
///
/// The products share a *region*: the longest circular run of VPPs that are
/// not `busy` with the level's other work (its `Any` tasks, its register
/// products' holders) where that is at least half of them, else every VPP
/// starting at `next` (which then moves past the last range, so that
/// successive levels' small products rotate over the VPPs). Each product
/// gets a share of the region in proportion to its tile steps
/// ([`wide_work`]) and as many of those VPPs as it has pieces; the shares
/// do not overlap (unless there are more products than VPPs in the
/// region). Sharing, a level's
/// two products run side by side rather than one after the other on every
/// VPP, and its elementwise work beside them
/// (`docs/benchmarks.md#vpps-scheduler-shared-wide-ranges`).
pub(super) fn deal_wide_ranges(
    busy: &[bool],
    next: &mut usize,
    products: &[WideProduct],
    ranges: &mut Vec<(usize, usize)>,
) {
    ranges.clear();
    let vpps = busy.len();
    if products.is_empty() || vpps == 0 {
        return;
    }
    // the longest circular run of idle VPPs: (start, length)
    let mut best = (0usize, 0usize);
    let mut run = 0usize;
    for i in 0..2 * vpps {
        if busy[i % vpps] {
            run = 0;
        } else {
            run += 1;
            if run > best.1 && run <= vpps {
                best = ((i + 1 - run) % vpps, run);
            }
        }
    }
    let (start, len) = if best.1 * 2 >= vpps && best.1 < vpps {
        best
    } else {
        (*next, vpps)
    };
    let weight = |p: &WideProduct| wide_work(p.op, p.rows, p.cols, p.count) as u128;
    let total: u128 = products.iter().map(weight).sum::<u128>().max(1);
    let shares: Vec<usize> = if products.len() > len {
        vec![len; products.len()]
    } else {
        let mut shares: Vec<usize> = products
            .iter()
            .map(|p| ((len as u128 * weight(p) / total) as usize).max(1))
            .collect();
        // rounding: take from the largest shares, give to the heaviest
        while shares.iter().sum::<usize>() > len {
            let at = (0..shares.len()).max_by_key(|&i| shares[i]).unwrap_or(0);
            shares[at] -= 1;
        }
        let mut order: Vec<usize> = (0..products.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(weight(&products[i])));
        let spare = len - shares.iter().sum::<usize>();
        for &i in order.iter().cycle().take(spare) {
            shares[i] += 1;
        }
        shares
    };
    let mut offset = 0usize;
    for (p, &share) in products.iter().zip(&shares) {
        let n = wide_tiles(p.op, p.rows, p.cols, p.count, share).clamp(1, share);
        let first = (start + offset) % vpps;
        ranges.push((first, n));
        *next = (first + n) % vpps;
        if products.len() <= len {
            offset += share;
        }
    }
}
