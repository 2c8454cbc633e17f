//! Ring attention on GPUs: each rank keeps its zig-zag share of the queries, the keys and
//! values travel round the ring, and every block a rank meets is a plain launch of step
//! 03's forward kernel (the diagonal with the causal mask, the blocks wholly in the past
//! without it) or of step 04's backward kernels, compiled to add each block's gradients
//! into `f32` sums (`-DACCUMULATE=1`). Between the forward's launches, `kernels/ring.cu`
//! merges each block's partial result into an `f32` accumulator through the log-sum-exps.
//! Everything is rounded to 16 bits once, at the end.
//!
//! ## Layout
//!
//! - [`RingAttention`]: a ring over [`Ranks`] for one shape and dtype:
//!   [`RingAttention::forward`] and [`RingAttention::backward`] on device shards,
//!   [`RingAttention::scatter`] and [`RingAttention::gather`] between host arrays and
//!   shards.
//! - [`Shard`], [`ShardAttention`], [`ShardGrads`]: a rank's two chunks of a tensor, of the
//!   forward's result, of the gradients, each chunk a contiguous `[batch, heads, c,
//!   head_dim]` tensor so that it is a plain kernel argument.
//! - [`Transport`]: how the keys and values (and the gradients of the keys and values) pass
//!   from rank `r` to rank `r + 1`: NCCL between GPUs, or copies on one GPU whose ranks are
//!   simulated.
//! - [`ring_forward`], [`ring_forward_backward`]: the same on host arrays.
//! - [`ring_kernel`]: `kernels/ring.cu`'s build, [`accumulating_backward`] step 04's
//!   backward adding into `f32` sums.
//!
//! ## Streams
//!
//! Each rank computes on its GPU's stream (step 03's [`Gpu::stream`]) and communicates on a
//! second one. Events order the two: a receive waits for the blocks that still read the
//! buffer it overwrites, and a step's blocks wait for the receive that brought their keys.

use std::sync::Arc;

use cudarc::driver::sys::{CUmemPool_attribute, CUresult};
use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use cudarc::nccl::safe::{Comm, group_end, group_start};
use flash_core::method::Grads;
use flash_core::{Attention, AttnError, Shape, check_qkv, check_same};
use ndarray::{Array3, Array4, ArrayView4, s};
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::by_hand::warp_per_row;
use step03_cuda_forward::gpu::{
    DeviceTensor, Dtype, Gpu, alloc_error, device_error, half_dtype,
};
use step03_cuda_forward::kernel::{HEAD_DIMS, SimpleKernel, unsupported_head_dim};
use step04_backward::cuda::{BackwardKernel, BackwardLaunch, block_rows, delta};

use crate::comm::{communicators, gpus, nccl_error};
use crate::schedule::{Pair, Visibility, ZigZag, pairs};

/// The ring's kernels (merge, round, add), embedded so that binaries carry them; compiled
/// with step 03's `tensor_cores.cuh` in front.
pub const RING_CU: &str = include_str!("../kernels/ring.cu");
/// The entry points of [`RING_CU`].
pub const RING_ENTRIES: [&str; 2] = ["ring_merge", "ring_round"];

/// `kernels/ring.cu` for one dtype and head dim.
pub fn ring_kernel(dtype: Dtype, head_dim: usize) -> SimpleKernel {
    SimpleKernel {
        stem: "ring",
        source: RING_CU,
        dtype,
        head_dim,
    }
}

/// Step 04's backward kernels at `head_dim`, adding into `f32` sums, with the causal mask
/// (the diagonal) or without it (a block wholly in the past).
pub fn accumulating_backward(
    dtype: Dtype,
    head_dim: usize,
    causal: bool,
) -> BackwardKernel {
    BackwardKernel {
        causal,
        accumulate: true,
        ..BackwardKernel::new(dtype, head_dim)
    }
}

/// Who the ranks are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ranks {
    /// One rank per GPU, GPUs `0 .. n`, the keys and values passed on by NCCL.
    Gpus(usize),
    /// `ranks` ranks on GPU `gpu`, the keys and values passed on by copies within it: the
    /// ring's schedule, buffers and events exercised on one device.
    Simulated { gpu: usize, ranks: usize },
}

impl Ranks {
    pub fn count(&self) -> usize {
        match *self {
            Ranks::Gpus(n) => n,
            Ranks::Simulated { ranks, .. } => ranks,
        }
    }
}

/// One rank's share of a `[batch, heads, T, head_dim]` tensor: its two chunks of the
/// zig-zag split, earlier first, each `[batch, heads, c, head_dim]` on the rank's GPU.
pub struct Shard {
    pub chunks: [DeviceTensor; 2],
}

/// One rank's share of the forward's result: the output and log-sum-exp of its two chunks
/// of queries, as step 04's backward takes them.
pub struct ShardAttention {
    pub chunks: [DeviceAttention; 2],
}

/// One rank's share of the gradients: of its queries, and of the keys and values it started
/// with (they come home after the last step).
pub struct ShardGrads {
    pub dq: Shard,
    pub dk: Shard,
    pub dv: Shard,
}

/// What a run does, for measuring the overlap: everything, or the blocks alone (the keys
/// and values never move: each step computes with the rank's own, so the answer is wrong
/// but the work is the same), or the transfers alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parts {
    Both,
    ComputeOnly,
    TransfersOnly,
}

impl Parts {
    fn compute(self) -> bool {
        self != Parts::TransfersOnly
    }
    fn transfer(self) -> bool {
        self != Parts::ComputeOnly
    }
}

// ANCHOR: transport
/// How a rank's buffers reach the next rank of the ring.
pub enum Transport {
    /// Copies within one GPU, on one stream, for simulated ranks.
    Copies { stream: Arc<CudaStream> },
    /// NCCL's send and receive, one communicator per GPU, each on its own stream.
    Nccl { comms: Vec<Comm> },
}

