//! Which vector instructions the CPU kernels use, decided once per process
//! from the processor's features (`is_x86_feature_detected!`), so one
//! binary runs everywhere and takes the AVX2/FMA (or AVX-512) kernels where
//! the processor has them.
//!
//! `RAMUS_CPU_ISA` overrides the choice: `portable` forces the plain Rust
//! kernels, `avx2` caps at AVX2/FMA, `avx512` or `auto` (or unset) take
//! the widest the processor has. A level the processor lacks is never used.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::{CoreError, Result};

/// The environment variable that overrides the detected [`Isa`].
pub const ISA_ENV: &str = "RAMUS_CPU_ISA";

/// An instruction-set level of the CPU kernels, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, compiled for the target's baseline (SSE2 on x86-64).
    Portable,
    /// AVX2 with FMA (x86-64-v3).
    Avx2,
    /// AVX-512F, on top of AVX2/FMA.
    Avx512,
}

impl Isa {
    /// The name `RAMUS_CPU_ISA` accepts for this level.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The widest level this processor supports.
    pub fn detected() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let v3 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            if v3 && is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if v3 {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// The level asked for by `request` (a `RAMUS_CPU_ISA` value; `None`,
    /// empty or `auto` for the widest), capped at what the processor has.
    pub fn resolve(request: Option<&str>) -> Result<Isa> {
        let best = Isa::detected();
        let asked = match request.map(str::trim) {
            None | Some("") | Some("auto") => return Ok(best),
            Some(s) => [Isa::Portable, Isa::Avx2, Isa::Avx512]
                .into_iter()
                .find(|i| i.name().eq_ignore_ascii_case(s))
                .ok_or_else(|| CoreError::Unknown {
                    kind: "RAMUS_CPU_ISA value",
                    name: s.to_string(),
                    hint: " (expected auto, portable, avx2 or avx512)".to_string(),
                })?,
        };
        Ok(asked.min(best))
    }

    /// The level `RAMUS_CPU_ISA` asks for (see [`Isa::resolve`]); an error
    /// names an unknown value.
    pub fn from_env() -> Result<Isa> {
        let var = std::env::var(ISA_ENV).ok();
        Isa::resolve(var.as_deref())
    }
}

/// [`isa`]'s cached choice: an `Isa` as `u8`, or [`UNDECIDED`].
static CHOSEN: AtomicU8 = AtomicU8::new(UNDECIDED);
const UNDECIDED: u8 = u8::MAX;

/// The level every CPU kernel uses in this process: [`Isa::from_env`],
/// decided on first use (or what [`set_isa`] last set). An unknown
/// `RAMUS_CPU_ISA` value falls back to the widest level (front ends refuse
/// it first through [`Isa::from_env`]).
#[inline]
pub fn isa() -> Isa {
    match CHOSEN.load(Ordering::Relaxed) {
        0 => Isa::Portable,
        1 => Isa::Avx2,
        2 => Isa::Avx512,
        _ => {
            let chosen = Isa::from_env().unwrap_or_else(|_| Isa::detected());
            CHOSEN.store(chosen as u8, Ordering::Relaxed);
            chosen
        }
    }
}

/// Makes the kernels use `want` from their next call on, capped at what the
/// processor has (so it can never pick instructions it lacks); returns the
/// level set. For comparing the paths within one process (tests, benches).
pub fn set_isa(want: Isa) -> Isa {
    let chosen = want.min(Isa::detected());
    CHOSEN.store(chosen as u8, Ordering::Relaxed);
    chosen
}

/// Runs `f` inside a function compiled with AVX2 and FMA enabled, so the
/// loops of `f` (inlined into it) are vectorised with 256-bit registers.
/// Reach it through [`simd!`](crate::simd), which checks [`isa`] first.
///
/// # Safety
/// The processor has AVX2 and FMA ([`isa`] returned `Avx2` or `Avx512`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub unsafe fn run_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Elsewhere [`isa`] is always `Portable` and this is never reached.
///
/// # Safety
/// None needed; `unsafe` to match the x86-64 signature.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub unsafe fn run_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Evaluates an expression compiled for the process's [`isa`]: with AVX2
/// and FMA enabled when the processor has them, else as plain Rust. The
/// expression is expanded twice (one copy per level), so it must not
/// `return`, `break` or use `?`. Put it inside the loop a thread pool
/// runs (each worker's share), with the hot loop written inside the
/// expression or in `#[inline(always)]` functions it calls, so the loop is
/// compiled into the AVX2 copy.
#[macro_export]
macro_rules! simd {
    ($body:expr) => {
        if $crate::isa::isa() >= $crate::isa::Isa::Avx2 {
            // built outside the `unsafe` block: the caller's code stays checked
            let body = || $body;
            // SAFETY: `isa()` reports Avx2 or wider only on x86-64 when
            // `is_x86_feature_detected!` found AVX2 and FMA.
            unsafe { $crate::isa::run_avx2(body) }
        } else {
            $body
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_are_capped_at_the_processor() {
        let best = Isa::detected();
        assert_eq!(Isa::resolve(None).ok(), Some(best));
        assert_eq!(Isa::resolve(Some("auto")).ok(), Some(best));
        assert_eq!(Isa::resolve(Some("portable")).ok(), Some(Isa::Portable));
        assert_eq!(Isa::resolve(Some(" AVX2 ")).ok(), Some(Isa::Avx2.min(best)));
        assert_eq!(Isa::resolve(Some("avx512")).ok(), Some(best));
        assert!(Isa::resolve(Some("sse9")).is_err());
    }

    #[test]
    fn simd_gives_the_same_value_on_either_path() {
        let xs: Vec<f32> = (0..100).map(|i| i as f32 * 0.25).collect();
        let sum = |xs: &[f32]| crate::simd!(xs.iter().map(|x| x * 2.0).sum::<f32>());
        assert_eq!(sum(&xs), xs.iter().map(|x| x * 2.0).sum::<f32>());
    }
}
