//! Ring attention on the CPU: threads as ranks, channels as the links between them.
//!
//! Each rank is a thread that holds two chunks of the sequence, as the zig-zag split deals
//! them ([`ZigZag`]). Its queries stay; its keys and values go round the ring: at every
//! step a rank computes its blocks against the keys and values it holds ([`pairs`]), then
//! sends them to rank `r + 1` over a channel and receives those of rank `r − 1`. The
//! forward merges each block's partial result into the rank's rows ([`merge_into`]); after
//! `N` steps every row has seen every key before it, and the rank's rows are finished. The
//! backward goes round the same way with the gradients of the keys and values travelling
//! beside them: each rank adds its blocks' share into them, keeps its share of `dq`, and
//! one more pass brings every key's gradients home to the rank that owns the key.
//!
//! A block is computed by hand, as step 01 computes attention, with the causal mask only on
//! the diagonal (a chunk against itself) and none on a block of keys wholly before its
//! queries; its backward is step 04's formulas with the probabilities rebuilt from the
//! whole row's log-sum-exp. The ranks share one memory, so a channel moves the arrays
//! without copying them: what the threads show is the schedule and the algebra, which the
//! GPU ring follows with NCCL's copies between devices.
//!
//! Any `T` splits: chunks may differ by one token, and when the sequence has fewer than
//! `2N` tokens some are empty. A rank with no token computes nothing and still passes the
//! keys and values on; a block with no key has the partial result `(0, −∞)`, which the
//! merge ignores.

use std::ops::Range;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread;

use flash_core::{Attention, AttnError, Shape, check_qkv};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array, Array2, Array3, Array4, ArrayView, ArrayView3, ArrayView4, Axis};
use ndarray::{Dimension, Slice, Zip, s};
use step04_backward::{Grads, check_backward};

use crate::merge::{merge_into, no_keys};
use crate::schedule::{Pair, Visibility, ZigZag, pairs, visiting};

/// The most ranks [`ring_forward`] and [`ring_backward`] take: one thread each.
pub const MAX_RANKS: usize = 256;

// ANCHOR: ring_forward
/// Causal attention of `[batch, heads, tokens, head_dim]` inputs on a ring of `ranks`
/// threads.
///
/// Accepted: what [`check_qkv`] accepts, and `1 ≤ ranks ≤` [`MAX_RANKS`] (more ranks than
/// tokens included: the ranks without a token just pass the keys on).
pub fn ring_forward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    ranks: usize,
) -> Result<Attention, AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    check_ranks(ranks)?;
    if shape.is_empty() {
        return Ok(Attention::empty(shape));
    }
    let split = ZigZag::new(shape.tokens, ranks);
    // (views of the views: one lifetime for the three)
    let inputs = Inputs {
        q: q.view(),
        k: k.view(),
        v: v.view(),
    };
    let parts = ring(ranks, |r, link| forward_rank(&split, r, link, inputs))?;
    // each rank's two chunks of rows back to their places in the sequence
    let mut whole = Attention::empty(shape);
    for (r, rows) in parts.iter().enumerate() {
        for (c, rows) in split.rank_chunks(r).into_iter().zip(rows) {
            place(&mut whole.out, split.chunk(c), &rows.out);
            place(&mut whole.lse, split.chunk(c), &rows.lse);
        }
    }
    Ok(whole)
}
// ANCHOR_END: ring_forward

// ANCHOR: forward_rank
/// Rank `r` of the forward: its two chunks of queries stay; at each step it computes their
/// blocks against the keys and values it holds, merges the blocks' partial results into its
/// rows, and passes the keys and values on.
fn forward_rank(
    split: &ZigZag,
    r: usize,
    link: Link<Keys>,
    x: Inputs,
) -> Result<[Attention; 2], AttnError> {
    let queries = split.rank_chunks(r).map(|c| tokens(x.q, split.chunk(c)));
    let mut rows = queries.map(|q| no_keys(q.dim().into()));
    let mut keys = Keys::of(split, r, x);
    for s in 0..split.ranks {
        debug_assert_eq!(keys.origin, visiting(r, s, split.ranks));
        for Pair { query, key, how } in pairs(split, r, s) {
            let (k, v) = (keys.k[key].view(), keys.v[key].view());
            let block = block_forward(queries[query], k, v, how);
            merge_into(&mut rows[query], &block)?;
        }
        if s + 1 < split.ranks {
            keys = link.pass(keys)?; // to rank r + 1; rank r − 1's arrive
        }
    }
    Ok(rows)
}
// ANCHOR_END: forward_rank