impl Transport {
    /// The stream rank `r`'s transfers run on.
    fn stream(&self, r: usize) -> Arc<CudaStream> {
        match self {
            Transport::Copies { stream } => stream.clone(),
            Transport::Nccl { comms } => comms[r].stream(),
        }
    }

    /// Every rank `r` passes `sends[r]` on to rank `r + 1` and receives rank `r - 1`'s into
    /// `recvs[r]`, buffer by buffer, on the transfer streams.
    fn pass_on(
        &self,
        sends: &[Vec<CudaView<'_, u8>>],
        recvs: &mut [Vec<CudaViewMut<'_, u8>>],
    ) -> Result<(), AttnError> {
        let n = sends.len();
        match self {
            Transport::Copies { stream } => {
                for (r, into) in recvs.iter_mut().enumerate() {
                    for (src, dst) in sends[(r + n - 1) % n].iter().zip(into.iter_mut()) {
                        stream.memcpy_dtod(src, dst).map_err(device_error(
                            "copying keys and values to the next rank",
                        ))?;
                    }
                }
                Ok(())
            }
            Transport::Nccl { comms } => {
                // one thread drives every GPU: all ranks' sends and receives in one group,
                // so that NCCL starts them together instead of waiting on a peer not yet
                // called
                group_start().map_err(nccl_error("starting a group"))?;
                let mut result = Ok(());
                'ranks: for (r, comm) in comms.iter().enumerate() {
                    let (next, prev) = (((r + 1) % n) as i32, ((r + n - 1) % n) as i32);
                    for (send, recv) in sends[r].iter().zip(recvs[r].iter_mut()) {
                        let sent = comm.send(send, next).map_err(nccl_error("ncclSend"));
                        let got = sent.and_then(|_| {
                            comm.recv(recv, prev)
                                .map(drop)
                                .map_err(nccl_error("ncclRecv"))
                        });
                        if let Err(e) = got {
                            result = Err(e);
                            break 'ranks;
                        }
                    }
                }
                let ended = group_end().map(drop).map_err(nccl_error("ending a group"));
                result.and(ended)
            }
        }
    }
}
// ANCHOR_END: transport

/// A tensor's bytes, as a transport moves them.
fn bytes<T>(x: &CudaSlice<T>) -> CudaView<'_, u8> {
    // SAFETY: any bytes are valid u8; the view covers exactly the slice's bytes
    unsafe { x.transmute::<u8>(x.num_bytes()) }.expect("a slice's own bytes")
}

fn bytes_mut<T>(x: &mut CudaSlice<T>) -> CudaViewMut<'_, u8> {
    let n = x.num_bytes();
    // SAFETY: as in `bytes`, and every byte pattern written is a valid T (f32 or u16 bits)
    unsafe { x.transmute_mut::<u8>(n) }.expect("a slice's own bytes")
}

/// Keys and values of one rank: its two chunks of each.
struct Kv {
    k: [DeviceTensor; 2],
    v: [DeviceTensor; 2],
}

/// The gradients of one rank's keys and values, summed in f32 as they travel.
struct KvGrads {
    dk: [CudaSlice<f32>; 2],
    dv: [CudaSlice<f32>; 2],
}

/// A rank's f32 sums of dq, one a chunk of its queries.
type DqSums = [CudaSlice<f32>; 2];

/// A ring of ranks for one shape and dtype.
pub struct RingAttention {
    split: ZigZag,
    shape: Shape,
    chunk: Shape,
    dtype: Dtype,
    /// Each rank's GPU (the same one for every rank when they are simulated).
    gpus: Vec<&'static Gpu>,
    transport: Transport,
    parts: Parts,
}

/// An event on `stream` marking the work queued there so far.
fn mark(stream: &CudaStream) -> Result<CudaEvent, AttnError> {
    stream
        .record_event(None)
        .map_err(device_error("recording an event"))
}

fn wait(stream: &CudaStream, event: &CudaEvent) -> Result<(), AttnError> {
    stream
        .wait(event)
        .map_err(device_error("waiting on an event"))
}

impl RingAttention {
    /// Checks that the ring can take `shape` and `dtype`, before any GPU is opened: bf16 or
    /// f16, a head dim the kernels take, and `T` a multiple of `2N` (every chunk of the
    /// split the same length, so that a block is one launch of the single-GPU kernels).
    pub fn check(ranks: usize, shape: Shape, dtype: Dtype) -> Result<ZigZag, AttnError> {
        half_dtype(dtype)?;
        if shape.head_dim == 0 {
            return Err(AttnError::ZeroHeadDim);
        }
        if !HEAD_DIMS.contains(&shape.head_dim) {
            return Err(unsupported_head_dim(shape.head_dim));
        }
        if ranks == 0 {
            return Err(AttnError::Unsupported {
                what: "a ring needs at least one rank".into(),
            });
        }
        shape.checked_len()?;
        let split = ZigZag::new(shape.tokens, ranks);
        // the backward's grid: blocks of 128 rows of a chunk along its second dimension
        let rows = block_rows(shape.head_dim);
        let chunk = shape.tokens / split.chunks();
        if chunk.div_ceil(rows) > 65_535 || shape.batch * shape.heads > i32::MAX as usize {
            return Err(AttnError::Unsupported {
                what: format!(
                    "{shape}: the backward kernels take chunks of at most {} tokens ({} per rank) and 2^31 sequences × heads",
                    65_535 * rows,
                    2 * 65_535 * rows
                ),
            });
        }
        if !split.is_even() {
            let n = split.chunks();
            return Err(AttnError::Unsupported {
                what: format!(
                    "the GPU ring splits the sequence into 2N = {n} chunks of one length, so T must be a multiple of {n} for {ranks} ranks; T is {} (the nearest are {} and {})",
                    shape.tokens,
                    shape.tokens / n * n,
                    shape.tokens.div_ceil(n) * n
                ),
            });
        }
        Ok(split)
    }

