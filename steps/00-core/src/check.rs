//! The checks every method runs before any work, and the error every method returns.

use std::fmt;

use ndarray::ArrayView4;
use serde::{Deserialize, Serialize};

/// The shape of one attention call: `[batch, heads, tokens, head_dim]`, as PyTorch lays it
/// out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub batch: usize,
    pub heads: usize,
    pub tokens: usize,
    pub head_dim: usize,
}

impl Shape {
    pub fn new(batch: usize, heads: usize, tokens: usize, head_dim: usize) -> Self {
        Shape {
            batch,
            heads,
            tokens,
            head_dim,
        }
    }

    /// `[batch, heads, tokens, head_dim]`, for `Array4::zeros` and friends.
    pub fn dims(&self) -> [usize; 4] {
        [self.batch, self.heads, self.tokens, self.head_dim]
    }

    /// Number of values in one of q, k, v or the output.
    pub fn len(&self) -> usize {
        self.batch * self.heads * self.tokens * self.head_dim
    }

    /// [`Shape::len`], or an error naming the shape when it overflows the machine's word,
    /// so a caller can check a shape it was given before it allocates anything.
    pub fn checked_len(&self) -> Result<usize, AttnError> {
        self.batch
            .checked_mul(self.heads)
            .and_then(|n| n.checked_mul(self.tokens))
            .and_then(|n| n.checked_mul(self.head_dim))
            .filter(|&n| n <= isize::MAX as usize / 4)
            .ok_or_else(|| AttnError::Unsupported {
                what: format!("{self} has more values than this machine can address"),
            })
    }

    /// True when there is nothing to compute: no sequence, no head or no token.
    pub fn is_empty(&self) -> bool {
        self.batch == 0 || self.heads == 0 || self.tokens == 0
    }

    /// The scale of the scores, `1/√d`.
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    // [step 03]
    /// `log2(e)/√d`, the scale the kernels take: scores in base-2 units, so the softmax can
    /// call `exp2` (FlashAttention-2's `softmax_scale_log2`).
    pub fn scale_log2(&self) -> f32 {
        (std::f64::consts::LOG2_E / (self.head_dim as f64).sqrt()) as f32
    }
    // [/step 03]

    // ANCHOR: flops
    /// Floating-point operations of the causal forward pass as FlashAttention, Triton and
    /// the series this book follows count them: two products of `T·T·D` multiply-adds per
    /// head, halved by the mask, `4·B·H·T²·D / 2`.
    pub fn forward_flops(&self) -> f64 {
        4.0 * self.batch as f64
            * self.heads as f64
            * (self.tokens as f64).powi(2)
            * self.head_dim as f64
            / 2.0
    }

    // [step 04]
    /// The backward pass counted the same way: five products where the forward has two, so
    /// 2.5 forwards.
    pub fn backward_flops(&self) -> f64 {
        2.5 * self.forward_flops()
    }
    // [/step 04]

    /// The FLOPs of one measured pass.
    pub fn flops(&self, pass: Pass) -> f64 {
        match pass {
            Pass::Forward => self.forward_flops(),
            // [step 04]
            Pass::ForwardBackward => self.forward_flops() + self.backward_flops(),
            // [/step 04]
        }
    }
    // ANCHOR_END: flops
}

/// What a measurement times: the forward pass, or the forward and the backward after it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum Pass {
    #[serde(rename = "fwd")]
    Forward,
    // [step 04]
    #[serde(rename = "fwd+bwd")]
    ForwardBackward,
    // [/step 04]
}

impl Pass {
    /// Every pass, in the order the charts draw them.
    pub const ALL: &[Pass] = &[
        Pass::Forward,
        // [step 04]
        Pass::ForwardBackward,
        // [/step 04]
    ];

    /// The name the JSON rows carry: `fwd`, `fwd+bwd`.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "fwd",
            // [step 04]
            Pass::ForwardBackward => "fwd+bwd",
            // [/step 04]
        }
    }

    /// The pass a JSON row names.
    pub fn parse(name: &str) -> Option<Pass> {
        Pass::ALL.iter().copied().find(|p| p.name() == name)
    }
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[batch {}, heads {}, tokens {}, head_dim {}]",
            self.batch, self.heads, self.tokens, self.head_dim
        )
    }
}

