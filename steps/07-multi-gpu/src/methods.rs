//! This step's method in the registry: `cuda_ring`, ring attention over GPUs. On host
//! arrays (what the tests and `attend` call) it runs two ranks simulated on GPU 0, so that
//! the ring's schedule, merge and transfers run wherever there is one GPU; the benchmark
//! prepares it over `--gpus` GPUs, one rank each, with NCCL between them.

use std::time::Instant;

use flash_core::inputs::{random_normal, random_qkv};
use flash_core::method::Grads;
use flash_core::method::{DeviceRun, DeviceRunSpec};
use flash_core::{
    Attention, AttnError, Describe, Descriptor, Device, Dtype, Method, Shape, check_qkv,
};
use ndarray::{Array3, Array4, ArrayView4, s};
use step03_cuda_forward::gpu::{Gpu, device_error, half_dtype};
use step03_cuda_forward::methods::describe;
use step04_backward::check_backward;

use crate::gpu::{Ranks, RingAttention, Shard, ShardAttention, ring_forward};

/// The ranks of the host-array entry points: two, simulated on GPU 0.
pub const HOST_RANKS: Ranks = Ranks::Simulated { gpu: 0, ranks: 2 };

/// This step's methods.
pub fn methods() -> Vec<&'static dyn Method> {
    vec![&CudaRing]
}

/// `cuda_ring`: ring attention over GPUs, forward and backward.
#[derive(Clone, Copy, Debug)]
pub struct CudaRing;

impl Describe for CudaRing {
    fn descriptor(&self) -> Descriptor {
        Descriptor::new(
            "cuda_ring",
            "07-multi-gpu",
            Device::Cuda,
            "ring attention: the sequence split zig-zag over GPUs, keys and values passed round a ring (NCCL) while each GPU runs step 03's and step 04's kernels on its blocks, partial results merged through their log-sum-exps",
        )
    }
}

impl Method for CudaRing {
    fn implementation(&self) -> String {
        implementation()
    }
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        ring_host_forward(q, k, v, dtype)
    }
    fn describe_device(&self) -> Result<String, AttnError> {
        describe()
    }
    fn prepare_forward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare(spec, false)
    }
    fn has_backward(&self) -> bool {
        true
    }
    fn backward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        fwd: &Attention,
        dout: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Grads, AttnError> {
        ring_host_backward(q, k, v, fwd, dout, dtype)
    }
    fn prepare_backward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare(spec, true)
    }
    fn multi_gpu(&self) -> bool {
        true
    }
}

/// What `cuda_ring` runs.
pub fn implementation() -> String {
    "ring.cu merges each block into f32 (out, lse); blocks by flash_forward.cu / flash_backward.cu (CAUSAL=0 off the diagonal); NCCL send/recv on a second stream, double-buffered; on host arrays 2 ranks simulated on GPU 0".into()
}

/// Causal attention ignores tokens appended at the end, so an input whose length the split
/// cannot take is padded with zeros to the next multiple of `2N` and the padding dropped
/// after: the host entry points take any length.
fn padded_tokens(tokens: usize, ranks: usize) -> usize {
    tokens.div_ceil(2 * ranks) * 2 * ranks
}

fn pad(x: ArrayView4<f32>, tokens: usize) -> Array4<f32> {
    let (b, h, t, d) = x.dim();
    let mut out = Array4::zeros((b, h, tokens, d));
    out.slice_mut(s![.., .., ..t, ..]).assign(&x);
    out
}

fn cut(x: Array4<f32>, tokens: usize) -> Array4<f32> {
    x.slice(s![.., .., ..tokens, ..]).to_owned()
}

/// `cuda_ring` on host arrays, in bf16 or f16.
pub fn ring_host_forward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Attention, AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    half_dtype(dtype)?;
    let t = shape.tokens;
    let tp = padded_tokens(t, HOST_RANKS.count());
    if tp == t {
        return ring_forward(q, k, v, dtype, HOST_RANKS);
    }
    let got = ring_forward(
        pad(q, tp).view(),
        pad(k, tp).view(),
        pad(v, tp).view(),
        dtype,
        HOST_RANKS,
    )?;
    Ok(Attention {
        out: cut(got.out, t),
        lse: got.lse.slice(s![.., .., ..t]).to_owned(),
    })
}

