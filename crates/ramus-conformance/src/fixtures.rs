//! Small pieces the engines' tests build their own models and data from:
//! deterministic values, the softmax classifier head and the binary
//! recursive cell most fixture models use. (The zoo's own models are in
//! [`crate::zoo`].)

use ramus_core::model::{HeadBuilder, VertexFnBuilder};
use ramus_core::Sym;

/// Deterministic values in [-1, 1) from `seed` (xorshift), the same on
/// every platform.
pub fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The fixture models' head: logits `W_out x` (parameter `w_out`, no
/// bias), softmax cross-entropy against the labels, the mean over rows as
/// the loss.
pub fn softmax_head(hd: &mut HeadBuilder, w_out: usize) {
    let x = hd.input();
    let w = hd.param(w_out);
    let logits = hd.linear(x, w, None);
    let labels = hd.labels();
    let loss = hd.softmax_xent(logits, labels);
    let loss = hd.mean_rows(loss);
    hd.loss(loss);
    hd.logits(logits);
}

/// The binary recursive cell `h = act(W [h_l; h_r] + b)` over a vertex's
/// two children, scattered as the state and pushed as the value.
pub fn binary_cell(
    f: &mut VertexFnBuilder,
    w: usize,
    b: Option<usize>,
    act: impl FnOnce(&mut VertexFnBuilder, Sym) -> Sym,
) {
    let (l, r) = (f.gather(0), f.gather(1));
    let lr = f.concat(&[l, r]);
    let w = f.param(w);
    let b = b.map(|b| f.param(b));
    let z = f.linear(lr, w, b);
    let h = act(f, z);
    f.scatter(h);
    f.push(h);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_deterministic_and_in_range() {
        let a = values(1000, 3);
        assert_eq!(a, values(1000, 3));
        assert_ne!(a, values(1000, 4));
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
    }
}