// ANCHOR: ring_backward
/// The gradients of q, k and v on a ring of `ranks` threads, given `fwd`, the output and
/// natural-log log-sum-exp of each row (of any forward: a ring's, or one device's), and
/// `dout`, the gradient of the output.
///
/// Accepted: what [`check_backward`] accepts, and `1 ≤ ranks ≤` [`MAX_RANKS`].
pub fn ring_backward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
    ranks: usize,
) -> Result<Grads, AttnError> {
    let shape = check_backward(&q, &k, &v, fwd, &dout)?;
    check_ranks(ranks)?;
    if shape.is_empty() {
        return Ok(Grads::zeros(shape));
    }
    let split = ZigZag::new(shape.tokens, ranks);
    // (views of the views: one lifetime for the three)
    let inputs = Inputs {
        q: q.view(),
        k: k.view(),
        v: v.view(),
    };
    let parts = ring(ranks, |r, link| {
        backward_rank(&split, r, link, inputs, fwd, dout)
    })?;
    // each rank's dq, and the dk and dv that came home to it, back to their places
    let mut grads = Grads::zeros(shape);
    for (r, (dq, home)) in parts.iter().enumerate() {
        for (i, c) in split.rank_chunks(r).into_iter().enumerate() {
            place(&mut grads.dq, split.chunk(c), &dq[i]);
            place(&mut grads.dk, split.chunk(c), &home.dk[i]);
            place(&mut grads.dv, split.chunk(c), &home.dv[i]);
        }
    }
    Ok(grads)
}
// ANCHOR_END: ring_backward

// ANCHOR: backward_rank
/// Rank `r` of the backward: at each step it adds its blocks' share of the gradients into
/// its `dq` and into the visiting keys' `dk` and `dv`, then passes the keys and values on
/// with their gradients. After the `N`-th pass each rank holds its own keys again, with the
/// gradients every rank added into them.
fn backward_rank(
    split: &ZigZag,
    r: usize,
    link: Link<(Keys, KeyGrads)>,
    x: Inputs,
    fwd: &Attention,
    dout: ArrayView4<f32>,
) -> Result<([Array4<f32>; 2], KeyGrads), AttnError> {
    let rows = split
        .rank_chunks(r)
        .map(|c| Rows::new(x.q.view(), fwd, dout.view(), split.chunk(c)));
    let mut dq = rows.each_ref().map(|rows| Array4::zeros(rows.q.raw_dim()));
    let mut keys = Keys::of(split, r, x);
    let mut grads = KeyGrads::zeros(&keys);
    for s in 0..split.ranks {
        debug_assert_eq!(keys.origin, visiting(r, s, split.ranks));
        for Pair { query, key, how } in pairs(split, r, s) {
            let (k, v) = (keys.k[key].view(), keys.v[key].view());
            let (dk, dv) = (&mut grads.dk[key], &mut grads.dv[key]);
            block_backward(&rows[query], k, v, how, &mut dq[query], dk, dv);
        }
        // the last of these passes brings every rank's keys, and their gradients, home
        (keys, grads) = link.pass((keys, grads))?;
    }
    debug_assert_eq!(keys.origin, r);
    Ok((dq, grads))
}
// ANCHOR_END: backward_rank

// ANCHOR: block_forward
/// One block: queries `q` against keys `k` and values `v` (`[batch, heads, n, head_dim]`,
/// any two lengths), by hand as step 01 computes attention: the scores, the causal mask on
/// the diagonal only, a softmax per row and the product with `v`. Its partial result: the
/// output and log-sum-exp of each row over these keys alone, `(0, −∞)` where there are
/// none.
fn block_forward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    how: Visibility,
) -> Attention {
    let mut p = block_scores(q, k); // s_ij = q_i·k_j/√d
    match how {
        Visibility::Full => {}
        // a chunk against itself: s_ij = −∞ where j > i
        Visibility::Diagonal => step01_naive::apply_causal_mask(&mut p),
        Visibility::None => return no_keys(q.dim().into()),
    }
    let lse = step01_naive::softmax_rows(&mut p); // p_ij = e^(s_ij − lse_i) over these keys
    let mut out = Array4::zeros(q.raw_dim());
    for (b, h) in heads(q) {
        let at = s![b, h, .., ..];
        general_mat_mul(1.0, &p.slice(at), &v.slice(at), 0.0, &mut out.slice_mut(at));
    }
    Attention { out, lse }
}
// ANCHOR_END: block_forward

