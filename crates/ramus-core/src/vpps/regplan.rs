//! Register partition planning (VPPS §III-A1, Fig. 4, eq. 1).
//!
//! The persistent kernel runs `ctas_per_sm` CTAs of [`CTA_THREADS`] threads on
//! every SM. After the registers the interpreter itself needs
//! ([`DeviceLimits::reserved_regs_per_thread`]), each thread's remaining
//! registers are cut into equal *partitions*; the same cut is used by every
//! CTA. A partition holds `rpw` rows per warp (eq. 1: a partition is
//! `CTA_THREADS × rpw × ceil(rowmax / WARP)` registers, i.e. `rpw ×
//! regs_per_row` registers per thread), so one partition of one CTA caches
//! up to `WARPS_PER_CTA × rpw` consecutive rows of one weight matrix: warp
//! `w` holds rows `first_row + w·rpw ..` and lane `l` of that warp holds
//! columns `l, l + 32, l + 64, ...` of each of its rows. Keeping a row inside
//! one warp lets the matrix be loaded coalesced and multiplied without any
//! synchronisation between warps.
//!
//! Matrices are cut into such *pieces* (in matrix order, rows in order) and
//! the pieces are dealt to CTAs round-robin: piece `i` goes to CTA
//! `i % ctas`, partition `i / ctas` (Fig. 4). CTA piece counts therefore
//! differ by at most one. When registers allow, every partition is mirrored
//! by one for the gradient of the same piece; otherwise gradients are
//! accumulated through cuBLAS outside the kernel (§III-C2).
//!
//! [`plan`] picks the number of CTAs per SM and whether gradients live in
//! registers; [`valid_rpws`] lists the `rpw` values for which some plan fits,
//! which the profile-guided search compiles one kernel each for (§III-A1).

use std::ops::Range;

use crate::error::{CoreError, Result};

/// Threads per persistent CTA (VPPS §III-A1: 256, so that a thread may
/// address up to 255 registers while the SM's register file stays full).
pub const CTA_THREADS: usize = 256;
/// Threads per warp.
pub const WARP: usize = 32;
/// Warps per persistent CTA.
pub const WARPS_PER_CTA: usize = CTA_THREADS / WARP;
/// Words per `(cta, partition)` entry of [`RegisterPlan::table`].
pub const TABLE_WORDS: usize = 2;
/// Largest number of CTAs per SM [`plan`] considers when it chooses (VPPS
/// §III-A1: more than two leaves too few registers for partitions).
pub const MAX_CHOSEN_CTAS_PER_SM: usize = 2;

/// Register-file limits of the device the persistent kernel runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Streaming multiprocessors.
    pub sms: usize,
    /// 32-bit registers per SM.
    pub regs_per_sm: usize,
    /// Most registers one thread may address.
    pub max_regs_per_thread: usize,
    /// Registers per thread kept for the interpreter and cached vectors, not
    /// available for weights.
    pub reserved_regs_per_thread: usize,
}

impl DeviceLimits {
    /// Hopper (and Volta/Ampere alike): 64 K registers per SM, 255 per
    /// thread, 63 reserved per thread (31 for the interpreter and 32 for
    /// cached vectors, VPPS footnote 6).
    pub fn hopper(sms: usize) -> Self {
        DeviceLimits {
            sms,
            regs_per_sm: 65536,
            max_regs_per_thread: 255,
            reserved_regs_per_thread: 63,
        }
    }

    /// Registers per thread left for weight (and gradient) partitions when
    /// `ctas_per_sm` CTAs of [`CTA_THREADS`] share an SM.
    pub fn weight_regs_per_thread(&self, ctas_per_sm: usize) -> usize {
        let threads = ctas_per_sm.saturating_mul(CTA_THREADS).max(1);
        self.max_regs_per_thread
            .min(self.regs_per_sm / threads)
            .saturating_sub(self.reserved_regs_per_thread)
    }
}

/// One weight matrix to cache in registers, stored row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixSpec {
    /// The model parameter id this matrix is.
    pub param: usize,
    /// Rows (each row lives in one warp).
    pub rows: usize,
    /// Columns (a row takes `ceil(cols / WARP)` registers per lane).
    pub cols: usize,
}

/// What to plan for; `None` lets [`plan`] choose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanRequest {
    /// Rows per warp in one partition (eq. 1), at least 1.
    pub rpw: usize,
    /// CTAs per SM; `None`: 2 if it fits, else 1.
    pub ctas_per_sm: Option<usize>,
    /// Whether gradients are cached next to the weights; `None`: if it fits.
    pub grads_in_registers: Option<bool>,
}

