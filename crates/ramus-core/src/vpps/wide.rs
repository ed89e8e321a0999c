//! Wide products: a merged product instruction of many items runs as a
//! tiled GEMM dealt over a range of virtual processors instead of on the
//! matrix's holders. How its GEMM is cut into pieces (output tiles, splits
//! of the reduction) and what a piece costs, shared by the scheduler (which
//! deals the pieces) and the kernel generator (`ramus_codegen::persistent`,
//! whose `vp_wide_product` cuts them the same way).

use super::isa::{OP_MATVEC, OP_MATVEC_T};

/// The scheduler's default for [`Scheduler::wide_items`](super::Scheduler::wide_items):
/// a merged product instruction of at least this many items is sent to a
/// range of processors (one per piece, see [`wide_tiles`]) with the
/// [`WIDE_ITEMS`](super::isa::WIDE_ITEMS) flag and runs as a tiled GEMM
/// dealt over them instead of on the held rows: the weights come from the
/// master copy in the pool (L2-resident), `Wᵀ dy` needs no cross-processor
/// atomics per row piece, and the outer products of a wide level go to the
/// gradient accumulator in the pool (added to the register gradients at
/// `OP_UPDATE`). Below it the register path's latency wins; 8 was the
/// fastest threshold of a sweep
/// (`docs/benchmarks.md#persistent-kernel-wide-product-threshold`).
pub const WIDE_PRODUCT_ITEMS: u32 = 8;

/// Output tile of a wide product (rows × columns of the GEMM), the depth
/// of one step of its reduction, and the items of an outer product's
/// reduction one tile takes (longer lists are split over tiles that add
/// their sums atomically).
pub const GEMM_TILE: usize = 64;
pub const GEMM_STEP: usize = 16;
pub const GEMM_OUTER_CHUNK: usize = 256;

/// The least reduction depth a split of a (transposed) product's
/// reduction takes: shallower splits would spend more on their tile's set-up
/// and atomic epilogue than on the reduction. A product whose items fit one
/// row of tiles (a small batch's level) splits half as deep: that helps
/// small batches, where a shallower split for all products slowed large
/// ones, whose levels of a few hundred items split into more pieces than
/// processors (`docs/benchmarks.md#persistent-kernel-split-depth`).
const GEMM_MIN_SPLIT_DEPTH: usize = 64;

/// The least depth of a split of a product with `m` output rows (items).
fn least_split_depth(m: usize) -> usize {
    if m <= GEMM_TILE {
        GEMM_MIN_SPLIT_DEPTH / 2
    } else {
        GEMM_MIN_SPLIT_DEPTH
    }
}

/// The pieces of a wide product instruction (opcode `op`) with `count`
/// items on a `rows × cols` matrix, out of `vpps` processors: output tiles
/// times splits of the reduction. The kernel deals them over the VPPs the
/// scheduler gives it (see [`Scheduler::wide_items`](super::Scheduler)),
/// one each where they are at most `vpps`.
///
/// An outer product splits its items into chunks of `GEMM_OUTER_CHUNK`.
/// A product `y = W x` or `dx += Wᵀ dy` with fewer output tiles than
/// processors splits its reduction so that the pieces fill them (each split
/// at least `least_split_depth` deep) and adds the splits' partial
/// sums atomically: a level of a few dozen vectors would otherwise run on a
/// handful of processors, each walking the whole reduction. The kernel has
/// no word for the split count; it derives it from the processors it is
/// given, `ranks / tiles` (see [`split_depth`]), which is why the count
/// returned here is exactly `tiles × splits` when that fits.
pub fn wide_tiles(op: u8, rows: usize, cols: usize, count: usize, vpps: usize) -> usize {
    let (m, n, k) = gemm_shape(op, rows, cols, count);
    let tiles = m.div_ceil(GEMM_TILE) * n.div_ceil(GEMM_TILE);
    if op != OP_MATVEC && op != OP_MATVEC_T {
        return tiles * count.div_ceil(GEMM_OUTER_CHUNK);
    }
    let most = vpps / tiles.max(1);
    if most <= 1 {
        return tiles;
    }
    let depth = k.div_ceil(most).max(least_split_depth(m));
    tiles * split_depth(k, k.div_ceil(depth)).0
}

/// A wide product's GEMM, `(m, n, k)`: its output rows (items, or an
/// outer product's matrix rows), output columns and reduction depth.
fn gemm_shape(op: u8, rows: usize, cols: usize, count: usize) -> (usize, usize, usize) {
    match op {
        OP_MATVEC => (count, rows, cols),
        OP_MATVEC_T => (count, cols, rows),
        _ => (rows, cols, count),
    }
}