// ANCHOR: block_backward
/// One block's share of the gradients, added into `dq` (the block's rows) and into `dk`,
/// `dv` (its keys): step 04's formulas on the block. The probabilities are rebuilt from the
/// whole row's log-sum-exp, `P = exp(S − lse)`, so they are the row's true probabilities on
/// these keys, and `δ = rowsum(dO ∘ O)` is the whole row's too: that is all it takes for
/// the shares of the blocks to add up to the gradients.
fn block_backward(
    rows: &Rows,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    how: Visibility,
    dq: &mut Array4<f32>,
    dk: &mut Array4<f32>,
    dv: &mut Array4<f32>,
) {
    let (q, dout) = (rows.q, rows.dout);
    let mut p = block_scores(q, k);
    match how {
        Visibility::Full => {}
        Visibility::Diagonal => step01_naive::apply_causal_mask(&mut p),
        Visibility::None => return,
    }
    // P_ij = exp(S_ij − lse_i); exactly 0 where masked
    Zip::from(p.rows_mut())
        .and(&rows.lse)
        .for_each(|mut p, &lse| p.mapv_inplace(|s| (s - lse).exp()));
    let scale = scale(q);
    for (b, h) in heads(q) {
        let at = s![b, h, .., ..];
        let (p, q, k, v, dout) = (
            p.slice(at),
            q.slice(at),
            k.slice(at),
            v.slice(at),
            dout.slice(at),
        );
        let mut ds = Array2::zeros(p.raw_dim());
        general_mat_mul(1.0, &dout, &v.t(), 0.0, &mut ds); // dP = dO·Vᵀ
        for (i, (mut ds, p)) in ds.rows_mut().into_iter().zip(p.rows()).enumerate() {
            let delta = rows.delta[[b, h, i]];
            ds.zip_mut_with(&p, |d, &p| *d = p * (*d - delta)); // dS = P ∘ (dP − δ)
        }
        general_mat_mul(1.0, &p.t(), &dout, 1.0, &mut dv.slice_mut(at)); // dV += Pᵀ·dO
        general_mat_mul(scale, &ds, &k, 1.0, &mut dq.slice_mut(at)); // dQ += dS·K·scale
        general_mat_mul(scale, &ds.t(), &q, 1.0, &mut dk.slice_mut(at)); // dK += dSᵀ·Q·scale
    }
}
// ANCHOR_END: block_backward

/// The block's table of scores `s_ij = q_i·k_j/√d`, `[batch, heads, queries, keys]`,
/// rounded as step 01 rounds its table (the product with the scale as its `alpha`).
fn block_scores(q: ArrayView4<f32>, k: ArrayView4<f32>) -> Array4<f32> {
    let (b_n, h_n, rows, _) = q.dim();
    let mut table = Array4::zeros((b_n, h_n, rows, k.dim().2));
    for (b, h) in heads(q) {
        let at = s![b, h, .., ..];
        let (q, k) = (q.slice(at), k.slice(at));
        general_mat_mul(scale(q.view()), &q, &k.t(), 0.0, &mut table.slice_mut(at));
    }
    table
}

/// `1/√d`, as step 01 computes it.
fn scale<D: Dimension>(x: ArrayView<f32, D>) -> f32 {
    let d = x.shape()[x.ndim() - 1];
    Shape::new(1, 1, 1, d).scale() as f32
}

/// Every (sequence, head) of a `[batch, heads, n, head_dim]` array.
fn heads(x: ArrayView4<f32>) -> impl Iterator<Item = (usize, usize)> {
    let (b_n, h_n, _, _) = x.dim();
    (0..b_n).flat_map(move |b| (0..h_n).map(move |h| (b, h)))
}