impl PlanRequest {
    /// A request for `rpw` that leaves every other choice to [`plan`].
    pub fn new(rpw: usize) -> Self {
        PlanRequest {
            rpw,
            ctas_per_sm: None,
            grads_in_registers: None,
        }
    }
}

/// The content of one register partition of one CTA: rows `first_row ..
/// first_row + rows` of `matrices[matrix]`, with `rows ≤ WARPS_PER_CTA × rpw`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index into [`RegisterPlan::matrices`].
    pub matrix: usize,
    /// First matrix row of the piece.
    pub first_row: usize,
    /// Rows in the piece (the last piece of a matrix may be short).
    pub rows: usize,
    /// CTA (virtual processor) holding the piece.
    pub cta: usize,
    /// Partition of that CTA holding the piece.
    pub partition: usize,
}

impl Piece {
    /// Matrix rows held by warp `warp` of the CTA: `first_row + warp·rpw ..
    /// + rpw`, clipped to the piece (empty when the piece is short). Row `k`
    /// of that range sits in registers `k·regs_per_row .. (k+1)·regs_per_row`
    /// of the partition, lane `l` holding columns `l, l + WARP, ...`.
    pub fn warp_rows(&self, warp: usize, rpw: usize) -> Range<usize> {
        let end = self.first_row + self.rows;
        let start = self
            .first_row
            .saturating_add(warp.saturating_mul(rpw))
            .min(end);
        start..start.saturating_add(rpw).min(end)
    }
}

/// How the weight matrices are spread over the persistent CTAs' registers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegisterPlan {
    /// The matrices, in the order pieces were cut.
    pub matrices: Vec<MatrixSpec>,
    /// CTAs resident per SM.
    pub ctas_per_sm: usize,
    /// Persistent CTAs in all (`sms × ctas_per_sm`), i.e. virtual processors.
    pub ctas: usize,
    /// Rows per warp in one partition.
    pub rpw: usize,
    /// Registers per lane for one row: `ceil(max cols / WARP)`.
    pub regs_per_row: usize,
    /// Registers per thread of one partition: `rpw × regs_per_row`.
    pub regs_per_partition: usize,
    /// Partitions used per CTA: `ceil(pieces / ctas)`.
    pub partitions: usize,
    /// Whether every weight partition has a gradient partition beside it.
    pub grads_in_registers: bool,
    /// Registers per thread the device leaves for partitions at this
    /// `ctas_per_sm` (after the reserved ones).
    pub available_regs_per_thread: usize,
    /// Every piece; piece `i` is at CTA `i % ctas`, partition `i / ctas`.
    pub pieces: Vec<Piece>,
}

impl RegisterPlan {
    /// The CTAs holding at least one piece of `matrix`, ascending (empty for
    /// an unknown matrix).
    pub fn holders(&self, matrix: usize) -> Vec<u32> {
        let mut ctas: Vec<u32> = self
            .pieces
            .iter()
            .filter(|p| p.matrix == matrix)
            .map(|p| p.cta as u32)
            .collect();
        ctas.sort_unstable();
        ctas.dedup();
        ctas
    }

    /// The piece in partition `partition` of CTA `cta`, if that one is used.
    pub fn piece_at(&self, cta: usize, partition: usize) -> Option<&Piece> {
        if cta >= self.ctas {
            return None;
        }
        let index = partition.checked_mul(self.ctas)?.checked_add(cta)?;
        self.pieces.get(index)
    }

    /// Registers per thread holding weights: `partitions × regs_per_partition`.
    pub fn weight_regs_per_thread(&self) -> usize {
        self.partitions * self.regs_per_partition
    }

    /// Registers per thread holding gradients (0 when they stay in DRAM).
    pub fn grad_regs_per_thread(&self) -> usize {
        if self.grads_in_registers {
            self.weight_regs_per_thread()
        } else {
            0
        }
    }

