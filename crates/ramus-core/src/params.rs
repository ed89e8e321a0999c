//! Parameter values and gradient buffers of a model.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal, Uniform};

use crate::error::{CoreError, Result};
use crate::model::{Init, Model, ParamSpec};
use crate::real::Real;
use crate::tensor::Tensor;

/// Draws initial values for one parameter.
fn init_values(spec: &ParamSpec, rng: &mut ChaCha8Rng) -> Vec<f64> {
    let n: usize = spec.shape.iter().product();
    let fan_in = *spec.shape.last().unwrap_or(&1) as f64;
    let fan_out = if spec.shape.len() > 1 {
        spec.shape[0] as f64
    } else {
        1.0
    };
    let uniform = |bound: f64, rng: &mut ChaCha8Rng| -> Vec<f64> {
        match Uniform::new_inclusive(-bound, bound) {
            Ok(d) => (0..n).map(|_| d.sample(rng)).collect(),
            Err(_) => vec![0.0; n],
        }
    };
    match spec.init {
        Init::Zeros => vec![0.0; n],
        Init::Normal { std } => (0..n)
            .map(|_| {
                let z: f64 = StandardNormal.sample(rng);
                std * z
            })
            .collect(),
        Init::Uniform { bound } => uniform(bound, rng),
        Init::LinearDefault => uniform(1.0 / fan_in.max(1.0).sqrt(), rng),
        Init::Xavier => uniform((6.0 / (fan_in + fan_out)).sqrt(), rng),
        Init::Kaiming => {
            let fan_in: usize = spec.shape.iter().skip(1).product();
            let std = (2.0 / fan_in.max(1) as f64).sqrt();
            (0..n)
                .map(|_| {
                    let z: f64 = StandardNormal.sample(rng);
                    std * z
                })
                .collect()
        }
        Init::Constant { value } => vec![value; n],
        Init::Identity {
            n: size,
            scale,
            std,
        } => (0..n)
            .map(|f| {
                let z: f64 = StandardNormal.sample(rng);
                let diagonal = size > 0 && (f / size) % size == f % size;
                std * z + if diagonal { scale } else { 0.0 }
            })
            .collect(),
    }
}

/// The values of a model's parameters, in declaration order.
///
/// Engines cache values derived from the parameters (packed weights,
/// per-token tables) under the parameters' [`Params::version`]: a process-wide
/// unique instance id (clones get a new one) and a generation counting
/// updates. Code that edits `values` directly must call [`Params::touch`].
#[derive(Debug)]
pub struct Params<T> {
    pub values: Vec<Tensor<T>>,
    instance: u64,
    generation: u64,
}

static NEXT_INSTANCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn new_instance() -> u64 {
    NEXT_INSTANCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl<T: Clone> Clone for Params<T> {
    fn clone(&self) -> Self {
        Params {
            values: self.values.clone(),
            instance: new_instance(),
            generation: 0,
        }
    }
}

/// Equal values (versions are not compared).
impl<T: PartialEq> PartialEq for Params<T> {
    fn eq(&self, other: &Self) -> bool {
        self.values == other.values
    }
}

impl<T: Real> Params<T> {
    /// Initial values drawn from each parameter's initialiser. Parameter `i`
    /// uses its own stream derived from `seed`, so adding a parameter does not
    /// change the others.
    pub fn init(model: &Model, seed: u64) -> Self {
        let values = model
            .params
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                let mut rng = ChaCha8Rng::seed_from_u64(
                    seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i as u64 + 1)),
                );
                let v = init_values(spec, &mut rng)
                    .into_iter()
                    .map(T::from_f64)
                    .collect();
                Tensor::from_vec(&spec.shape, v).unwrap_or_else(|_| Tensor::zeros(&spec.shape))
            })
            .collect();
        Params {
            values,
            instance: new_instance(),
            generation: 0,
        }
    }

    /// Values given explicitly, checked against the model's shapes.
    pub fn from_tensors(model: &Model, values: Vec<Tensor<T>>) -> Result<Self> {
        if values.len() != model.params.len() {
            return Err(CoreError::model(
                &model.name,
                format!(
                    "expected {} parameters, got {}",
                    model.params.len(),
                    values.len()
                ),
            ));
        }
        for (spec, v) in model.params.iter().zip(&values) {
            if v.shape() != spec.shape.as_slice() {
                return Err(CoreError::TensorShape {
                    name: spec.name.clone(),
                    expected: spec.shape.clone(),
                    got: v.shape().to_vec(),
                });
            }
        }
        Ok(Params {
            values,
            instance: new_instance(),
            generation: 0,
        })
    }

    /// Marks the values as changed (optimizers call this after each step).
    pub fn touch(&mut self) {
        self.generation += 1;
    }

    /// Identifies these exact values: (instance id, generation).
    pub fn version(&self) -> (u64, u64) {
        (self.instance, self.generation)
    }

    /// Converts the element type.
    pub fn cast<U: Real>(&self) -> Params<U> {
        Params {
            values: self.values.iter().map(|t| t.cast()).collect(),
            instance: new_instance(),
            generation: 0,
        }
    }
}

