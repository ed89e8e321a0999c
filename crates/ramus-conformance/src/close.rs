//! Comparing an engine's numbers with the reference's: [`assert_close`]
//! with a [`Tolerance`] chosen per comparison, and a message that names
//! the tensor and the element that differ.

use ramus_core::Real;
use ramus_exec::Scores;

/// What a difference is measured against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scale {
    /// `|want − got| ≤ rel · (1 + |want|)`: each element on its own (scores,
    /// losses), where every value is computed from about as many terms.
    Element,
    /// `|want − got| ≤ rel · max |want|`: against the tensor's largest
    /// element (gradients, parameters, optimizer moments), so that an
    /// element that is a near-cancelling sum is not held to a bound its
    /// inputs cannot meet.
    Tensor,
}

/// How far two results may differ: `rel` times a [`Scale`], plus `abs`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub rel: f64,
    pub scale: Scale,
    /// An absolute allowance on top (e.g. the rounding of a value that was
    /// recovered by a subtraction).
    pub abs: f64,
}

impl Tolerance {
    /// `rel` relative to each element.
    pub const fn element(rel: f64) -> Self {
        Tolerance {
            rel,
            scale: Scale::Element,
            abs: 0.0,
        }
    }

    /// `rel` relative to the tensor's largest element.
    pub const fn tensor(rel: f64) -> Self {
        Tolerance {
            rel,
            scale: Scale::Tensor,
            abs: 0.0,
        }
    }

    /// No difference at all: the same kernels in the same order.
    pub const EXACT: Tolerance = Tolerance::element(0.0);

    /// The same tolerance with `abs` more.
    pub const fn plus(self, abs: f64) -> Self {
        Tolerance { abs, ..self }
    }

    /// The same tolerance at least `eps` machine epsilons of `T` (an f64
    /// result is never held to less than its own rounding, an f32 one
    /// never to less than f32's).
    pub fn at_least<T: Real>(self, eps: f64) -> Self {
        Tolerance {
            rel: self.rel.max(eps * epsilon::<T>()),
            ..self
        }
    }
}

/// Machine epsilon of `T` (`f32`: 2⁻²³, `f64`: 2⁻⁵²).
pub fn epsilon<T: Real>() -> f64 {
    match T::NAME {
        "f32" => f32::EPSILON as f64,
        _ => f64::EPSILON,
    }
}

/// Panics, naming `what` and the first element out of `tol`, unless `got`
/// has `want`'s length and every element is within `tol` of it.
pub fn assert_close<T: Real>(what: &str, want: &[T], got: &[T], tol: Tolerance) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: {} elements, the reference has {}",
        got.len(),
        want.len()
    );
    let largest = want.iter().fold(0f64, |m, x| m.max(x.to_f64().abs()));
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        let (w, g) = (w.to_f64(), g.to_f64());
        let bound = match tol.scale {
            Scale::Element => tol.rel * (1.0 + w.abs()),
            Scale::Tensor => tol.rel * largest,
        } + tol.abs;
        assert!(
            (w - g).abs() <= bound,
            "{what}[{i}]: reference {w} vs {g} (difference {:.3e} over the bound {bound:.3e})",
            (w - g).abs()
        );
    }
}

/// [`assert_close`] for one value (a loss).
pub fn assert_close_value(what: &str, want: f64, got: f64, tol: Tolerance) {
    assert_close(what, &[want], &[got], tol);
}

/// Scores of an inference engine against the reference's: the same
/// classes and rows, every score within `tol`.
pub fn assert_scores_close<T: Real>(what: &str, want: &Scores<T>, got: &Scores<T>, tol: Tolerance) {
    assert_eq!(got.classes, want.classes, "{what}: classes");
    assert_close(&format!("{what} score"), &want.values, &got.values, tol);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_tensor_and_the_element() {
        let err = std::panic::catch_unwind(|| {
            assert_close("dW", &[1.0f32, 2.0], &[1.0, 2.1], Tolerance::element(1e-3))
        })
        .unwrap_err();
        let msg = err.downcast_ref::<String>().unwrap();
        assert!(msg.starts_with("dW[1]: reference 2 vs 2.09"), "{msg}");
    }

    #[test]
    fn tensor_scale_forgives_small_elements_of_large_tensors() {
        let (want, got) = ([100.0f32, 0.001], [100.0f32, 0.003]);
        assert_close("t", &want, &got, Tolerance::tensor(1e-4));
        let (want, got) = ([100.0f32, 0.001], [100.0f32, 0.003]);
        assert_close("t", &want, &got, Tolerance::tensor(1e-4));
        let elementwise =
            std::panic::catch_unwind(|| assert_close("t", &want, &got, Tolerance::element(1e-4)));
        assert!(elementwise.is_err());
    }

    #[test]
    fn lengths_must_agree() {
        let r = std::panic::catch_unwind(|| {
            assert_close("x", &[1.0f64], &[1.0, 2.0], Tolerance::element(1.0))
        });
        assert!(r.is_err());
    }

    #[test]
    fn no_tolerance_below_the_type_rounding() {
        let t = Tolerance::element(0.0).at_least::<f32>(4.0);
        assert_eq!(t.rel, 4.0 * f32::EPSILON as f64);
    }
}