    /// A flat table for the device, [`TABLE_WORDS`] words per `(cta,
    /// partition)`: the entry of partition `p` of CTA `c` starts at word
    /// `(c × partitions + p) × TABLE_WORDS` and is `[matrix index, first_row]`,
    /// or `[u32::MAX, 0]` for an unused partition. Length `ctas × partitions ×
    /// TABLE_WORDS`.
    pub fn table(&self) -> Vec<u32> {
        let mut table = Vec::with_capacity(self.ctas * self.partitions * TABLE_WORDS);
        for _ in 0..self.ctas * self.partitions {
            table.extend_from_slice(&[u32::MAX, 0]);
        }
        for p in &self.pieces {
            let at = (p.cta * self.partitions + p.partition) * TABLE_WORDS;
            if let Some(entry) = table.get_mut(at..at + TABLE_WORDS) {
                // `plan` checked that matrix indices and rows fit in u32.
                entry[0] = p.matrix as u32;
                entry[1] = p.first_row as u32;
            }
        }
        table
    }

    /// Rows of `matrix` held by CTA `cta`.
    pub fn load_share(&self, matrix: usize, cta: usize) -> usize {
        self.pieces
            .iter()
            .filter(|p| p.matrix == matrix && p.cta == cta)
            .map(|p| p.rows)
            .sum()
    }
}

/// How one (ctas per SM, gradients) option fares.
struct Fit {
    ctas_per_sm: usize,
    grads: bool,
    ctas: usize,
    partitions: usize,
    needed_regs: usize,
    available_regs: usize,
}

impl Fit {
    fn new(
        limits: &DeviceLimits,
        pieces: usize,
        regs_per_partition: usize,
        ctas_per_sm: usize,
        grads: bool,
    ) -> Fit {
        let ctas = limits.sms.saturating_mul(ctas_per_sm).max(1);
        let partitions = pieces.div_ceil(ctas);
        let needed_regs = partitions
            .saturating_mul(regs_per_partition)
            .saturating_mul(if grads { 2 } else { 1 });
        Fit {
            ctas_per_sm,
            grads,
            ctas,
            partitions,
            needed_regs,
            available_regs: limits.weight_regs_per_thread(ctas_per_sm),
        }
    }

    fn fits(&self) -> bool {
        self.needed_regs <= self.available_regs
    }
}

/// Checks the matrices and returns `ceil(max cols / WARP)`.
fn check_matrices(matrices: &[MatrixSpec]) -> Result<usize> {
    const WHAT: &str = "register plan";
    if matrices.is_empty() {
        return Err(CoreError::vpps(WHAT, "no weight matrices to cache"));
    }
    if matrices.len() > usize::from(u16::MAX) + 1 {
        return Err(CoreError::vpps(
            WHAT,
            format!(
                "{} weight matrices; at most {} can be cached (matrix indices are 16-bit)",
                matrices.len(),
                usize::from(u16::MAX) + 1
            ),
        ));
    }
    let limit = u32::MAX as usize;
    for (i, m) in matrices.iter().enumerate() {
        if m.rows == 0 || m.cols == 0 {
            return Err(CoreError::vpps(
                WHAT,
                format!(
                    "matrix {i} (param {}) has zero size {}x{}",
                    m.param, m.rows, m.cols
                ),
            ));
        }
        if m.rows > limit || m.cols > limit {
            return Err(CoreError::vpps(
                WHAT,
                format!(
                    "matrix {i} (param {}) of {}x{} is too large to address",
                    m.param, m.rows, m.cols
                ),
            ));
        }
    }
    let max_cols = matrices.iter().map(|m| m.cols).max().unwrap_or(1);
    Ok(max_cols.div_ceil(WARP))
}