/// Why an attention call refused its input or could not finish.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AttnError {
    /// q, k and v (or an output gradient) do not all have one shape.
    #[error(
        "shape mismatch: {what}; q, k and v must all be [batch, heads, tokens, head_dim] with the same four sizes"
    )]
    ShapeMismatch { what: String },
    /// The head dim is zero, so the scale `1/√d` is undefined.
    #[error(
        "head_dim is 0: the scores are scaled by 1/sqrt(head_dim), so head_dim must be at least 1"
    )]
    ZeroHeadDim,
    /// The method handles only some head dims.
    #[error("head_dim {head_dim} is not supported by this method; supported: {supported}")]
    UnsupportedHeadDim { head_dim: usize, supported: String },
    /// Some other size the method cannot take (too many tokens for its indices, say).
    #[error("unsupported input: {what}")]
    Unsupported { what: String },
    /// An input holds a NaN or an infinity: `what` names the tensor, the first such value
    /// and its position.
    #[error(
        "non-finite input: {what}; every value of q, k, v (and dout) must be a finite number"
    )]
    NonFinite { what: String },
    /// Allocating `bytes` failed: the input is too large for this method on this machine.
    /// `bytes` is 0 when the allocator did not say how much was asked for (a GPU driver).
    #[error(
        "out of memory: {what}{}; try fewer tokens, sequences or heads, or a method that keeps no T×T table",
        needs(*.bytes)
    )]
    OutOfMemory { what: String, bytes: u128 },
    /// No usable device, or the device failed (no GPU, no NVRTC, a failed compile or
    /// launch).
    #[error("device error: {what}")]
    Device { what: String },
    // [step 04]
    /// A backward pass was asked of a method that has none.
    #[error("no backward pass in {method:?}")]
    NoBackward { method: String },
    // [/step 04]
}

/// What an [`AttnError::OutOfMemory`] says of its size: the megabytes asked for, or that
/// the device said no without a number.
fn needs(bytes: u128) -> String {
    match bytes {
        0 => ": the device said out of memory".to_string(),
        _ => format!(" needs {:.1} MB", bytes as f64 / 1e6),
    }
}

// [step 08]
/// The shape k and v have in grouped-query attention: q's, with `kv_heads` heads, each
/// shared by `q_heads / kv_heads` query heads. `kv_heads` must divide `q_heads` (1 is
/// multi-query attention, `q_heads` plain multi-head attention); an error names the heads
/// and the counts accepted.
pub fn grouped_kv(q: Shape, kv_heads: usize) -> Result<Shape, AttnError> {
    if q.heads == 0 && kv_heads == 0 {
        return Ok(q);
    }
    if kv_heads == 0 || !q.heads.is_multiple_of(kv_heads) {
        return Err(AttnError::Unsupported {
            what: format!(
                "q has {} heads and k and v {kv_heads}: grouped-query attention shares each \
                 kv head among g query heads, so the kv heads must divide the query heads; \
                 accepted for {} query heads: {}",
                q.heads,
                q.heads,
                divisors(q.heads)
            ),
        });
    }
    Ok(Shape {
        heads: kv_heads,
        ..q
    })
}

/// The divisors of `n`, in order, as a list in words: the kv head counts `n` query heads
/// accept.
pub fn divisors(n: usize) -> String {
    let all: Vec<String> = (1..=n)
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect();
    all.join(", ")
}
// [/step 08]

// ANCHOR: check_qkv
/// Checks q, k and v before any work and returns their common shape.
///
/// Accepted: three arrays `[batch, heads, tokens, head_dim]` of one shape, with `head_dim ≥
/// 1`, holding finite numbers. Zero sequences, heads or tokens are accepted and give an
/// empty output. A NaN or an infinity is refused rather than computed with: a method would
/// spread it over whatever it shares a block with (a masked probability of 0 times an
/// infinite value is NaN), so the answer would depend on the method's block size.
pub fn check_qkv<A: Copy + Into<f64>>(
    q: &ArrayView4<A>,
    k: &ArrayView4<A>,
    v: &ArrayView4<A>,
) -> Result<Shape, AttnError> {
    let (qd, kd, vd) = (q.dim(), k.dim(), v.dim());
    if qd != kd || qd != vd {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "q is {:?}, k is {:?}, v is {:?}",
                <[usize; 4]>::from(qd),
                <[usize; 4]>::from(kd),
                <[usize; 4]>::from(vd)
            ),
        });
    }
    let (batch, heads, tokens, head_dim) = qd;
    if head_dim == 0 {
        return Err(AttnError::ZeroHeadDim);
    }
    check_finite("q", q)?;
    check_finite("k", k)?;
    check_finite("v", v)?;
    Ok(Shape {
        batch,
        heads,
        tokens,
        head_dim,
    })
}
// ANCHOR_END: check_qkv

/// Refuses an array that holds a NaN or an infinity, naming it and the first such position.
pub fn check_finite<A: Copy + Into<f64>>(
    name: &str,
    x: &ArrayView4<A>,
) -> Result<(), AttnError> {
    // one pass in memory order that only asks whether every number is finite (no early
    // exit, so it runs at the memory's speed); the position is looked for only if one is not
    if x.fold(true, |ok, &v| ok & v.into().is_finite()) {
        return Ok(());
    }
    match x.indexed_iter().find(|(_, v)| !(**v).into().is_finite()) {
        None => Ok(()),
        Some(((b, h, t, d), v)) => Err(AttnError::NonFinite {
            what: format!("{name}[{b}, {h}, {t}, {d}] is {}", (*v).into()),
        }),
    }
}