/// The work of a wide product in steps of one output tile: output tiles
/// times the reduction's depth in `GEMM_STEP`s. A tile costs the same
/// however few of its rows are items (a level of a few dozen vectors fills
/// a fraction of one row of tiles), so this, not the multiply-adds, is
/// what a level's wide products share its VPPs by: a Tree-LSTM level's
/// `U_iou h` (three times `U_f`'s rows, half its items) got 3/5 of the
/// VPPs by multiply-adds, 6 steps a piece against `U_f`'s 3, and ran twice
/// as long.
pub fn wide_work(op: u8, rows: usize, cols: usize, count: usize) -> usize {
    let (m, n, k) = gemm_shape(op, rows, cols, count);
    m.div_ceil(GEMM_TILE) * n.div_ceil(GEMM_TILE) * k.div_ceil(GEMM_STEP)
}

/// The kernel's split of a reduction `k` deep over (at most) `splits`
/// pieces: `(splits, depth)` with every split `GEMM_STEP`-aligned and
/// none empty (the kernel's `vp_wide_product` computes the same).
pub fn split_depth(k: usize, splits: usize) -> (usize, usize) {
    let depth = k.div_ceil(splits.max(1)).div_ceil(GEMM_STEP) * GEMM_STEP;
    (k.div_ceil(depth.max(1)).max(1), depth)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vpps::isa::OP_OUTER;

    #[test]
    fn a_narrow_product_splits_its_reduction_to_fill_the_processors() {
        // Tree-LSTM h 256 on 264 VPPs: Uᵀ dy (1280 x 512) for 48 vectors
        // has 8 output tiles; 1280 deep, it splits 27 ways, 48 deep each
        // (items in one row of tiles: splits at least 32 deep)
        assert_eq!(wide_tiles(OP_MATVEC_T, 1280, 512, 48, 264), 8 * 27);
        assert_eq!(split_depth(1280, 27), (27, 48));
        // W x (1280 x 512) for 48 vectors: 20 tiles, 11 splits of 48
        assert_eq!(wide_tiles(OP_MATVEC, 1280, 512, 48, 264), 20 * 11);
        // for 80 vectors: 40 tiles, 6 splits of 96 (at least 64 deep)
        assert_eq!(wide_tiles(OP_MATVEC, 1280, 512, 80, 264), 40 * 6);
        // a reduction no deeper than the least split does not split
        assert_eq!(wide_tiles(OP_MATVEC, 1280, 32, 48, 264), 20);
        assert_eq!(wide_tiles(OP_MATVEC, 1280, 64, 80, 264), 40);
        assert_eq!(wide_tiles(OP_MATVEC, 1280, 64, 48, 264), 20 * 2);
        // as many tiles as processors (or more): no split
        assert_eq!(wide_tiles(OP_MATVEC, 1280, 512, 3000, 264), 47 * 20);
        assert_eq!(wide_tiles(OP_MATVEC, 1280, 512, 640, 264), 200);
        // outer products split their items, whatever the processors
        assert_eq!(wide_tiles(OP_OUTER, 1280, 512, 600, 8), 20 * 8 * 3);
    }

    #[test]
    fn the_kernel_recovers_the_hosts_split_from_the_processors_it_is_given() {
        for op in [OP_MATVEC, OP_MATVEC_T] {
            for (rows, cols) in [
                (1280usize, 512usize),
                (2560, 1024),
                (96, 300),
                (7, 1000),
                (4096, 33),
            ] {
                for count in [1usize, 17, 32, 64, 65, 200, 1000] {
                    for vpps in [4, 132, 264] {
                        let (m, n, k) = if op == OP_MATVEC {
                            (count, rows, cols)
                        } else {
                            (count, cols, rows)
                        };
                        let tiles = m.div_ceil(GEMM_TILE) * n.div_ceil(GEMM_TILE);
                        let pieces = wide_tiles(op, rows, cols, count, vpps);
                        let ranks = pieces.clamp(1, vpps);
                        // the kernel: ranks / tiles splits, re-cut aligned
                        let (splits, depth) = split_depth(k, (ranks / tiles).max(1));
                        let what = format!("op {op} {rows}x{cols} count {count} vpps {vpps}");
                        assert_eq!(tiles * splits, pieces, "{what}");
                        assert!(pieces <= vpps.max(tiles), "{what}");
                        assert_eq!(depth % GEMM_STEP, 0, "{what}");
                        assert!(splits <= k.div_ceil(least_split_depth(m)), "{what}");
                        // every split has work, and together they cover k
                        assert!((splits - 1) * depth < k && splits * depth >= k, "{what}");
                    }
                }
            }
        }
    }
}