/// Gradient buffers: one dense tensor per parameter, plus the set of rows
/// touched by sparse (embedding) updates so that clearing and optimizer
/// steps only visit those rows.
#[derive(Clone, Debug)]
pub struct Grads<T> {
    pub values: Vec<Tensor<T>>,
    /// For parameters that only received row gradients: the touched rows
    /// (sorted, unique). `None` means the gradient is dense.
    pub touched_rows: Vec<Option<Vec<u32>>>,
    /// Per-parameter marks used while collecting touched rows.
    row_marks: Vec<Vec<bool>>,
    dense: Vec<bool>,
    /// Parameters that are non-trained buffers ([`crate::ParamKind::Buffer`]):
    /// optimizers skip them.
    buffers: Vec<bool>,
}

impl<T: Real> Grads<T> {
    /// Zero gradients shaped like `model`'s parameters.
    pub fn zeros(model: &Model) -> Self {
        let values: Vec<Tensor<T>> = model
            .params
            .iter()
            .map(|p| Tensor::zeros(&p.shape))
            .collect();
        let n = values.len();
        Grads {
            values,
            touched_rows: vec![Some(Vec::new()); n],
            row_marks: vec![Vec::new(); n],
            dense: vec![false; n],
            buffers: (0..n).map(|p| model.is_buffer(p)).collect(),
        }
    }

    /// True when parameter `p` is a non-trained buffer that optimizers skip.
    pub fn is_buffer(&self, p: usize) -> bool {
        self.buffers.get(p).copied().unwrap_or(false)
    }

    /// Notes that parameter `p` received a dense gradient.
    pub fn mark_dense(&mut self, p: usize) {
        self.dense[p] = true;
        self.touched_rows[p] = None;
    }

    /// Notes that row `row` of parameter `p` received gradient.
    pub fn mark_row(&mut self, p: usize, row: u32) {
        if self.dense[p] {
            return;
        }
        let rows = self.values[p].shape().first().copied().unwrap_or(0);
        let marks = &mut self.row_marks[p];
        if marks.len() != rows {
            marks.resize(rows, false);
        }
        if let Some(m) = marks.get_mut(row as usize) {
            if !*m {
                *m = true;
                if let Some(t) = self.touched_rows[p].as_mut() {
                    t.push(row);
                }
            }
        }
    }

    /// Sorts touched-row lists (call once after a backward pass).
    pub fn finish_rows(&mut self) {
        for t in self.touched_rows.iter_mut().flatten() {
            t.sort_unstable();
        }
    }

    /// Adds `other` times `scale` (same shapes): its dense gradients whole,
    /// its row gradients row by row, their rows marked here too.
    pub fn add_scaled(&mut self, other: &Grads<T>, scale: T) {
        for p in 0..self.values.len() {
            let w = self.row_width(p);
            let src = other.values[p].data();
            match &other.touched_rows[p] {
                None => {
                    self.mark_dense(p);
                    let dst = self.values[p].data_mut();
                    dst.iter_mut().zip(src).for_each(|(d, s)| *d += scale * *s);
                }
                Some(rows) => {
                    for &r in rows {
                        self.mark_row(p, r);
                        let at = r as usize * w..(r as usize + 1) * w;
                        let dst = &mut self.values[p].data_mut()[at.clone()];
                        dst.iter_mut()
                            .zip(&src[at])
                            .for_each(|(d, s)| *d += scale * *s);
                    }
                }
            }
        }
        self.finish_rows();
    }

