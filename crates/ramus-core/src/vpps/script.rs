//! Instruction encoding of the virtual persistent processors' scripts (VPPS
//! §III-B1, Fig. 6c/6d) and the single buffer that carries all scripts to the
//! device (§III-B2).
//!
//! An instruction is a sequence of 32-bit words: a *preamble*
//!
//! ```text
//! bits  0..8   op      opcode (OP_SIGNAL, OP_WAIT, or an engine opcode ≥ OP_FIRST_ENGINE)
//! bits  8..16  length  words in the instruction, preamble included (1..=255)
//! bits 16..32  arg     small immediate (barrier index, tensor length, ...)
//! ```
//!
//! followed by `length − 1` operand words, typically offsets into the
//! device's memory pool or counts. The length field lets the interpreter skip
//! to the next instruction without knowing the opcode. Signal and wait are one
//! word each, their `arg` being the barrier index.

use super::isa::{OP_SIGNAL, OP_WAIT};
use crate::error::{CoreError, Result};

/// Most operands one instruction can carry (the length field is 8 bits and
/// counts the preamble).
pub const MAX_OPERANDS: usize = 254;

const WHAT: &str = "script";

/// Builds a preamble word from its three fields.
pub fn preamble(op: u8, words: u8, arg: u16) -> u32 {
    u32::from(op) | (u32::from(words) << 8) | (u32::from(arg) << 16)
}

/// Splits a preamble word into `(op, length in words, arg)`.
pub fn split_preamble(word: u32) -> (u8, usize, u16) {
    (
        (word & 0xff) as u8,
        ((word >> 8) & 0xff) as usize,
        (word >> 16) as u16,
    )
}

/// One decoded instruction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instr {
    /// Opcode.
    pub op: u8,
    /// The preamble's 16-bit immediate.
    pub arg: u16,
    /// Operand words after the preamble (at most [`MAX_OPERANDS`]).
    pub operands: Vec<u32>,
}

impl Instr {
    /// An instruction from its parts.
    pub fn new(op: u8, arg: u16, operands: Vec<u32>) -> Self {
        Instr { op, arg, operands }
    }

    /// `SIGNAL barrier`.
    pub fn signal(barrier: u16) -> Self {
        Instr::new(OP_SIGNAL, barrier, Vec::new())
    }

    /// `WAIT barrier`.
    pub fn wait(barrier: u16) -> Self {
        Instr::new(OP_WAIT, barrier, Vec::new())
    }

    /// Encoded length in words, preamble included.
    pub fn words(&self) -> usize {
        1 + self.operands.len()
    }

    /// Appends the encoded instruction to `out`. Errors (leaving `out`
    /// unchanged) for more than [`MAX_OPERANDS`] operands or a signal/wait
    /// with operands.
    pub fn encode(&self, out: &mut Vec<u32>) -> Result<()> {
        encode_parts(self.op, self.arg, &self.operands, out)
    }
}

/// Appends the instruction `op arg operands...` to `out` without building an
/// [`Instr`]; same checks as [`Instr::encode`].
pub fn encode_parts(op: u8, arg: u16, operands: &[u32], out: &mut Vec<u32>) -> Result<()> {
    if operands.len() > MAX_OPERANDS {
        return Err(CoreError::vpps(
            WHAT,
            format!(
                "opcode {op}: {} operands, at most {MAX_OPERANDS} fit in one instruction",
                operands.len()
            ),
        ));
    }
    if (op == OP_SIGNAL || op == OP_WAIT) && !operands.is_empty() {
        return Err(CoreError::vpps(
            WHAT,
            format!(
                "control opcode {op} takes no operands, got {}",
                operands.len()
            ),
        ));
    }
    // At most 254 operands, so the length fits in 8 bits.
    out.push(preamble(op, (operands.len() + 1) as u8, arg));
    out.extend_from_slice(operands);
    Ok(())
}

/// Decodes a whole script. Errors name the word index of a zero-length
/// instruction, one that runs past the end of `words`, or a signal/wait that
/// is not one word long.
pub fn decode(words: &[u32]) -> Result<Vec<Instr>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < words.len() {
        let (op, len, arg) = split_preamble(words[at]);
        if len == 0 {
            return Err(CoreError::vpps(
                WHAT,
                format!(
                    "word {at}: zero-length instruction (preamble {:#010x})",
                    words[at]
                ),
            ));
        }
        if (op == OP_SIGNAL || op == OP_WAIT) && len != 1 {
            return Err(CoreError::vpps(
                WHAT,
                format!("word {at}: control opcode {op} with length {len}, expected 1"),
            ));
        }
        let Some(operands) = words.get(at + 1..at + len) else {
            return Err(CoreError::vpps(
                WHAT,
                format!(
                    "word {at}: truncated instruction (opcode {op}) of {len} words, only {} left",
                    words.len() - at
                ),
            ));
        };
        out.push(Instr::new(op, arg, operands.to_vec()));
        at += len;
    }
    Ok(out)
}

