//! Random mutations of real inputs, for the readers' property tests (this
//! crate's and, through the `testing` feature, `ramus-nn`'s checkpoint and
//! the CLI's image folder tests): bit flips, inserted snippets (the formats'
//! own structure characters, invalid UTF-8, huge numbers, random bytes),
//! deleted and duplicated ranges, truncation, blanking.
//!
//! Each property test runs [`cases`] cases: a fixed number in CI, more
//! with `RAMUS_PROPTEST_CASES=N`.
//!
//! Also the poisoned images of the engines' numerical-fault tests
//! ([`images_with_nan_pixel`]).

use proptest::prelude::*;
use proptest::test_runner::Config;

use crate::images::{self, ImageSpec};
use crate::InputGraph;

/// One change to a byte string; positions are fractions of its length
/// (in `[0, 1)`).
#[derive(Clone, Debug)]
pub enum Mutation {
    /// Flips bit `bit` of the byte at `at`.
    Flip { at: f64, bit: u8 },
    /// Inserts `bytes` before the byte at `at`.
    Insert { at: f64, bytes: Vec<u8> },
    /// Removes up to `len` bytes from `at`.
    Delete { at: f64, len: usize },
    /// Keeps the bytes before `at` only.
    Truncate { at: f64 },
    /// Turns every byte but the line breaks into a space (a blank file).
    Blank,
    /// Inserts a copy of up to `len` bytes from `from` before `to`.
    Duplicate { from: f64, to: f64, len: usize },
}

/// What [`Mutation::Insert`] inserts besides random bytes: the structure
/// characters of bracket trees, tagged text and JSON, whitespace the
/// readers treat specially, invalid UTF-8 (a stray continuation byte, a
/// truncated sequence, an encoded surrogate, an overlong encoding) and
/// numbers too large for any size or label.
const SNIPPETS: &[&[u8]] = &[
    b"(",
    b")",
    b"()",
    b"(3 ",
    b"|",
    b"|O",
    b" ",
    b"\n",
    b"\r\n",
    b"\t",
    "\u{a0}".as_bytes(),
    "\u{2028}".as_bytes(),
    "\u{e9}".as_bytes(),
    b"\\",
    b"\\/",
    b"\"",
    b"\\u",
    b"\\uD800",
    b"[",
    b"]",
    b",",
    b"{",
    b"}",
    b":",
    b"\0",
    b"\xff",
    b"\x80",
    b"\xc3",
    b"\xed\xa0\x80",
    b"\xc0\xaf",
    b"-1",
    b"2147483648",
    b"4294967296",
    b"18446744073709551616",
    b"99999999999999999999999999999999",
    b"1e400",
];

/// Positions: fractions of the input's length.
const POS: std::ops::Range<f64> = 0.0..1.0;

/// A random [`Mutation`].
pub fn mutation() -> impl Strategy<Value = Mutation> {
    let bytes = prop_oneof![
        3 => proptest::sample::select(SNIPPETS).prop_map(<[u8]>::to_vec),
        1 => proptest::collection::vec(any::<u8>(), 1..9),
    ];
    prop_oneof![
        3 => (POS, 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        4 => (POS, bytes).prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        2 => (POS, 1usize..64).prop_map(|(at, len)| Mutation::Delete { at, len }),
        1 => prop_oneof![Just(0.0), POS].prop_map(|at| Mutation::Truncate { at }),
        1 => Just(Mutation::Blank),
        1 => (POS, POS, 1usize..256)
            .prop_map(|(from, to, len)| Mutation::Duplicate { from, to, len }),
    ]
}

/// One to three random mutations.
pub fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    proptest::collection::vec(mutation(), 1..4)
}

/// `input` with `mutations` applied in order.
pub fn apply(input: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut out = input.to_vec();
    // a byte at fraction `at` of 0..len, a place at fraction `at` of 0..=len
    let byte = |at: f64, len: usize| ((at * len as f64) as usize).min(len.saturating_sub(1));
    let place = |at: f64, len: usize| ((at * (len + 1) as f64) as usize).min(len);
    for m in mutations {
        let len = out.len();
        match m {
            Mutation::Flip { at, bit } => {
                if len > 0 {
                    out[byte(*at, len)] ^= 1 << bit;
                }
            }
            Mutation::Insert { at, bytes } => {
                let p = place(*at, len);
                out.splice(p..p, bytes.iter().copied());
            }
            Mutation::Delete { at, len: n } => {
                let p = place(*at, len);
                out.drain(p..(p + n).min(len));
            }
            Mutation::Truncate { at } => out.truncate(place(*at, len)),
            Mutation::Blank => out
                .iter_mut()
                .filter(|b| **b != b'\n')
                .for_each(|b| *b = b' '),
            Mutation::Duplicate { from, to, len: n } => {
                let p = place(*from, len);
                let copy = out[p..(p + n).min(len)].to_vec();
                let q = place(*to, len);
                out.splice(q..q, copy);
            }
        }
    }
    out
}

/// Cases per property test: `default`, or `RAMUS_PROPTEST_CASES` when set.
pub fn cases(default: u32) -> u32 {
    std::env::var("RAMUS_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A proptest configuration running [`cases`]`(default)` cases.
pub fn config(default: u32) -> Config {
    Config {
        cases: cases(default),
        ..Config::default()
    }
}

/// The images of the numerical-fault tests: 3×8×8 pixels, three classes.
pub const SMALL_IMAGES: ImageSpec = ImageSpec {
    channels: 3,
    height: 8,
    width: 8,
    classes: 3,
    noise: 0.3,
};

/// `count` training images of [`SMALL_IMAGES`] (seed 3); those at
/// `nan_pixel` have a NaN pixel, so every batch holding one has a NaN loss
/// while the parameters stay finite.
pub fn images_with_nan_pixel(count: usize, nan_pixel: &[usize]) -> Vec<InputGraph> {
    let mut data = images::generate(&SMALL_IMAGES, 3, (count, 0, 0))
        .expect("the small images are valid")
        .train;
    for &i in nan_pixel {
        let mut pixels = data[i].features(0).to_vec();
        pixels[5] = f32::NAN;
        data[i]
            .set_features(pixels.len(), pixels)
            .expect("the image keeps its width");
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    #[test]
    fn mutations_change_inputs_and_stay_in_bounds() {
        let mut runner = TestRunner::deterministic();
        let input = b"(3 (2 a) (1 b))\n(1 c)\n";
        let mut changed = 0;
        for _ in 0..500 {
            let ms = mutations().new_tree(&mut runner).unwrap().current();
            let out = apply(input, &ms);
            changed += usize::from(out != input);
            // an empty input takes every kind of mutation too
            apply(b"", &ms);
        }
        assert!(changed > 450, "only {changed} of 500 mutated inputs differ");
        let ins = Mutation::Insert {
            at: 0.5,
            bytes: b"xy".to_vec(),
        };
        assert_eq!(apply(b"abcd", &[ins]), b"abxycd");
        let dup = Mutation::Duplicate {
            from: 0.0,
            to: 0.99,
            len: 2,
        };
        assert_eq!(apply(b"abcd", &[dup]), b"abcdab");
    }

    #[test]
    fn only_the_named_images_have_a_nan_pixel() {
        let data = images_with_nan_pixel(6, &[1, 4]);
        let nan: Vec<bool> = data
            .iter()
            .map(|g| g.features(0).iter().any(|x| x.is_nan()))
            .collect();
        assert_eq!(nan, [false, true, false, false, true, false]);
    }
}