/// `param p (rows x cols)` for the three largest matrices.
fn largest_matrices(matrices: &[MatrixSpec]) -> String {
    let mut order: Vec<&MatrixSpec> = matrices.iter().collect();
    order.sort_by_key(|m| std::cmp::Reverse(m.rows.saturating_mul(m.cols)));
    order
        .iter()
        .take(3)
        .map(|m| format!("param {} ({}x{})", m.param, m.rows, m.cols))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Plans the register partitions for `matrices` at `req.rpw` (see the module
/// docs). When `req` leaves a choice open, the options are tried in the order
/// 2 CTAs/SM with gradients in registers, 1 CTA/SM with gradients, 2 without,
/// 1 without (VPPS §III-A1, §III-C2), and the first that fits is taken.
///
/// Errors: [`CoreError::Vpps`] for no matrices, a zero-sized matrix, `rpw`
/// or `ctas_per_sm` of 0, or a device without SMs; [`CoreError::NotOnChip`]
/// when no allowed option fits, with the registers needed and available and
/// the largest matrices' params.
pub fn plan(
    matrices: &[MatrixSpec],
    limits: &DeviceLimits,
    req: &PlanRequest,
) -> Result<RegisterPlan> {
    const WHAT: &str = "register plan";
    let regs_per_row = check_matrices(matrices)?;
    if req.rpw == 0 {
        return Err(CoreError::vpps(
            WHAT,
            "rpw (rows per warp) must be at least 1",
        ));
    }
    if limits.sms == 0 {
        return Err(CoreError::vpps(WHAT, "the device limits report 0 SMs"));
    }
    if req.ctas_per_sm == Some(0) {
        return Err(CoreError::vpps(WHAT, "ctas_per_sm must be at least 1"));
    }
    let too_large = || CoreError::vpps(WHAT, format!("rpw {} is too large", req.rpw));
    let rows_per_piece = req.rpw.checked_mul(WARPS_PER_CTA).ok_or_else(too_large)?;
    let regs_per_partition = req.rpw.checked_mul(regs_per_row).ok_or_else(too_large)?;
    let pieces: usize = matrices
        .iter()
        .map(|m| m.rows.div_ceil(rows_per_piece))
        .sum();

    let ctas_options = match req.ctas_per_sm {
        Some(c) => vec![c],
        None => (1..=MAX_CHOSEN_CTAS_PER_SM).rev().collect(),
    };
    let grads_options = match req.grads_in_registers {
        Some(g) => vec![g],
        None => vec![true, false],
    };
    let mut last = None;
    for &grads in &grads_options {
        for &ctas_per_sm in &ctas_options {
            let fit = Fit::new(limits, pieces, regs_per_partition, ctas_per_sm, grads);
            if fit.fits() {
                return Ok(assign(
                    matrices,
                    &fit,
                    req.rpw,
                    regs_per_row,
                    regs_per_partition,
                ));
            }
            last = Some(fit);
        }
    }
    // The last option tried is the most permissive one allowed.
    let fit = last.unwrap_or_else(|| Fit::new(limits, pieces, regs_per_partition, 1, false));
    let floats: usize = matrices.iter().map(|m| m.rows.saturating_mul(m.cols)).sum();
    Err(CoreError::NotOnChip {
        needed_regs: fit.needed_regs,
        available_regs: fit.available_regs,
        message: format!(
            "rpw {}: {} weight matrices ({floats} floats) cut into {pieces} pieces need {} \
             partitions of {regs_per_partition} registers per thread over {} CTAs \
             ({} CTA(s)/SM, gradients {}), but {} SMs x {} registers leave {} per thread \
             after reserving {}; largest: {}",
            req.rpw,
            matrices.len(),
            fit.partitions,
            fit.ctas,
            fit.ctas_per_sm,
            if fit.grads { "in registers" } else { "in DRAM" },
            limits.sms,
            limits.regs_per_sm,
            fit.available_regs,
            limits.reserved_regs_per_thread,
            largest_matrices(matrices),
        ),
    })
}

/// Cuts the matrices into pieces and deals them round-robin (Fig. 4).
fn assign(
    matrices: &[MatrixSpec],
    fit: &Fit,
    rpw: usize,
    regs_per_row: usize,
    regs_per_partition: usize,
) -> RegisterPlan {
    let rows_per_piece = rpw * WARPS_PER_CTA;
    let mut pieces = Vec::new();
    for (matrix, spec) in matrices.iter().enumerate() {
        let mut first_row = 0;
        while first_row < spec.rows {
            let rows = rows_per_piece.min(spec.rows - first_row);
            let i = pieces.len();
            pieces.push(Piece {
                matrix,
                first_row,
                rows,
                cta: i % fit.ctas,
                partition: i / fit.ctas,
            });
            first_row += rows;
        }
    }
    RegisterPlan {
        matrices: matrices.to_vec(),
        ctas_per_sm: fit.ctas_per_sm,
        ctas: fit.ctas,
        rpw,
        regs_per_row,
        regs_per_partition,
        partitions: fit.partitions,
        grads_in_registers: fit.grads,
        available_regs_per_thread: fit.available_regs,
        pieces,
    }
}

/// Every `rpw ≥ 1` for which [`plan`] finds some fitting option, ascending
/// (empty for invalid matrices or limits). The profile-guided search compiles
/// one kernel per value (VPPS §III-A1); a partition must fit in a thread's
/// registers, so the list is finite.
pub fn valid_rpws(matrices: &[MatrixSpec], limits: &DeviceLimits) -> Vec<usize> {
    let Ok(regs_per_row) = check_matrices(matrices) else {
        return Vec::new();
    };
    // The most permissive option is one CTA per SM without gradients.
    let max_rpw = limits.weight_regs_per_thread(1) / regs_per_row;
    (1..=max_rpw)
        .filter(|&rpw| plan(matrices, limits, &PlanRequest::new(rpw)).is_ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(param: usize, rows: usize, cols: usize) -> MatrixSpec {
        MatrixSpec { param, rows, cols }
    }

    /// Tree-LSTM weights (W_iou, U_iou, U_f, W_out) at hidden size `h`.
    fn tree_lstm(h: usize) -> Vec<MatrixSpec> {
        vec![
            spec(0, 3 * h, h),
            spec(1, 3 * h, h),
            spec(2, h, h),
            spec(3, 5, h),
        ]
    }

    #[test]
    fn hopper_register_budget() {
        let l = DeviceLimits::hopper(132);
        assert_eq!(l.weight_regs_per_thread(1), 192); // VPPS footnote 6
        assert_eq!(l.weight_regs_per_thread(2), 65);
    }

    #[test]
    fn tree_lstm_256_two_ctas_with_grads() {
        let p = plan(
            &tree_lstm(256),
            &DeviceLimits::hopper(132),
            &PlanRequest::new(1),
        )
        .unwrap();
        assert_eq!((p.ctas_per_sm, p.grads_in_registers), (2, true));
        assert_eq!(p.ctas, 264);
        assert_eq!(p.regs_per_row, 8);
        assert_eq!(p.regs_per_partition, 8);
        assert_eq!(p.pieces.len(), 96 + 96 + 32 + 1);
        assert_eq!(p.partitions, 1);
        assert_eq!(p.weight_regs_per_thread(), 8);
        assert_eq!(p.grad_regs_per_thread(), 8);
        // W_out's 5 rows form one short piece, after the 224 full ones.
        assert_eq!(p.pieces[224].rows, 5);
        assert_eq!(p.holders(3), vec![224]);
        assert_eq!(p.load_share(3, 224), 5);
        assert_eq!(p.holders(2), (192..224).collect::<Vec<u32>>());
    }

    #[test]
    fn tree_lstm_512_two_ctas_with_grads() {
        let l = DeviceLimits::hopper(132);
        let p = plan(&tree_lstm(512), &l, &PlanRequest::new(1)).unwrap();
        assert_eq!((p.ctas_per_sm, p.grads_in_registers), (2, true));
        assert_eq!(p.partitions, 2); // 449 pieces over 264 CTAs
        assert_eq!(p.weight_regs_per_thread() + p.grad_regs_per_thread(), 64);
        // rpw 3 (48 registers per partition) no longer fits 2 CTAs with grads.
        let p3 = plan(&tree_lstm(512), &l, &PlanRequest::new(3)).unwrap();
        assert_eq!((p3.ctas_per_sm, p3.grads_in_registers), (1, true));
    }

    #[test]
    fn forced_options_are_honoured_or_rejected() {
        let l = DeviceLimits::hopper(132);
        let req = PlanRequest {
            rpw: 1,
            ctas_per_sm: Some(1),
            grads_in_registers: Some(false),
        };
        let p = plan(&tree_lstm(256), &l, &req).unwrap();
        assert_eq!(
            (p.ctas_per_sm, p.grads_in_registers, p.ctas),
            (1, false, 132)
        );
        let req = PlanRequest {
            rpw: 3,
            ctas_per_sm: Some(2),
            grads_in_registers: Some(true),
        };
        let err = plan(&tree_lstm(512), &l, &req).unwrap_err();
        assert!(
            matches!(
                err,
                CoreError::NotOnChip {
                    needed_regs: 96,
                    available_regs: 65,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn huge_model_is_not_on_chip() {
        let mut m: Vec<MatrixSpec> = (0..40).map(|i| spec(i, 4096, 1024)).collect();
        m.push(spec(99, 8192, 1024));
        let err = plan(&m, &DeviceLimits::hopper(132), &PlanRequest::new(1)).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, CoreError::NotOnChip { .. }), "{msg}");
        assert!(msg.contains("param 99 (8192x1024)"), "{msg}");
        assert!(msg.contains("the device has 192"), "{msg}");
        assert!(valid_rpws(&m, &DeviceLimits::hopper(132)).is_empty());
    }

    #[test]
    fn bad_inputs_are_named() {
        let l = DeviceLimits::hopper(4);
        let err = plan(&[], &l, &PlanRequest::new(1)).unwrap_err();
        assert!(err.to_string().contains("no weight matrices"), "{err}");
        let err = plan(&tree_lstm(8), &l, &PlanRequest::new(0)).unwrap_err();
        assert!(err.to_string().contains("rpw"), "{err}");
        let m = [spec(0, 4, 4), spec(7, 0, 4)];
        let err = plan(&m, &l, &PlanRequest::new(1)).unwrap_err();
        assert!(err.to_string().contains("param 7"), "{err}");
        let m = [spec(5, 4, 0)];
        let err = plan(&m, &l, &PlanRequest::new(1)).unwrap_err();
        assert!(err.to_string().contains("param 5"), "{err}");
        let err = plan(
            &tree_lstm(8),
            &DeviceLimits::hopper(0),
            &PlanRequest::new(1),
        );
        assert!(err.unwrap_err().to_string().contains("0 SMs"));
        let req = PlanRequest {
            ctas_per_sm: Some(0),
            ..PlanRequest::new(1)
        };
        assert!(plan(&tree_lstm(8), &l, &req).is_err());
        let err = plan(&tree_lstm(8), &l, &PlanRequest::new(usize::MAX)).unwrap_err();
        assert!(err.to_string().contains("too large"), "{err}");
    }

    #[test]
    fn round_robin_layout_and_table() {
        // 2 SMs x 2 CTAs; rpw 1 -> pieces of 8 rows: A has 3 pieces, B 4.
        let m = [spec(10, 20, 40), spec(11, 32, 64)];
        let p = plan(&m, &DeviceLimits::hopper(2), &PlanRequest::new(1)).unwrap();
        assert_eq!((p.ctas, p.regs_per_row, p.partitions), (4, 2, 2));
        let got: Vec<(usize, usize, usize, usize, usize)> = p
            .pieces
            .iter()
            .map(|q| (q.matrix, q.first_row, q.rows, q.cta, q.partition))
            .collect();
        let want = vec![
            (0, 0, 8, 0, 0),
            (0, 8, 8, 1, 0),
            (0, 16, 4, 2, 0),
            (1, 0, 8, 3, 0),
            (1, 8, 8, 0, 1),
            (1, 16, 8, 1, 1),
            (1, 24, 8, 2, 1),
        ];
        assert_eq!(got, want);
        assert_eq!(p.piece_at(3, 1), None);
        assert_eq!(p.piece_at(2, 1).map(|q| q.first_row), Some(24));
        assert_eq!(p.piece_at(4, 0), None);
        let t = p.table();
        assert_eq!(t.len(), 4 * 2 * TABLE_WORDS);
        // CTA 2: partition 0 = A rows 16.., partition 1 = B rows 24..
        assert_eq!(&t[8..12], &[0, 16, 1, 24]);
        // CTA 3: partition 1 unused.
        assert_eq!(&t[12..16], &[1, 0, u32::MAX, 0]);
        assert_eq!(p.holders(0), vec![0, 1, 2]);
        assert_eq!(p.holders(1), vec![0, 1, 2, 3]);
        assert_eq!(p.load_share(0, 2), 4);
        // The short piece: warp 3 holds row 19 only, warp 4 holds nothing.
        assert_eq!(p.pieces[2].warp_rows(3, 1), 19..20);
        assert!(p.pieces[2].warp_rows(4, 1).is_empty());
    }

    #[test]
    fn paper_footnote_max_rpw_is_six() {
        // Titan V: 80 SMs; rowmax 1024 and one CTA per SM allow rpw <= 6.
        let l = DeviceLimits::hopper(80);
        let m = [spec(0, 1024, 1024)];
        assert_eq!(valid_rpws(&m, &l), vec![1, 2, 3, 4, 5, 6]);
        let req = PlanRequest {
            rpw: 6,
            ctas_per_sm: Some(1),
            grads_in_registers: Some(false),
        };
        assert!(plan(&m, &l, &req).is_ok());
        assert!(plan(&m, &l, &PlanRequest::new(7)).is_err());
    }

    #[test]
    fn valid_rpws_match_plan() {
        let l = DeviceLimits::hopper(132);
        let m = tree_lstm(512);
        let rpws = valid_rpws(&m, &l);
        assert_eq!(rpws.first(), Some(&1));
        for rpw in 1..=40 {
            let ok = plan(&m, &l, &PlanRequest::new(rpw)).is_ok();
            assert_eq!(ok, rpws.contains(&rpw), "rpw {rpw}");
        }
        // 192 registers / 16 per row.
        assert_eq!(rpws.last(), Some(&12));
        assert!(valid_rpws(&[], &l).is_empty());
    }
}