/// All scripts of one batch in one buffer, for a single host→device copy:
///
/// ```text
/// [prefix: vpps + 1 words] [script 0][script 1]...[script vpps-1] [barrier_expect: barriers words] [operand pool]
///  ^ prefix_at = 0          ^ scripts_at                          ^ barrier_expect_at             ^ operands_at
/// ```
///
/// `prefix[v]` is the word offset of script `v` relative to `scripts_at`,
/// `prefix[vpps]` the total length of all scripts. `barrier_expect[b]` is how
/// many signals complete barrier `b` (the device's counters start at zero for
/// each batch). Operands that point "into the operand pool" are word offsets
/// relative to `operands_at`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedScripts {
    /// The whole buffer.
    pub words: Vec<u32>,
    /// Number of scripts (virtual processors).
    pub vpps: usize,
    /// Number of barriers.
    pub barriers: usize,
    /// Word offset of the prefix sums (always 0).
    pub prefix_at: usize,
    /// Word offset of the first script.
    pub scripts_at: usize,
    /// Word offset of the barrier expectations.
    pub barrier_expect_at: usize,
    /// Word offset of the operand pool.
    pub operands_at: usize,
}

impl PackedScripts {
    /// Packs one encoded script per VPP, the signals that complete each
    /// barrier and the operand pool. Errors if the buffer would not be
    /// addressable with 32-bit offsets or there are no scripts.
    pub fn pack(
        scripts: &[Vec<u32>],
        barrier_expect: &[u32],
        operand_pool: &[u32],
    ) -> Result<Self> {
        if scripts.is_empty() {
            return Err(CoreError::vpps(
                WHAT,
                "no virtual processors to pack scripts for",
            ));
        }
        let vpps = scripts.len();
        let script_words: usize = scripts.iter().map(Vec::len).sum();
        let mut words = Vec::with_capacity(vpps + 1 + script_words);
        let mut offset = 0usize;
        words.push(0);
        for s in scripts {
            offset += s.len();
            words.push(u32::try_from(offset).map_err(|_| {
                CoreError::vpps(WHAT, format!("{offset} script words exceed 32-bit offsets"))
            })?);
        }
        for s in scripts {
            words.extend_from_slice(s);
        }
        Self::assemble(words, vpps, barrier_expect, operand_pool)
    }

    /// [`pack`](Self::pack) for scripts already laid out: `words` holds
    /// the prefix sums (`vpps + 1` words) and the scripts after them;
    /// the barrier expectations and the operand pool are appended.
    pub(crate) fn assemble(
        mut words: Vec<u32>,
        vpps: usize,
        barrier_expect: &[u32],
        operand_pool: &[u32],
    ) -> Result<Self> {
        if vpps == 0 {
            return Err(CoreError::vpps(
                WHAT,
                "no virtual processors to pack scripts for",
            ));
        }
        let scripts_at = vpps + 1;
        let barrier_expect_at = words.len();
        let operands_at = barrier_expect_at + barrier_expect.len();
        let total = operands_at + operand_pool.len();
        if total > u32::MAX as usize {
            return Err(CoreError::vpps(
                WHAT,
                format!("packed scripts of {total} words exceed 32-bit offsets"),
            ));
        }
        words.reserve(total - words.len());
        words.extend_from_slice(barrier_expect);
        words.extend_from_slice(operand_pool);
        Ok(PackedScripts {
            words,
            vpps,
            barriers: barrier_expect.len(),
            prefix_at: 0,
            scripts_at,
            barrier_expect_at,
            operands_at,
        })
    }

    /// The script of virtual processor `vpp` (empty for `vpp ≥ vpps`).
    pub fn script(&self, vpp: usize) -> &[u32] {
        if vpp >= self.vpps {
            return &[];
        }
        let bound = |i: usize| {
            self.words
                .get(self.prefix_at + i)
                .map_or(0, |&w| self.scripts_at + w as usize)
        };
        self.words.get(bound(vpp)..bound(vpp + 1)).unwrap_or(&[])
    }

    /// Decodes the script of `vpp`.
    pub fn decode_script(&self, vpp: usize) -> Result<Vec<Instr>> {
        decode(self.script(vpp)).map_err(|e| CoreError::vpps(WHAT, format!("vpp {vpp}: {e}")))
    }