/// Checks that a further array (an output gradient, say) has the shape of q and holds
/// finite numbers.
pub fn check_same<A: Copy + Into<f64>>(
    name: &str,
    x: &ArrayView4<A>,
    shape: Shape,
) -> Result<(), AttnError> {
    let d: [usize; 4] = x.dim().into();
    if d != shape.dims() {
        return Err(AttnError::ShapeMismatch {
            what: format!("{name} is {d:?} but q, k and v are {:?}", shape.dims()),
        });
    }
    check_finite(name, x)
}

/// A count of at least 1 (`--runs`, each of `--lengths`), as clap's `value_parser` takes
/// it: the message says what was wrong with `s` and what is accepted, a number too large for
/// the machine's word included.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    use std::num::IntErrorKind;
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        Err(e) if *e.kind() == IntErrorKind::PosOverflow => Err(format!(
            "{} is too large: accepted a whole number from 1 to {}",
            s.trim(),
            usize::MAX
        )),
        _ => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}

/// The memory and swap of this machine in bytes (`/proc/meminfo`), None where unknown.
pub fn memory_and_swap() -> Option<u128> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = |key: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u128>().ok())
    };
    Some((kb("MemTotal:")? + kb("SwapTotal:").unwrap_or(0)) * 1024)
}

/// Allocates `len` zeros, returning `OutOfMemory` instead of aborting the process when the
/// allocator says no (or when `len` overflows). More than the machine's memory and swap is
/// refused before asking: where the kernel overcommits, the allocator would say yes and the
/// zeros would then page for minutes before the OOM killer ends the process.
pub fn try_zeros<A: Clone + Default>(
    what: &str,
    len: Option<usize>,
) -> Result<Vec<A>, AttnError> {
    let oom = |bytes: u128| AttnError::OutOfMemory {
        what: what.to_string(),
        bytes,
    };
    let size = std::mem::size_of::<A>() as u128;
    let Some(len) = len else {
        return Err(oom(u128::MAX / 2));
    };
    if memory_and_swap().is_some_and(|have| len as u128 * size > have) {
        return Err(oom(len as u128 * size));
    }
    let mut buf = Vec::new();
    buf.try_reserve_exact(len)
        .map_err(|_| oom(len as u128 * size))?;
    buf.resize(len, A::default());
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one message built from a field's value rather than written out: with and
    /// without the size of the allocation that failed.
    #[test]
    fn out_of_memory_names_the_size_when_it_is_known() {
        let oom = |bytes| {
            AttnError::OutOfMemory {
                what: "the scores".into(),
                bytes,
            }
            .to_string()
        };
        let advice =
            "; try fewer tokens, sequences or heads, or a method that keeps no T×T table";
        assert_eq!(
            oom(0),
            format!("out of memory: the scores: the device said out of memory{advice}")
        );
        assert_eq!(
            oom(12_345_678),
            format!("out of memory: the scores needs 12.3 MB{advice}")
        );
    }

    #[test]
    fn counts_say_what_is_accepted_and_how_large_they_may_be() {
        assert_eq!(at_least_one(" 12 "), Ok(12));
        assert_eq!(at_least_one(&usize::MAX.to_string()), Ok(usize::MAX));
        for bad in ["0", "-3", "", "1k", "2.5"] {
            let e = at_least_one(bad).unwrap_err();
            assert!(e.contains("a whole number of at least 1"), "{bad}: {e}");
        }
        let e = at_least_one("99999999999999999999").unwrap_err();
        assert!(
            e.contains("too large") && e.contains(&format!("from 1 to {}", usize::MAX)),
            "{e}"
        );
    }

    #[test]
    #[cfg_attr(not(target_os = "linux"), ignore = "needs Linux's /proc/meminfo")]
    fn more_than_memory_and_swap_is_refused_without_allocating() {
        let have = memory_and_swap().expect("MemTotal in /proc/meminfo");
        let len = usize::try_from(have + 1).expect("a 64-bit machine");
        let start = std::time::Instant::now();
        match try_zeros::<u8>("the test's buffer", Some(len)) {
            Err(AttnError::OutOfMemory { bytes, .. }) => assert_eq!(bytes, have + 1),
            other => panic!("expected out of memory, got {:?}", other.map(|v| v.len())),
        }
        assert!(start.elapsed().as_secs() < 2, "it tried to allocate");
        let small = try_zeros::<f32>("a small buffer", Some(1000)).expect("1000 floats");
        assert_eq!(small, vec![0.0; 1000]);
    }
}