    /// A ring over `ranks` for inputs of `shape` (the whole sequence) in `dtype`: the
    /// checks of [`RingAttention::check`], then the GPUs opened and, between distinct GPUs,
    /// NCCL.
    pub fn new(
        ranks: Ranks,
        shape: Shape,
        dtype: Dtype,
    ) -> Result<RingAttention, AttnError> {
        let n = ranks.count();
        let split = RingAttention::check(n, shape, dtype)?;
        let (gpus, transport) = match ranks {
            Ranks::Simulated { gpu, .. } => {
                let gpu = Gpu::shared_on(gpu)?;
                let stream = gpu
                    .context()
                    .new_stream()
                    .map_err(device_error("creating the transfer stream"))?;
                (vec![gpu; n], Transport::Copies { stream })
            }
            Ranks::Gpus(_) => {
                let gpus = gpus(n)?;
                let streams = gpus
                    .iter()
                    .map(|g| g.context().new_stream())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(device_error("creating the transfer streams"))?;
                // one GPU passes nothing on: no NCCL needed
                let transport = match n {
                    1 => Transport::Copies {
                        stream: streams[0].clone(),
                    },
                    _ => Transport::Nccl {
                        comms: communicators(streams)?,
                    },
                };
                (gpus, transport)
            }
        };
        let chunk = Shape::new(
            shape.batch,
            shape.heads,
            split.chunk(0).len(),
            shape.head_dim,
        );
        Ok(RingAttention {
            split,
            shape,
            chunk,
            dtype: half_dtype(dtype)?,
            gpus,
            transport,
            parts: Parts::Both,
        })
    }

    /// This ring doing only `parts` of its work (for measurements).
    pub fn with_parts(mut self, parts: Parts) -> RingAttention {
        self.parts = parts;
        self
    }

    /// Sets which parts of its work the ring does (for measurements).
    pub fn set_parts(&mut self, parts: Parts) {
        self.parts = parts;
    }

    pub fn ranks(&self) -> usize {
        self.split.ranks
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The shape of one chunk: `[batch, heads, T / 2N, head_dim]`.
    pub fn chunk_shape(&self) -> Shape {
        self.chunk
    }

    pub fn split(&self) -> ZigZag {
        self.split
    }

    /// Rank `r`'s GPU.
    pub fn gpu(&self, r: usize) -> &'static Gpu {
        self.gpus[r]
    }