/// The whole call's q, k and v; each rank reads only its own chunks of them, as if each
/// held its shard of the sequence from the start.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    q: ArrayView4<'a, f32>,
    k: ArrayView4<'a, f32>,
    v: ArrayView4<'a, f32>,
}

// ANCHOR: travelling
/// What travels round the ring: the keys and values of one rank's two chunks, earlier
/// first.
struct Keys {
    /// The rank they belong to.
    origin: usize,
    k: [Array4<f32>; 2],
    v: [Array4<f32>; 2],
}

/// In the backward, beside the keys and values: the gradients of the loss with respect to
/// them, summed over the ranks they have visited so far.
struct KeyGrads {
    dk: [Array4<f32>; 2],
    dv: [Array4<f32>; 2],
}
// ANCHOR_END: travelling

impl Keys {
    /// Rank `r`'s own keys and values, copied out of the whole call's.
    fn of(split: &ZigZag, r: usize, x: Inputs) -> Keys {
        let own = |a: ArrayView4<f32>| {
            split
                .rank_chunks(r)
                .map(|c| tokens(a, split.chunk(c)).to_owned())
        };
        Keys {
            origin: r,
            k: own(x.k),
            v: own(x.v),
        }
    }
}

impl KeyGrads {
    fn zeros(keys: &Keys) -> KeyGrads {
        let zeros = || keys.k.each_ref().map(|k| Array4::zeros(k.raw_dim()));
        KeyGrads {
            dk: zeros(),
            dv: zeros(),
        }
    }
}

/// One chunk of a rank's rows in the backward: the queries and the output's gradient, and
/// for each row its log-sum-exp and `δ = rowsum(dO ∘ O)`, both of the whole row: the merged
/// forward's, never one block's.
struct Rows<'a> {
    q: ArrayView4<'a, f32>,
    dout: ArrayView4<'a, f32>,
    lse: ArrayView3<'a, f32>,
    delta: Array3<f32>,
}

impl<'a> Rows<'a> {
    fn new(
        q: ArrayView4<'a, f32>,
        fwd: &'a Attention,
        dout: ArrayView4<'a, f32>,
        chunk: Range<usize>,
    ) -> Rows<'a> {
        let dout = tokens(dout, chunk.clone());
        let out = tokens(fwd.out.view(), chunk.clone());
        Rows {
            q: tokens(q, chunk.clone()),
            dout,
            lse: tokens(fwd.lse.view(), chunk),
            delta: step04_backward::blockwise::delta(out, dout),
        }
    }
}

/// The tokens `chunk` of a `[batch, heads, tokens, …]` view.
fn tokens<D: Dimension>(x: ArrayView<f32, D>, chunk: Range<usize>) -> ArrayView<f32, D> {
    x.slice_axis_move(Axis(2), Slice::from(chunk))
}

/// Puts `part` at the tokens `chunk` of `whole`, `[batch, heads, tokens, …]`.
fn place<D: Dimension>(
    whole: &mut Array<f32, D>,
    chunk: Range<usize>,
    part: &Array<f32, D>,
) {
    whole
        .slice_axis_mut(Axis(2), Slice::from(chunk))
        .assign(part);
}

fn check_ranks(ranks: usize) -> Result<(), AttnError> {
    if ranks == 0 || ranks > MAX_RANKS {
        return Err(AttnError::Unsupported {
            what: format!(
                "{ranks} ranks: the CPU ring runs one thread per rank, and takes from 1 to \
                 {MAX_RANKS} (more ranks than tokens is fine: a rank may hold no token)"
            ),
        });
    }
    Ok(())
}

// ANCHOR: link
/// A rank's two ends of the ring: a sender to rank `r + 1` and a receiver from rank `r −
/// 1`.
struct Link<T> {
    rank: usize,
    next: Sender<T>,
    prev: Receiver<T>,
}

impl<T> Link<T> {
    /// One step of the ring: hands `mine` to rank `r + 1` and waits for what rank `r − 1`
    /// hands on. The channels are unbounded, so every rank can send before it receives and
    /// no rank waits on another's send.
    fn pass(&self, mine: T) -> Result<T, AttnError> {
        let broken = || AttnError::Device {
            what: format!("rank {}: {BROKEN}", self.rank),
        };
        self.next.send(mine).map_err(|_| broken())?;
        self.prev.recv().map_err(|_| broken())
    }
}
// ANCHOR_END: link