/// `cuda_ring`'s backward on host arrays, in bf16 or f16: the forward's result `fwd`
/// scattered over the ranks as each rank's merged output and log-sum-exp, then the ring's
/// backward. Padding rows get a zero gradient of the output, so they add nothing to any
/// gradient.
pub fn ring_host_backward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Grads, AttnError> {
    let shape = check_backward(&q, &k, &v, fwd, &dout)?;
    half_dtype(dtype)?;
    let t = shape.tokens;
    let tp = padded_tokens(t, HOST_RANKS.count());
    let padded = Shape::new(shape.batch, shape.heads, tp, shape.head_dim);
    RingAttention::check(HOST_RANKS.count(), padded, dtype)?;
    if shape.is_empty() {
        return Ok(Grads::zeros(shape));
    }
    let ring = RingAttention::new(HOST_RANKS, padded, dtype)?;
    let up = |x: ArrayView4<f32>| ring.scatter(pad(x, tp).view());
    let (q, k, v, dout, out) = (up(q)?, up(k)?, up(v)?, up(dout)?, up(fwd.out.view())?);
    let mut lse = Array3::<f32>::zeros((shape.batch, shape.heads, tp));
    lse.slice_mut(s![.., .., ..t]).assign(&fwd.lse);
    let fwd = scatter_attention(&ring, out, &lse)?;
    let grads = ring.backward(&q, &k, &v, &fwd, &dout)?;
    let gather =
        |pick: fn(&crate::gpu::ShardGrads) -> &Shard| -> Result<Array4<f32>, AttnError> {
            let mut all = Array4::zeros(padded.dims());
            let split = ring.split();
            for (r, g) in grads.iter().enumerate() {
                for (chunk, c) in pick(g).chunks.iter().zip(split.rank_chunks(r)) {
                    let x = ring.gpu(r).download(chunk)?;
                    all.slice_mut(s![.., .., split.chunk(c), ..]).assign(&x);
                }
            }
            Ok(cut(all, t))
        };
    Ok(Grads {
        dq: gather(|g| &g.dq)?,
        dk: gather(|g| &g.dk)?,
        dv: gather(|g| &g.dv)?,
    })
}

/// A forward's result on the host as the ranks' [`ShardAttention`]s: the output's shards as
/// they are, each chunk's log-sum-exp copied to its rank.
fn scatter_attention(
    ring: &RingAttention,
    out: Vec<Shard>,
    lse: &Array3<f32>,
) -> Result<Vec<ShardAttention>, AttnError> {
    let split = ring.split();
    out.into_iter()
        .enumerate()
        .map(|(r, shard)| {
            let [o0, o1] = shard.chunks;
            let [c0, c1] = split.rank_chunks(r);
            let up = |c: usize| {
                let part = lse.slice(s![.., .., split.chunk(c)]).to_owned();
                let part = part.as_standard_layout();
                ring.gpu(r)
                    .stream()
                    .clone_htod(part.as_slice().expect("standard layout"))
                    .map_err(device_error("copying to the GPU"))
            };
            Ok(ShardAttention {
                chunks: [
                    step03_cuda_forward::DeviceAttention {
                        out: o0,
                        lse: up(c0)?,
                    },
                    step03_cuda_forward::DeviceAttention {
                        out: o1,
                        lse: up(c1)?,
                    },
                ],
            })
        })
        .collect()
}

/// The ring prepared for the benchmark: one rank per GPU of `--gpus`, the inputs scattered.
struct Prepared {
    ring: RingAttention,
    q: Vec<Shard>,
    k: Vec<Shard>,
    v: Vec<Shard>,
    /// The output's gradient, for a forward and backward run.
    dout: Option<Vec<Shard>>,
}

fn prepare(spec: &DeviceRunSpec, backward: bool) -> Result<Box<dyn DeviceRun>, AttnError> {
    let dtype = half_dtype(spec.dtype)?;
    let gpus = spec.gpus.max(1);
    RingAttention::check(gpus, spec.shape, dtype)?;
    let ring = RingAttention::new(Ranks::Gpus(gpus), spec.shape, dtype)?;
    let [q, k, v] = random_qkv(spec.shape, spec.seed);
    let (q, k, v) = (
        ring.scatter(q.view())?,
        ring.scatter(k.view())?,
        ring.scatter(v.view())?,
    );
    let dout = match backward {
        true => Some(ring.scatter(random_normal(spec.shape, spec.seed + 3).view())?),
        false => None,
    };
    Ok(Box::new(Prepared {
        ring,
        q,
        k,
        v,
        dout,
    }))
}