    /// The distinct GPUs of the ring, once each.
    pub fn distinct_gpus(&self) -> Vec<&'static Gpu> {
        let mut out: Vec<&'static Gpu> = Vec::new();
        for &g in &self.gpus {
            if !out.iter().any(|o| std::ptr::eq(*o, g)) {
                out.push(g);
            }
        }
        out
    }

    /// Waits for everything queued on every GPU of the ring (compute and transfers).
    pub fn synchronize(&self) -> Result<(), AttnError> {
        for g in self.distinct_gpus() {
            g.context()
                .synchronize()
                .map_err(device_error("synchronising"))?;
        }
        Ok(())
    }

    /// A host array of the ring's shape cut into the ranks' shards, each chunk rounded to
    /// the ring's dtype on its rank's GPU.
    pub fn scatter(&self, x: ArrayView4<f32>) -> Result<Vec<Shard>, AttnError> {
        check_same("a tensor to scatter", &x, self.shape)?;
        (0..self.ranks())
            .map(|r| {
                let [a, b] = self.split.rank_chunks(r).map(|c| {
                    let tokens = self.split.chunk(c);
                    self.gpus[r].upload(x.slice(s![.., .., tokens, ..]), self.dtype)
                });
                Ok(Shard { chunks: [a?, b?] })
            })
            .collect()
    }

    /// The ranks' shards put back together on the host, widened to `f32`.
    pub fn gather(&self, shards: &[Shard]) -> Result<Array4<f32>, AttnError> {
        self.check_shards("shards", shards)?;
        let mut out = Array4::zeros(self.shape.dims());
        for (r, shard) in shards.iter().enumerate() {
            for (chunk, c) in shard.chunks.iter().zip(self.split.rank_chunks(r)) {
                let x = self.gpus[r].download(chunk)?;
                out.slice_mut(s![.., .., self.split.chunk(c), ..])
                    .assign(&x);
            }
        }
        Ok(out)
    }

    /// The forward's result put back together on the host.
    pub fn gather_attention(&self, fwd: &[ShardAttention]) -> Result<Attention, AttnError> {
        let shape = self.shape;
        let mut result = Attention {
            out: Array4::zeros(shape.dims()),
            lse: Array3::zeros((shape.batch, shape.heads, shape.tokens)),
        };
        for (r, shard) in fwd.iter().enumerate() {
            for (chunk, c) in shard.chunks.iter().zip(self.split.rank_chunks(r)) {
                let got = self.gpus[r].download_attention(chunk)?;
                let tokens = self.split.chunk(c);
                result
                    .out
                    .slice_mut(s![.., .., tokens.clone(), ..])
                    .assign(&got.out);
                result.lse.slice_mut(s![.., .., tokens]).assign(&got.lse);
            }
        }
        Ok(result)
    }

    fn check_shards(&self, name: &str, shards: &[Shard]) -> Result<(), AttnError> {
        if shards.len() != self.ranks() {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "{} {name} for a ring of {} ranks",
                    shards.len(),
                    self.ranks()
                ),
            });
        }
        for (r, shard) in shards.iter().enumerate() {
            for x in &shard.chunks {
                if x.shape != self.chunk
                    || x.dtype != self.dtype
                    || x.data.len() != self.chunk.len()
                {
                    return Err(AttnError::ShapeMismatch {
                        what: format!(
                            "rank {r}'s {name} hold {} {} chunks; this ring takes {} {}",
                            x.shape,
                            x.dtype.name(),
                            self.chunk,
                            self.dtype.name()
                        ),
                    });
                }
                if x.data.context().ordinal() != self.gpus[r].context().ordinal() {
                    return Err(AttnError::Unsupported {
                        what: format!(
                            "rank {r}'s {name} are on GPU {}, the rank is on GPU {}",
                            x.data.context().ordinal(),
                            self.gpus[r].context().ordinal()
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    fn ring_kernel(
        &self,
        r: usize,
        entry: &str,
    ) -> Result<cudarc::driver::CudaFunction, AttnError> {
        let (gpu, dtype, head_dim) = (self.gpus[r], self.dtype, self.shape.head_dim);
        gpu.kernel(&ring_kernel(dtype, head_dim), entry, 0)
    }

    /// `acc ⊕= part` for one chunk of rank `r`'s queries (`ring_merge`).
    fn merge(
        &self,
        r: usize,
        acc_out: &mut CudaSlice<f32>,
        acc_lse: &mut CudaSlice<f32>,
        part: &DeviceAttention,
        first: bool,
    ) -> Result<(), AttnError> {
        let f = self.ring_kernel(r, "ring_merge")?;
        let rows = part.lse.len();
        let (rows_i, first_i) = (rows as i64, first as i32);
        let mut launch = self.gpus[r].stream().launch_builder(&f);
        launch
            .arg(acc_out)
            .arg(acc_lse)
            .arg(&part.out.data)
            .arg(&part.lse)
            .arg(&rows_i)
            .arg(&first_i);
        // SAFETY: acc_out and part.out hold rows · head_dim values, acc_lse and part.lse
        // rows; a warp per row reads and writes only its row
        unsafe { launch.launch(warp_per_row(rows, "ring_merge")?) }
            .map_err(device_error("launching ring_merge"))?;
        Ok(())
    }

    /// `out = round(acc)` (`ring_round`).
    fn round(&self, r: usize, acc: &CudaSlice<f32>) -> Result<DeviceTensor, AttnError> {
        let n = acc.len();
        // SAFETY: ring_round writes every value below
        let mut data = unsafe { self.gpus[r].stream().alloc::<u16>(n) }
            .map_err(alloc_error("allocating a rank's result", n as u128 * 2))?;
        let f = self.ring_kernel(r, "ring_round")?;
        let n_i = n as i64;
        let mut launch = self.gpus[r].stream().launch_builder(&f);
        launch.arg(acc).arg(&mut data).arg(&n_i);
        // SAFETY: both hold n values; the grid-stride loop stays below n
        unsafe { launch.launch(elementwise(n)) }
            .map_err(device_error("launching ring_round"))?;
        Ok(DeviceTensor {
            data,
            shape: self.chunk,
            dtype: self.dtype,
        })
    }

    fn alloc_f32(
        &self,
        r: usize,
        n: usize,
        what: &str,
    ) -> Result<CudaSlice<f32>, AttnError> {
        self.gpus[r]
            .stream()
            .alloc_zeros::<f32>(n)
            .map_err(alloc_error(what, n as u128 * 4))
    }

    fn alloc_kv(&self, r: usize) -> Result<Kv, AttnError> {
        let one = || -> Result<DeviceTensor, AttnError> {
            let n = self.chunk.len();
            // SAFETY: a receive fills it before any block reads it
            let data = unsafe { self.gpus[r].stream().alloc::<u16>(n) }
                .map_err(alloc_error("allocating a receive buffer", n as u128 * 2))?;
            Ok(DeviceTensor {
                data,
                shape: self.chunk,
                dtype: self.dtype,
            })
        };
        Ok(Kv {
            k: [one()?, one()?],
            v: [one()?, one()?],
        })
    }

    /// The receive buffers of every rank: two (double buffering) when the ring has three
    /// ranks or more, one for two ranks, none for one.
    fn alloc_receives(&self) -> Result<Vec<Vec<Kv>>, AttnError> {
        let n = self.ranks();
        (0..n)
            .map(|r| (0..(n - 1).min(2)).map(|_| self.alloc_kv(r)).collect())
            .collect()
    }

    // ANCHOR: ring_forward
    /// Causal attention of the whole sequence, each rank's queries against every rank's
    /// keys: `q`, `k` and `v` hold one shard per rank (from [`RingAttention::scatter`]);
    /// the result holds each rank's output and log-sum-exp, in the dtype of the inputs.
    pub fn forward(
        &self,
        q: &[Shard],
        k: &[Shard],
        v: &[Shard],
    ) -> Result<Vec<ShardAttention>, AttnError> {
        for (name, x) in [("q", q), ("k", k), ("v", v)] {
            self.check_shards(name, x)?;
        }
        let n = self.ranks();
        let rows = self.chunk.batch * self.chunk.heads * self.chunk.tokens;
        // per rank and query chunk: the merged output and log-sum-exp so far, in f32
        let mut acc_out = Vec::with_capacity(n);
        let mut acc_lse = Vec::with_capacity(n);
        let mut part = Vec::with_capacity(n);
        for r in 0..n {
            let f32s = |len, what| self.alloc_f32(r, len, what);
            acc_out.push([
                f32s(self.chunk.len(), "allocating the output")?,
                f32s(self.chunk.len(), "allocating the output")?,
            ]);
            acc_lse.push([
                f32s(rows, "allocating the log-sum-exp")?,
                f32s(rows, "allocating the log-sum-exp")?,
            ]);
            part.push(self.gpus[r].alloc_output(self.chunk, self.dtype)?);
        }
        let mut recv = self.alloc_receives()?;
        self.start_transfers()?;
        let mut filled = vec![[false; 2]; n];
        // events: compute done with step s - 1's keys (their buffer may be overwritten),
        // and step s's keys arrived
        let mut free: Vec<Option<CudaEvent>> = (0..n).map(|_| None).collect();
        let mut arrived: Vec<Option<CudaEvent>> = (0..n).map(|_| None).collect();
        for s in 0..n {
            // ANCHOR: overlap
            // the keys and values of step s + 1 travel while step s computes
            let mut next_arrived: Vec<Option<CudaEvent>> = (0..n).map(|_| None).collect();
            if s + 1 < n && self.parts.transfer() {
                for (r, event) in free.iter().enumerate() {
                    if let Some(e) = event {
                        wait(&self.transport.stream(r), e)?;
                    }
                }
                let (sends, mut recvs) = views(&mut recv, s, k, v);
                self.transport.pass_on(&sends, &mut recvs)?;
                for (r, e) in next_arrived.iter_mut().enumerate() {
                    *e = Some(mark(&self.transport.stream(r))?);
                }
            }
            // ANCHOR_END: overlap
            for r in 0..n {
                let stream = self.gpus[r].stream();
                if let Some(e) = &arrived[r] {
                    wait(stream, e)?;
                }
                if self.parts.compute() {
                    let (hk, hv) = held(&recv[r], s, &k[r], &v[r], self.parts);
                    for p in pairs(&self.split, r, s) {
                        self.forward_block(r, p, &q[r], hk, hv, &mut part[r])?;
                        let qi = p.query;
                        let (o, l) = (&mut acc_out[r][qi], &mut acc_lse[r][qi]);
                        self.merge(r, o, l, &part[r], !filled[r][qi])?;
                        filled[r][qi] = true;
                    }
                }
                free[r] = Some(mark(stream)?);
            }
            arrived = next_arrived;
        }
        let mut result = Vec::with_capacity(n);
        for (r, (out, lse)) in acc_out.into_iter().zip(acc_lse).enumerate() {
            let [o0, o1] = &out;
            let [l0, l1] = lse;
            let chunks = [
                DeviceAttention {
                    out: self.round(r, o0)?,
                    lse: l0,
                },
                DeviceAttention {
                    out: self.round(r, o1)?,
                    lse: l1,
                },
            ];
            result.push(ShardAttention { chunks });
        }
        self.join_transfers()?;
        Ok(result)
    }
    // ANCHOR_END: ring_forward

    /// One block of the forward: the diagonal with the causal mask, a block wholly in the
    /// past without it; `part` gets its output and log-sum-exp.
    fn forward_block(
        &self,
        r: usize,
        p: Pair,
        q: &Shard,
        k: &[DeviceTensor; 2],
        v: &[DeviceTensor; 2],
        part: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        let (gpu, q) = (self.gpus[r], &q.chunks[p.query]);
        let (k, v) = (&k[p.key], &v[p.key]);
        match p.how {
            Visibility::Diagonal => gpu.forward_into(q, k, v, part),
            Visibility::Full => gpu.forward_full_into(q, k, v, part),
            Visibility::None => unreachable!("pairs() lists visible blocks only"),
        }
    }

    /// Step 04's backward kernel `entry`, compiled to add into `f32` sums, with the causal
    /// mask (the diagonal) or without it (a block wholly in the past).
    fn backward_kernel(
        &self,
        r: usize,
        entry: &str,
        causal: bool,
        smem: u32,
    ) -> Result<cudarc::driver::CudaFunction, AttnError> {
        let (gpu, dtype, head_dim) = (self.gpus[r], self.dtype, self.shape.head_dim);
        gpu.kernel(&accumulating_backward(dtype, head_dim, causal), entry, smem)
    }

    // ANCHOR: backward_block
    /// One block of the backward, its shares added into `f32` sums: with `dkdv` `None`,
    /// dq's share (`backward_dq`, one thread block per 128 queries), else dk's and dv's
    /// (`backward_dkdv`, one per 128 keys). Every block of the ring is one launch of each.
    #[allow(clippy::too_many_arguments)]
    fn backward_block(
        &self,
        r: usize,
        p: Pair,
        (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
        fwd: &DeviceAttention,
        dout: &DeviceTensor,
        delta: &CudaSlice<f32>,
        dq: Option<&mut CudaSlice<f32>>,
        dkdv: Option<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)>,
    ) -> Result<(), AttnError> {
        let causal = match p.how {
            Visibility::Diagonal => true,
            Visibility::Full => false,
            Visibility::None => unreachable!("pairs() lists visible blocks only"),
        };
        let (shape, head_dim) = (self.chunk, self.chunk.head_dim);
        let sizes = BackwardLaunch::for_head_dim(head_dim);
        let (t, scale) = (shape.tokens as i32, 1.0 / (head_dim as f32).sqrt());
        let grid = LaunchConfig {
            grid_dim: (
                (shape.batch * shape.heads) as u32,
                shape.tokens.div_ceil(sizes.block_rows) as u32,
                1,
            ),
            block_dim: (sizes.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.gpus[r].stream();
        let one = 1i32; // k and v are not grouped (step 08) // [step 08]
        // SAFETY (both launches): every buffer holds one chunk ([B, H, c, D], or [B, H, c]
        // for lse and delta), as check_shards and check_attention proved and the sums were
        // allocated; each thread block adds to its own rows of the sums only, and launches
        // on one stream run in order; the grid's second dimension was checked by
        // RingAttention::check; the shared memory is what Gpu::kernel allowed.
        if let Some(dq) = dq {
            let smem = sizes.dq_smem_bytes;
            let f = self.backward_kernel(r, "backward_dq", causal, smem)?;
            let mut launch = stream.launch_builder(&f);
            launch
                .arg(&q.data)
                .arg(&k.data)
                .arg(&v.data)
                .arg(&dout.data);
            launch
                .arg(&fwd.lse)
                .arg(delta)
                .arg(dq)
                .arg(&one) // [step 08]
                .arg(&t)
                .arg(&scale);
            let cfg = LaunchConfig {
                shared_mem_bytes: smem,
                ..grid
            };
            unsafe { launch.launch(cfg) }.map_err(device_error("launching backward_dq"))?;
        }
        if let Some((dk, dv)) = dkdv {
            let smem = sizes.dkdv_smem_bytes;
            let f = self.backward_kernel(r, "backward_dkdv", causal, smem)?;
            let mut launch = stream.launch_builder(&f);
            launch
                .arg(&q.data)
                .arg(&k.data)
                .arg(&v.data)
                .arg(&dout.data);
            launch
                .arg(&fwd.lse)
                .arg(delta)
                .arg(dk)
                .arg(dv)
                .arg(&one) // [step 08]
                .arg(&t)
                .arg(&scale);
            let cfg = LaunchConfig {
                shared_mem_bytes: smem,
                ..grid
            };
            unsafe { launch.launch(cfg) }
                .map_err(device_error("launching backward_dkdv"))?;
        }
        Ok(())
    }
    // ANCHOR_END: backward_block

    /// Every rank's transfer stream waits for what its compute stream has queued so far:
    /// the inputs' last writes, and the buffers just allocated there (stream-ordered
    /// allocations are valid on another stream only after that).
    fn start_transfers(&self) -> Result<(), AttnError> {
        for r in 0..self.ranks() {
            let e = mark(self.gpus[r].stream())?;
            wait(&self.transport.stream(r), &e)?;
        }
        Ok(())
    }

    /// Every rank's compute stream waits for its transfers, so that nothing a transfer
    /// still touches is freed (buffers are freed on the compute stream).
    fn join_transfers(&self) -> Result<(), AttnError> {
        for r in 0..self.ranks() {
            let e = mark(&self.transport.stream(r))?;
            wait(self.gpus[r].stream(), &e)?;
        }
        Ok(())
    }

    // ANCHOR: ring_backward
    /// The gradients of q, k and v, given the forward's merged result `fwd` (from
    /// [`RingAttention::forward`]) and the output's gradient `dout`, one shard per rank
    /// each. Each block's dq share is added on the rank; its dk and dv shares are added
    /// into f32 sums that travel round the ring with the keys and values, and come home
    /// after the last step.
    pub fn backward(
        &self,
        q: &[Shard],
        k: &[Shard],
        v: &[Shard],
        fwd: &[ShardAttention],
        dout: &[Shard],
    ) -> Result<Vec<ShardGrads>, AttnError> {
        for (name, x) in [("q", q), ("k", k), ("v", v), ("dout", dout)] {
            self.check_shards(name, x)?;
        }
        self.check_attention(fwd)?;
        let n = self.ranks();
        let (mut acc_dq, mut travel) = self.alloc_sums()?;
        // δ of each chunk of queries, once, from the merged output
        let deltas = (0..n)
            .map(|r| {
                let (f, d) = (&fwd[r].chunks, &dout[r].chunks);
                let gpu = self.gpus[r];
                Ok([delta(gpu, &f[0], &d[0])?, delta(gpu, &f[1], &d[1])?])
            })
            .collect::<Result<Vec<_>, AttnError>>()?;
        let mut recv = self.alloc_receives()?;
        self.start_transfers()?;
        let mut free: Vec<Option<CudaEvent>> = (0..n).map(|_| None).collect();
        let mut arrived: Vec<Option<CudaEvent>> = (0..n).map(|_| None).collect();
        let mut grads_arrived: Vec<Option<CudaEvent>> = (0..n).map(|_| None).collect();
        for s in 0..n {
            // the keys and values of step s + 1 travel while step s computes, as in the
            // forward
            let mut next_arrived: Vec<Option<CudaEvent>> = (0..n).map(|_| None).collect();
            if s + 1 < n && self.parts.transfer() {
                for (r, event) in free.iter().enumerate() {
                    if let Some(e) = event {
                        wait(&self.transport.stream(r), e)?;
                    }
                }
                let (sends, mut recvs) = views(&mut recv, s, k, v);
                self.transport.pass_on(&sends, &mut recvs)?;
                for (r, e) in next_arrived.iter_mut().enumerate() {
                    *e = Some(mark(&self.transport.stream(r))?);
                }
            }
            let mut added: Vec<Option<CudaEvent>> = (0..n).map(|_| None).collect();
            for r in 0..n {
                let stream = self.gpus[r].stream();
                if let Some(e) = &arrived[r] {
                    wait(stream, e)?;
                }
                let (hk, hv) = held(&recv[r], s, &k[r], &v[r], self.parts);
                let blocks = if self.parts.compute() {
                    pairs(&self.split, r, s)
                } else {
                    Vec::new()
                };
                let (qr, dr, fr, del) =
                    (&q[r].chunks, &dout[r].chunks, &fwd[r].chunks, &deltas[r]);
                // dq's shares first: they need nothing from the other ranks
                for &p in &blocks {
                    let (i, j) = (p.query, p.key);
                    let dq = Some(&mut acc_dq[r][i]);
                    let qkv = (&qr[i], &hk[j], &hv[j]);
                    self.backward_block(r, p, qkv, &fr[i], &dr[i], &del[i], dq, None)?;
                }
                // ANCHOR: dkdv_travel
                // the sums of dk and dv for these keys come from rank r - 1 (its step s -
                // 1) while dq's shares compute; this rank's shares are added into them, and
                // they are passed on
                if let Some(e) = &grads_arrived[r] {
                    wait(stream, e)?;
                }
                let sums = &mut travel[r][s % 2];
                for &p in &blocks {
                    let (i, j) = (p.query, p.key);
                    let (dk, dv) = (&mut sums.dk[j], &mut sums.dv[j]);
                    let qkv = (&qr[i], &hk[j], &hv[j]);
                    self.backward_block(
                        r,
                        p,
                        qkv,
                        &fr[i],
                        &dr[i],
                        &del[i],
                        None,
                        Some((dk, dv)),
                    )?;
                }
                // nothing reads this step's keys and values after here
                free[r] = Some(mark(stream)?);
                added[r] = Some(mark(stream)?);
                // ANCHOR_END: dkdv_travel
            }
            // ANCHOR: dkdv_return
            // the sums move on after every step: after the last one, to the rank whose keys
            // they are (N hops in all bring them home)
            if n > 1 && self.parts.transfer() {
                for (r, e) in added.iter().enumerate() {
                    wait(&self.transport.stream(r), e.as_ref().expect("marked above"))?;
                }
                let (sends, mut recvs) = grad_views(&mut travel, s);
                self.transport.pass_on(&sends, &mut recvs)?;
                for (r, e) in grads_arrived.iter_mut().enumerate() {
                    *e = Some(mark(&self.transport.stream(r))?);
                }
            }
            // ANCHOR_END: dkdv_return
            arrived = next_arrived;
        }
        let result = self.round_gradients(&acc_dq, &travel, &grads_arrived)?;
        self.join_transfers()?;
        Ok(result)
    }

    /// Per rank, the f32 sums of its dq (one a chunk), and two sums of dk and dv: the one
    /// added to at this step, and the one the previous rank's arrives in.
    fn alloc_sums(&self) -> Result<(Vec<DqSums>, Vec<[KvGrads; 2]>), AttnError> {
        let n = self.ranks();
        let len = self.chunk.len();
        let mut acc_dq = Vec::with_capacity(n);
        let mut travel: Vec<[KvGrads; 2]> = Vec::with_capacity(n);
        for r in 0..n {
            let f32s = || self.alloc_f32(r, len, "allocating a gradient sum");
            acc_dq.push([f32s()?, f32s()?]);
            let sums = || -> Result<KvGrads, AttnError> {
                Ok(KvGrads {
                    dk: [f32s()?, f32s()?],
                    dv: [f32s()?, f32s()?],
                })
            };
            travel.push([sums()?, sums()?]);
        }
        Ok((acc_dq, travel))
    }

    /// Each rank's gradients in the ring's dtype, from its dq sums and the dk and dv sums
    /// that came home (after the last hop's `grads_arrived`).
    fn round_gradients(
        &self,
        acc_dq: &[DqSums],
        travel: &[[KvGrads; 2]],
        grads_arrived: &[Option<CudaEvent>],
    ) -> Result<Vec<ShardGrads>, AttnError> {
        let n = self.ranks();
        let home = if n > 1 { n % 2 } else { 0 };
        let mut result = Vec::with_capacity(n);
        for r in 0..n {
            let stream = self.gpus[r].stream();
            if let Some(e) = &grads_arrived[r] {
                wait(stream, e)?;
            }
            let sums = &travel[r][home];
            let round2 = |acc: &[CudaSlice<f32>; 2]| -> Result<Shard, AttnError> {
                Ok(Shard {
                    chunks: [self.round(r, &acc[0])?, self.round(r, &acc[1])?],
                })
            };
            result.push(ShardGrads {
                dq: round2(&acc_dq[r])?,
                dk: round2(&sums.dk)?,
                dv: round2(&sums.dv)?,
            });
        }
        Ok(result)
    }
    // ANCHOR_END: ring_backward

    fn check_attention(&self, fwd: &[ShardAttention]) -> Result<(), AttnError> {
        let rows = self.chunk.batch * self.chunk.heads * self.chunk.tokens;
        let ok = fwd.len() == self.ranks()
            && fwd.iter().all(|f| {
                f.chunks.iter().all(|c| {
                    c.out.shape == self.chunk
                        && c.out.dtype == self.dtype
                        && c.out.data.len() == self.chunk.len()
                        && c.lse.len() == rows
                })
            });
        if ok {
            Ok(())
        } else {
            Err(AttnError::ShapeMismatch {
                what: format!(
                    "the forward's result must hold, for each of {} ranks, two chunks of output {} {} and {rows} log-sum-exps",
                    self.ranks(),
                    self.chunk,
                    self.dtype.name()
                ),
            })
        }
    }
}

/// The keys and values rank `r` holds at step `s`: its own at step 0 (and at every step
/// when only the blocks are measured), then what arrived in receive buffer `(s - 1) % 2`.
fn held<'a>(
    recv: &'a [Kv],
    s: usize,
    k: &'a Shard,
    v: &'a Shard,
    parts: Parts,
) -> (&'a [DeviceTensor; 2], &'a [DeviceTensor; 2]) {
    if s == 0 || !parts.transfer() {
        (&k.chunks, &v.chunks)
    } else {
        let kv = &recv[(s - 1) % 2];
        (&kv.k, &kv.v)
    }
}

/// What every rank sends at step `s` (what it holds) and where it receives (buffer `s %
/// 2`).
#[allow(clippy::type_complexity)]
fn views<'a>(
    recv: &'a mut [Vec<Kv>],
    s: usize,
    k: &'a [Shard],
    v: &'a [Shard],
) -> (Vec<Vec<CudaView<'a, u8>>>, Vec<Vec<CudaViewMut<'a, u8>>>) {
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for (r, bufs) in recv.iter_mut().enumerate() {
        let (first, rest) = bufs.split_at_mut(1);
        let (into, held) = if s.is_multiple_of(2) {
            (&mut first[0], rest.first())
        } else {
            (&mut rest[0], Some(&first[0]))
        };
        let (hk, hv) = match (s, held) {
            (0, _) | (_, None) => (&k[r].chunks, &v[r].chunks),
            (_, Some(kv)) => (&kv.k, &kv.v),
        };
        sends.push(hk.iter().chain(hv).map(|t| bytes(&t.data)).collect());
        let Kv { k: ik, v: iv } = into;
        recvs.push(
            ik.iter_mut()
                .chain(iv.iter_mut())
                .map(|t| bytes_mut(&mut t.data))
                .collect(),
        );
    }
    (sends, recvs)
}

/// The sums of dk and dv each rank passes on after step `s` (`s % 2`) and where the
/// previous rank's arrive (`(s + 1) % 2`).
#[allow(clippy::type_complexity)]
fn grad_views(
    travel: &mut [[KvGrads; 2]],
    s: usize,
) -> (Vec<Vec<CudaView<'_, u8>>>, Vec<Vec<CudaViewMut<'_, u8>>>) {
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for pair in travel.iter_mut() {
        let [a, b] = pair;
        let (send, into) = if s.is_multiple_of(2) {
            (&*a, b)
        } else {
            (&*b, a)
        };
        sends.push(send.dk.iter().chain(&send.dv).map(|x| bytes(x)).collect());
        recvs.push(
            into.dk
                .iter_mut()
                .chain(into.dv.iter_mut())
                .map(|x| bytes_mut(x))
                .collect(),
        );
    }
    (sends, recvs)
}

/// A grid-stride launch over `n` values, two per thread.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = (n / 2).div_ceil(256).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Keeps the memory a GPU's stream-ordered pool has once taken, rather than returning it to
/// the driver at every synchronisation (the pool's default): a measurement then times the
/// kernels, not the driver mapping memory again.
pub fn keep_pool_memory(gpu: &Gpu) -> Result<(), AttnError> {
    use cudarc::driver::sys::{
        CUmemoryPool, cuDeviceGetDefaultMemPool, cuMemPoolSetAttribute,
    };
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the driver is loaded (a Gpu exists); each call reads or writes one value
    let ok = unsafe {
        cuDeviceGetDefaultMemPool(&mut pool, gpu.context().cu_device())
            == CUresult::CUDA_SUCCESS
            && cuMemPoolSetAttribute(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            ) == CUresult::CUDA_SUCCESS
    };
    if ok {
        Ok(())
    } else {
        Err(AttnError::Device {
            what: "setting the memory pool's release threshold".into(),
        })
    }
}

// ANCHOR: host_api
/// Causal attention over a ring on host arrays: the inputs rounded to `dtype` and scattered
/// over `ranks`, [`RingAttention::forward`], the result gathered and widened to `f32`. `T`
/// must be a multiple of `2N`.
pub fn ring_forward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
    ranks: Ranks,
) -> Result<Attention, AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    RingAttention::check(ranks.count(), shape, dtype)?;
    if shape.is_empty() {
        return Ok(Attention::empty(shape));
    }
    let ring = RingAttention::new(ranks, shape, dtype)?;
    let (q, k, v) = (ring.scatter(q)?, ring.scatter(k)?, ring.scatter(v)?);
    let fwd = ring.forward(&q, &k, &v)?;
    ring.gather_attention(&fwd)
}

/// [`ring_forward`] and then [`RingAttention::backward`] with the output's gradient `dout`.
pub fn ring_forward_backward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dout: ArrayView4<f32>,
    dtype: Dtype,
    ranks: Ranks,
) -> Result<(Attention, Grads), AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    check_same("dout", &dout, shape)?;
    RingAttention::check(ranks.count(), shape, dtype)?;
    if shape.is_empty() {
        return Ok((Attention::empty(shape), Grads::zeros(shape)));
    }
    let ring = RingAttention::new(ranks, shape, dtype)?;
    let (q, k, v, dout) = (
        ring.scatter(q)?,
        ring.scatter(k)?,
        ring.scatter(v)?,
        ring.scatter(dout)?,
    );
    let fwd = ring.forward(&q, &k, &v)?;
    let grads = ring.backward(&q, &k, &v, &fwd, &dout)?;
    let attention = ring.gather_attention(&fwd)?;
    let gather = |pick: fn(&ShardGrads) -> &Shard| -> Result<Array4<f32>, AttnError> {
        let mut out = Array4::zeros(shape.dims());
        for (r, g) in grads.iter().enumerate() {
            for (chunk, c) in pick(g).chunks.iter().zip(ring.split.rank_chunks(r)) {
                let x = ring.gpus[r].download(chunk)?;
                out.slice_mut(s![.., .., ring.split.chunk(c), ..])
                    .assign(&x);
            }
        }
        Ok(out)
    };
    let grads = Grads {
        dq: gather(|g| &g.dq)?,
        dk: gather(|g| &g.dk)?,
        dv: gather(|g| &g.dv)?,
    };
    Ok((attention, grads))
}
// ANCHOR_END: host_api

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_refuses_what_it_cannot_split_before_opening_a_gpu() {
        let shape = Shape::new(1, 2, 300, 64);
        let e = RingAttention::check(4, shape, Dtype::Bf16)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("multiple of 8") && e.contains("296") && e.contains("304"),
            "{e}"
        );
        assert!(RingAttention::check(3, shape, Dtype::Bf16).is_ok());
        let e = RingAttention::check(2, shape, Dtype::F32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bf16 or f16"), "{e}");
        let e = RingAttention::check(2, Shape::new(1, 1, 8, 48), Dtype::Bf16)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("head_dim 48") && e.contains("32, 64, 128"),
            "{e}"
        );
        assert_eq!(
            RingAttention::check(2, Shape::new(1, 1, 8, 0), Dtype::Bf16),
            Err(AttnError::ZeroHeadDim)
        );
        assert!(RingAttention::check(0, shape, Dtype::Bf16).is_err());
    }

    #[test]
    fn host_entry_points_check_their_input_before_the_gpu() {
        let a = Array4::<f32>::zeros((1, 2, 8, 64));
        let b = Array4::<f32>::zeros((1, 2, 9, 64));
        let ranks = Ranks::Simulated { gpu: 0, ranks: 2 };
        let e = ring_forward(a.view(), b.view(), a.view(), Dtype::Bf16, ranks).unwrap_err();
        assert!(matches!(e, AttnError::ShapeMismatch { .. }), "{e}");
        let odd = Array4::<f32>::zeros((1, 2, 10, 64));
        let e = ring_forward(odd.view(), odd.view(), odd.view(), Dtype::Bf16, ranks)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiple of 4"), "{e}");
        let e = ring_forward_backward(
            a.view(),
            a.view(),
            a.view(),
            b.view(),
            Dtype::Bf16,
            ranks,
        )
        .unwrap_err();
        assert!(matches!(e, AttnError::ShapeMismatch { .. }), "{e}");
        // empty input needs no GPU
        let z = Array4::<f32>::zeros((1, 2, 0, 64));
        let got = ring_forward(z.view(), z.view(), z.view(), Dtype::Bf16, ranks).unwrap();
        assert_eq!(got.out.dim(), (1, 2, 0, 64));
    }
}