    /// The operand pool.
    pub fn operand_pool(&self) -> &[u32] {
        self.words.get(self.operands_at..).unwrap_or(&[])
    }

    /// All barrier expectations.
    pub fn barrier_expects(&self) -> &[u32] {
        self.words
            .get(self.barrier_expect_at..self.operands_at)
            .unwrap_or(&[])
    }

    /// How many signals complete barrier `b` (`None` for `b ≥ barriers`).
    pub fn barrier_expect(&self, b: usize) -> Option<u32> {
        self.barrier_expects().get(b).copied()
    }

    /// The buffer as little-endian bytes, as the device reads it.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vpps::isa::OP_FIRST_ENGINE;

    #[test]
    fn preamble_layout() {
        assert_eq!(preamble(0x12, 3, 0xbeef), 0xbeef_0312);
        assert_eq!(split_preamble(0xbeef_0312), (0x12, 3, 0xbeef));
        let mut out = Vec::new();
        Instr::new(20, 7, vec![100, 200]).encode(&mut out).unwrap();
        assert_eq!(out, vec![20 | (3 << 8) | (7 << 16), 100, 200]);
        out.clear();
        Instr::signal(5).encode(&mut out).unwrap();
        Instr::wait(6).encode(&mut out).unwrap();
        assert_eq!(
            out,
            vec![OP_SIGNAL as u32 | 1 << 8 | 5 << 16, 2 | 1 << 8 | 6 << 16]
        );
    }

    #[test]
    fn round_trip() {
        let instrs = vec![
            Instr::wait(0),
            Instr::new(OP_FIRST_ENGINE, 256, vec![1, 2, 3]),
            Instr::new(255, u16::MAX, vec![u32::MAX; MAX_OPERANDS]),
            Instr::new(17, 0, vec![]),
            Instr::signal(u16::MAX),
        ];
        let mut words = Vec::new();
        for i in &instrs {
            i.encode(&mut words).unwrap();
        }
        assert_eq!(words.len(), instrs.iter().map(Instr::words).sum::<usize>());
        assert_eq!(decode(&words).unwrap(), instrs);
        assert!(decode(&[]).unwrap().is_empty());
    }

    #[test]
    fn encode_rejects_oversized_and_bad_control() {
        let mut out = vec![9];
        let err = Instr::new(16, 0, vec![0; MAX_OPERANDS + 1])
            .encode(&mut out)
            .unwrap_err();
        assert!(err.to_string().contains("255 operands"), "{err}");
        assert!(Instr::new(OP_WAIT, 0, vec![1]).encode(&mut out).is_err());
        assert_eq!(out, vec![9]);
    }

    #[test]
    fn malformed_scripts_name_the_word() {
        let mut words = Vec::new();
        Instr::new(16, 0, vec![1]).encode(&mut words).unwrap();
        words.push(0);
        let err = decode(&words).unwrap_err().to_string();
        assert!(err.contains("word 2: zero-length"), "{err}");
        words.pop();
        words.push(preamble(17, 4, 0));
        words.push(1);
        let err = decode(&words).unwrap_err().to_string();
        assert!(err.contains("word 2: truncated"), "{err}");
        let err = decode(&[preamble(OP_SIGNAL, 2, 0), 0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("word 0: control opcode 1"), "{err}");
    }

    #[test]
    fn packed_layout() {
        let s0 = vec![preamble(16, 2, 0), 7];
        let s1 = vec![];
        let s2 = vec![preamble(OP_WAIT, 1, 0)];
        let p = PackedScripts::pack(&[s0.clone(), s1, s2.clone()], &[2], &[40, 41]).unwrap();
        assert_eq!(
            (
                p.vpps,
                p.barriers,
                p.prefix_at,
                p.scripts_at,
                p.barrier_expect_at,
                p.operands_at
            ),
            (3, 1, 0, 4, 7, 8)
        );
        assert_eq!(&p.words[..4], &[0, 2, 2, 3]);
        assert_eq!(p.script(0), &s0[..]);
        assert!(p.script(1).is_empty());
        assert_eq!(p.script(2), &s2[..]);
        assert!(p.script(3).is_empty());
        assert_eq!(p.barrier_expect(0), Some(2));
        assert_eq!(p.barrier_expect(1), None);
        assert_eq!(p.operand_pool(), &[40, 41]);
        assert_eq!(p.words.len(), 10);
        assert_eq!(p.to_le_bytes().len(), 40);
        assert_eq!(p.decode_script(2).unwrap(), vec![Instr::wait(0)]);
        assert!(PackedScripts::pack(&[], &[], &[]).is_err());
    }
}