    /// Width of one row of parameter `p` (for row-wise updates).
    pub fn row_width(&self, p: usize) -> usize {
        let s = self.values[p].shape();
        s.iter().skip(1).product()
    }

    /// Resets all gradients to zero, visiting only touched rows where possible.
    pub fn clear(&mut self) {
        for p in 0..self.values.len() {
            if self.dense[p] {
                self.values[p].fill_zero();
                // rows marked before the gradient turned dense
                self.row_marks[p].fill(false);
            } else if let Some(rows) = &self.touched_rows[p] {
                let w = self.row_width(p);
                let data = self.values[p].data_mut();
                for &r in rows {
                    data[r as usize * w..(r as usize + 1) * w]
                        .iter_mut()
                        .for_each(|x| *x = T::ZERO);
                    self.row_marks[p][r as usize] = false;
                }
            }
            self.dense[p] = false;
            self.touched_rows[p] = Some(Vec::new());
        }
    }

    /// Global L2 norm of all gradients.
    pub fn norm(&self) -> f64 {
        let mut s = 0.0;
        for p in 0..self.values.len() {
            match &self.touched_rows[p] {
                None => {
                    s += self.values[p]
                        .data()
                        .iter()
                        .map(|&x| x.to_f64() * x.to_f64())
                        .sum::<f64>()
                }
                Some(rows) => {
                    let w = self.row_width(p);
                    let d = self.values[p].data();
                    for &r in rows {
                        s += d[r as usize * w..(r as usize + 1) * w]
                            .iter()
                            .map(|&x| x.to_f64() * x.to_f64())
                            .sum::<f64>();
                    }
                }
            }
        }
        s.sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(shape: &[usize], init: Init) -> Vec<f64> {
        let spec = ParamSpec {
            name: "p".into(),
            shape: shape.to_vec(),
            init,
            kind: crate::model::ParamKind::Trained,
        };
        init_values(&spec, &mut ChaCha8Rng::seed_from_u64(3))
    }

    #[test]
    fn kaiming_uses_the_fan_in_of_every_trailing_dimension() {
        // a conv weight [O, C, kh, kw]: fan_in = C*kh*kw = 72, std = 1/6
        let v = draw(&[64, 8, 3, 3], Init::Kaiming);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        let want = 2.0 / 72.0;
        assert!((var / want - 1.0).abs() < 0.05, "variance {var} vs {want}");
        // the same weight flattened to [O, C*kh*kw] has the same fan-in
        let flat = draw(&[64, 72], Init::Kaiming);
        assert_eq!(v, flat);
    }

    #[test]
    fn identity_blocks_on_the_diagonals() {
        let v = draw(
            &[2, 9],
            Init::Identity {
                n: 3,
                scale: 1.0,
                std: 0.0,
            },
        );
        let eye = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0];
        assert_eq!(&v[..9], &eye);
        assert_eq!(&v[9..], &eye);
        // [2n, n] = [I; I]·scale, with noise around it
        let v = draw(
            &[4, 2],
            Init::Identity {
                n: 2,
                scale: 0.5,
                std: 0.01,
            },
        );
        for (f, x) in v.iter().enumerate() {
            let want = if (f / 2) % 2 == f % 2 { 0.5 } else { 0.0 };
            assert!((x - want).abs() < 0.05, "element {f}: {x} vs {want}");
        }
        assert!(v.iter().any(|&x| x != 0.0 && x != 0.5), "noise is drawn");
    }

    #[test]
    fn constant_fills_every_element() {
        assert_eq!(draw(&[2, 3], Init::Constant { value: 1.5 }), vec![1.5; 6]);
    }
}