/// What a rank says when a neighbour stopped: the consequence of another rank's error.
const BROKEN: &str = "the ring is broken: a neighbouring rank has stopped";

// ANCHOR: ring_threads
/// Runs `rank(r, link)` for `r` in `0..ranks`, each on a thread of its own with its link of
/// the ring, and returns their results in rank order.
fn ring<T: Send, R: Send>(
    ranks: usize,
    rank: impl Fn(usize, Link<T>) -> Result<R, AttnError> + Sync,
) -> Result<Vec<R>, AttnError> {
    // channel r carries what rank r − 1 hands to rank r
    let (senders, receivers): (Vec<Sender<T>>, Vec<Receiver<T>>) =
        (0..ranks).map(|_| mpsc::channel()).unzip();
    let links: Vec<Link<T>> = receivers
        .into_iter()
        .enumerate()
        .map(|(r, prev)| Link {
            rank: r,
            next: senders[(r + 1) % ranks].clone(),
            prev,
        })
        .collect();
    // from here each channel's only sender is in a link: a rank that stops closes its
    // channel
    drop(senders);
    thread::scope(|scope| {
        let rank = &rank;
        let mut running = Vec::with_capacity(ranks);
        let mut failed = None;
        for (r, link) in links.into_iter().enumerate() {
            let thread = thread::Builder::new().name(format!("rank {r}"));
            match thread.spawn_scoped(scope, move || rank(r, link)) {
                Ok(handle) => running.push(handle),
                Err(e) => {
                    // the links not handed out close with the loop: the ranks that run find
                    // the ring broken and return
                    failed = Some(AttnError::Device {
                        what: format!("starting the thread of rank {r} of {ranks}: {e}"),
                    });
                    break;
                }
            }
        }
        let results: Vec<Result<R, AttnError>> = running
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect();
        if let Some(e) = failed {
            return Err(e);
        }
        // the error that stopped the ring, rather than its neighbours' finding it broken
        let errors = results.iter().filter_map(|r| r.as_ref().err());
        let cause = errors.clone().find(|e| !e.to_string().contains(BROKEN));
        match cause.or(errors.clone().next()) {
            Some(e) => Err(e.clone()),
            None => Ok(results.into_iter().map(|r| r.expect("no errors")).collect()),
        }
    })
}
// ANCHOR_END: ring_threads

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_channels_carry_the_keys_as_the_schedule_says() {
        for ranks in 1..=5 {
            // each rank passes on the name of the rank its message started on
            let seen = ring(ranks, |r, link: Link<usize>| {
                let mut held = vec![r];
                for _ in 0..ranks {
                    held.push(link.pass(*held.last().unwrap())?);
                }
                Ok(held)
            })
            .unwrap();
            for (r, held) in seen.iter().enumerate() {
                let want: Vec<usize> = (0..=ranks).map(|s| visiting(r, s, ranks)).collect();
                assert_eq!(held, &want, "rank {r} of {ranks}");
            }
        }
    }

    #[test]
    fn a_rank_that_stops_breaks_the_ring_with_an_error_not_a_hang() {
        let results = ring(3, |r, link: Link<()>| {
            if r == 1 {
                return Err(AttnError::Unsupported {
                    what: "rank 1 stops".into(),
                });
            }
            for _ in 0..3 {
                link.pass(())?;
            }
            Ok(())
        });
        assert_eq!(
            results.unwrap_err(),
            AttnError::Unsupported {
                what: "rank 1 stops".into()
            }
        );
    }

    #[test]
    fn a_block_without_keys_is_the_merges_identity() {
        let q = Array4::<f32>::ones((1, 2, 3, 4));
        let none = Array4::<f32>::zeros((1, 2, 0, 4));
        let block = block_forward(q.view(), none.view(), none.view(), Visibility::Full);
        assert!(block.out.iter().all(|&o| o == 0.0));
        assert!(block.lse.iter().all(|&l| l == f32::NEG_INFINITY));
        let empty = Array4::<f32>::zeros((1, 2, 0, 4));
        let block = block_forward(empty.view(), q.view(), q.view(), Visibility::Full);
        assert_eq!(block.out.dim(), (1, 2, 0, 4));
    }
}
