//! How long things take: the host↔device link and unprofiled ops.

use crate::trace::OpInfo;
use serde::{Deserialize, Serialize};

/// Bandwidth and latency of the host↔device link (one DMA engine per
/// direction), and the duration assumed for ops without a measurement.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Host-to-device bandwidth (prefetch), bytes per second.
    pub h2d_bytes_per_s: f64,
    /// Device-to-host bandwidth (offload), bytes per second.
    pub d2h_bytes_per_s: f64,
    /// Fixed cost of one copy (launch plus DMA set-up), seconds.
    pub latency_s: f64,
    /// Duration used for an op whose trace entry has no measured duration.
    pub default_op_time_s: f64,
}

impl Default for CostModel {
    /// PCIe 3.0 x16 as measured in the AutoVM thesis (≈ 12 GB/s each way).
    fn default() -> Self {
        CostModel::pcie3_x16()
    }
}

impl CostModel {
    /// PCIe 3.0 x16 to pinned memory: 12 GB/s each way, 10 µs per copy.
    pub fn pcie3_x16() -> CostModel {
        CostModel {
            h2d_bytes_per_s: 12e9,
            d2h_bytes_per_s: 12e9,
            latency_s: 10e-6,
            default_op_time_s: 100e-6,
        }
    }

    /// PCIe 5.0 x16 to pinned memory (H100/H200 hosts): 50 GB/s each way.
    pub fn pcie5_x16() -> CostModel {
        CostModel {
            h2d_bytes_per_s: 50e9,
            d2h_bytes_per_s: 50e9,
            latency_s: 10e-6,
            default_op_time_s: 100e-6,
        }
    }

    /// Seconds to copy `bytes` host → device.
    pub fn h2d_time(&self, bytes: u64) -> f64 {
        self.latency_s + bytes as f64 / self.h2d_bytes_per_s
    }

    /// Seconds to copy `bytes` device → host.
    pub fn d2h_time(&self, bytes: u64) -> f64 {
        self.latency_s + bytes as f64 / self.d2h_bytes_per_s
    }

    /// The op's measured duration, or the default.
    pub fn op_time(&self, op: &OpInfo) -> f64 {
        op.duration_s.unwrap_or(self.default_op_time_s)
    }

    /// Checks that every number is finite and in range.
    pub fn validate(&self) -> Result<(), String> {
        let pos = [
            ("h2d_bytes_per_s", self.h2d_bytes_per_s),
            ("d2h_bytes_per_s", self.d2h_bytes_per_s),
        ];
        for (name, v) in pos {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be finite and positive, got {v}"));
            }
        }
        let nonneg = [
            ("latency_s", self.latency_s),
            ("default_op_time_s", self.default_op_time_s),
        ];
        for (name, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be finite and non-negative, got {v}"));
            }
        }
        Ok(())
    }
}

/// Formats a byte count for people: `1.50 GiB`, `392.0 MiB`, `12 B`.
pub fn human_bytes(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if b >= KIB * KIB * KIB {
        format!("{:.2} GiB", b / (KIB * KIB * KIB))
    } else if b >= KIB * KIB {
        format!("{:.1} MiB", b / (KIB * KIB))
    } else if b >= KIB {
        format!("{:.1} KiB", b / KIB)
    } else {
        format!("{bytes} B")
    }
}

/// Formats seconds for people: `1.234 s`, `12.3 ms`, `45.0 µs`.
pub fn human_seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_times_and_validation() {
        let c = CostModel::pcie3_x16();
        assert!((c.h2d_time(12_000_000_000) - 1.00001).abs() < 1e-9);
        assert!(c.validate().is_ok());
        let bad = CostModel {
            h2d_bytes_per_s: 0.0,
            ..c
        };
        assert!(bad.validate().unwrap_err().contains("h2d_bytes_per_s"));
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
        assert_eq!(human_bytes(12), "12 B");
    }
}