impl Prepared {
    /// One call as a user makes it: the forward, and the backward after it when prepared
    /// so.
    fn call(
        &self,
    ) -> Result<(Vec<ShardAttention>, Option<Vec<crate::gpu::ShardGrads>>), AttnError> {
        let fwd = self.ring.forward(&self.q, &self.k, &self.v)?;
        let grads = match &self.dout {
            Some(dout) => Some(self.ring.backward(&self.q, &self.k, &self.v, &fwd, dout)?),
            None => None,
        };
        Ok((fwd, grads))
    }
}

/// Milliseconds of `f`'s work on every GPU of `ring`: on one GPU, CUDA events on its stream
/// (step 03's [`Gpu::time_ms`]); on several, the wall clock from a point where every GPU is
/// idle to the point where every GPU has finished (one GPU's events cannot see another's
/// work).
pub fn time_ring_ms<T>(
    ring: &RingAttention,
    f: impl FnOnce() -> Result<T, AttnError>,
) -> Result<f64, AttnError> {
    let gpus = ring.distinct_gpus();
    if gpus.len() == 1 {
        return gpus[0].time_ms(|| {
            let r = f()?;
            // the transfer stream's last work is joined into the compute stream by forward
            // and backward, so the end event sees it
            Ok(r)
        });
    }
    ring.synchronize()?;
    let start = Instant::now();
    let r = f()?;
    ring.synchronize()?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    drop(r);
    Ok(ms)
}

/// The largest peak of device memory over the GPUs of `ring` while `f` runs (each GPU's
/// stream-ordered pool: reset, run, read).
pub fn peak_per_gpu<T>(
    ring: &RingAttention,
    f: impl FnOnce() -> Result<T, AttnError>,
) -> Result<Vec<u64>, AttnError> {
    fn nested<T>(
        gpus: &[&Gpu],
        f: Box<dyn FnOnce() -> Result<T, AttnError> + '_>,
    ) -> Result<(T, Vec<u64>), AttnError> {
        match gpus.split_first() {
            None => Ok((f()?, Vec::new())),
            Some((g, rest)) => {
                let ((value, mut inner), peak) = g.peak_allocated(|| nested(rest, f))?;
                let peak = peak.ok_or_else(|| AttnError::Device {
                    what:
                        "this driver has no stream-ordered memory pool to read a peak from"
                            .into(),
                })?;
                inner.insert(0, peak);
                Ok((value, inner))
            }
        }
    }
    let gpus = ring.distinct_gpus();
    let (_, peaks) = nested(
        &gpus,
        Box::new(|| {
            let r = f()?;
            ring.synchronize()?;
            Ok(r)
        }),
    )?;
    Ok(peaks)
}

impl DeviceRun for Prepared {
    fn time_ms(&mut self) -> Result<f64, AttnError> {
        time_ring_ms(&self.ring, || self.call())
    }

    fn peak_bytes(&mut self) -> Result<u64, AttnError> {
        let peaks = peak_per_gpu(&self.ring, || self.call())?;
        Ok(peaks.into_iter().max().unwrap_or(0))
    }

    fn result(&mut self) -> Result<Attention, AttnError> {
        let fwd = self.ring.forward(&self.q, &self.k, &self.v)?;
        self.ring.gather_attention(&fwd)
    }

    fn grads(&mut self) -> Result<Option<Grads>, AttnError> {
        let (_, grads) = self.call()?;
        let Some(grads) = grads else { return Ok(None) };
        let shape = self.ring.shape();
        let split = self.ring.split();
        let gather = |pick: fn(&crate::gpu::ShardGrads) -> &Shard| {
            let mut all = Array4::zeros(shape.dims());
            for (r, g) in grads.iter().enumerate() {
                for (chunk, c) in pick(g).chunks.iter().zip(split.rank_chunks(r)) {
                    let x = self.ring.gpu(r).download(chunk)?;
                    all.slice_mut(s![.., .., split.chunk(c), ..]).assign(&x);
                }
            }
            Ok::<_, AttnError>(all)
        };
        Ok(Some(Grads {
            dq: gather(|g| &g.dq)?,
            dk: gather(|g| &g.dk)?,
            dv: gather(|g| &g.dv)?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_length_is_padded_to_a_multiple_of_2n() {
        assert_eq!(padded_tokens(1, 2), 4);
        assert_eq!(padded_tokens(77, 2), 80);
        assert_eq!(padded_tokens(300, 2), 300);
        assert_eq!(padded_tokens(0, 2), 0);
    }

    #[test]
    fn the_method_is_in_the_registry_with_its_backward() {
        let m = methods()[0];
        assert_eq!(m.name(), "cuda_ring");
        assert!(m.device() == Device::Cuda && m.has_backward() && m.multi_gpu());
    }
}
