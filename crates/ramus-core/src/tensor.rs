//! Dense host tensors: row-major element buffers with a shape.

use crate::error::{CoreError, Result};
use crate::real::Real;

/// A dense row-major tensor on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<T> {
    shape: Vec<usize>,
    data: Vec<T>,
}

impl<T: Real> Tensor<T> {
    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Tensor {
            shape: shape.to_vec(),
            data: vec![T::ZERO; shape.iter().product()],
        }
    }

    /// Wraps `data`, checking it holds exactly `shape`'s element count.
    pub fn from_vec(shape: &[usize], data: Vec<T>) -> Result<Self> {
        let want: usize = shape.iter().product();
        if want != data.len() {
            return Err(CoreError::TensorShape {
                name: "from_vec".into(),
                expected: shape.to_vec(),
                got: vec![data.len()],
            });
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            data,
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn data(&self) -> &[T] {
        &self.data
    }
    pub fn data_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
    pub fn into_vec(self) -> Vec<T> {
        self.data
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Sets every element to zero.
    pub fn fill_zero(&mut self) {
        self.data.iter_mut().for_each(|x| *x = T::ZERO);
    }

    /// Converts the element type (e.g. f32 weights to f64 for gradient checks).
    pub fn cast<U: Real>(&self) -> Tensor<U> {
        Tensor {
            shape: self.shape.clone(),
            data: self.data.iter().map(|&x| U::from_f64(x.to_f64())).collect(),
        }
    }

    /// Euclidean norm, accumulated in f64.
    pub fn norm(&self) -> f64 {
        self.data
            .iter()
            .map(|&x| x.to_f64() * x.to_f64())
            .sum::<f64>()
            .sqrt()
    }

    /// Largest absolute elementwise difference to `other` (shapes must match).
    pub fn max_abs_diff(&self, other: &Tensor<T>) -> Result<f64> {
        if self.shape != other.shape {
            return Err(CoreError::TensorShape {
                name: "max_abs_diff".into(),
                expected: self.shape.clone(),
                got: other.shape.clone(),
            });
        }
        Ok(self
            .data
            .iter()
            .zip(&other.data)
            .map(|(&a, &b)| (a - b).to_f64().abs())
            .fold(0.0, f64::max))
    }
}
