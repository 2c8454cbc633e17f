//! This step's part of the registry. It adds no method; it gives four methods of earlier
//! steps a backward. For each, [`Backward`] is implemented on the earlier step's type:
//! `naive` the backward by hand, `online` the blockwise backward, `cuda_naive` the backward
//! by hand on the GPU and `cuda_flash` the backward kernels (each GPU one on host arrays,
//! and prepared on the device with its forward for the benchmark). [`WithBackward`] of that
//! type is the method with its backward, which the registry puts where the method stood.

use flash_core::inputs::random_normal;
use flash_core::method::{DeviceRun, DeviceRunSpec, not_on_a_device};
use flash_core::{Attention, AttnError, Describe, Descriptor, Dtype, Method, check_f32};
use ndarray::ArrayView4;
use step01_naive::Naive;
use step02_online_softmax::Online;
use step03_cuda_forward::gpu::{DeviceTensor, Gpu, device_error};
use step03_cuda_forward::methods::prepare_inputs;
use step03_cuda_forward::{CudaFlash, CudaNaive, DeviceAttention};

use crate::cuda::{DeviceBackwardFn, DeviceForwardFn, DeviceGrads};
use crate::{Grads, check_backward, cuda, cuda_by_hand};

/// An earlier step's method `M` with the backward this step gives it: `M`'s name, forward
/// and device runs, and `M`'s [`Backward`].
#[derive(Clone, Copy, Debug)]
pub struct WithBackward<M>(pub M);

/// What this step gives a method of an earlier step: its backward pass, on host arrays and,
/// for a GPU method, prepared with its forward on the device. [`WithBackward`] makes the
/// two one [`Method`].
pub trait Backward: Method {
    /// [`Method::backward`].
    fn backward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        fwd: &Attention,
        dout: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Grads, AttnError>;
    /// [`Method::prepare_backward`]; a CPU method has nothing to prepare.
    fn prepare_backward(
        &self,
        _spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        Err(not_on_a_device(self.name()))
    }
}

impl<M: Backward> Describe for WithBackward<M> {
    fn descriptor(&self) -> Descriptor {
        self.0.descriptor()
    }
}

impl<M: Backward> Method for WithBackward<M> {
    fn implementation(&self) -> String {
        self.0.implementation()
    }
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        self.0.forward(q, k, v, dtype)
    }
    fn describe_device(&self) -> Result<String, AttnError> {
        self.0.describe_device()
    }
    fn prepare_forward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        self.0.prepare_forward(spec)
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
        Backward::backward(&self.0, q, k, v, fwd, dout, dtype)
    }
    fn prepare_backward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        Backward::prepare_backward(&self.0, spec)
    }
}

/// `naive`'s: through the tables P and dP, [b, h, T, T] each.
impl Backward for Naive {
    fn backward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        fwd: &Attention,
        dout: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Grads, AttnError> {
        check_f32(dtype)?;
        crate::backward_by_hand(q, k, v, fwd, dout)
    }
}

/// `online`'s: P rebuilt from the log-sum-exp a block at a time.
impl Backward for Online {
    fn backward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        fwd: &Attention,
        dout: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Grads, AttnError> {
        check_f32(dtype)?;
        crate::backward(q, k, v, fwd, dout)
    }
}

/// `cuda_naive`'s: cuBLAS through the tables P and dP on the GPU, [b·h, T, T] each.
impl Backward for CudaNaive {
    fn backward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        fwd: &Attention,
        dout: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Grads, AttnError> {
        on_host(cuda_by_hand::backward, q, k, v, fwd, dout, dtype)
    }
    fn prepare_backward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare(BY_HAND, spec)
    }
}

/// `cuda_flash`'s: δ, then dK and dV per block of keys, then dQ per block of queries
/// (`kernels/flash_backward.cu`).
impl Backward for CudaFlash {
    fn backward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        fwd: &Attention,
        dout: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Grads, AttnError> {
        on_host(cuda::backward, q, k, v, fwd, dout, dtype)
    }
    fn prepare_backward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare(FLASH, spec)
    }
}

/// A backward on device tensors run on host arrays: the inputs and what the forward
/// returned uploaded in `dtype`, the gradients downloaded and widened to `f32`.
pub fn on_host(
    backward: DeviceBackwardFn,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Grads, AttnError> {
    // bad shapes and dtypes are refused the same way with or without a GPU
    let shape = check_backward(&q, &k, &v, fwd, &dout)?;
    let dtype = step03_cuda_forward::gpu::half_dtype(dtype)?;
    let gpu = Gpu::shared()?;
    if shape.is_empty() {
        return Ok(Grads::zeros(shape));
    }
    let up = |x: ArrayView4<f32>| gpu.upload(x, dtype);
    let (q, k, v, dout) = (up(q)?, up(k)?, up(v)?, up(dout)?);
    let lse_host = fwd.lse.as_standard_layout();
    let lse = gpu
        .stream()
        .clone_htod(lse_host.as_slice().expect("standard layout"))
        .map_err(device_error("copying to the GPU"))?;
    let fwd = DeviceAttention {
        out: up(fwd.out.view())?,
        lse,
    };
    let g = backward(gpu, &q, &k, &v, &fwd, &dout)?;
    download_grads(gpu, &g)
}

fn download_grads(gpu: &Gpu, g: &DeviceGrads) -> Result<Grads, AttnError> {
    Ok(Grads {
        dq: gpu.download(&g.dq)?,
        dk: gpu.download(&g.dk)?,
        dv: gpu.download(&g.dv)?,
    })
}

/// [`Gpu::forward_into`]'s shape: a forward into output buffers allocated before.
pub type ForwardIntoFn = fn(
    &Gpu,
    &DeviceTensor,
    &DeviceTensor,
    &DeviceTensor,
    &mut DeviceAttention,
) -> Result<(), AttnError>;

/// A forward and the backward that goes with it, on device tensors.
#[derive(Clone, Copy)]
pub struct Pair {
    pub forward: DeviceForwardFn,
    /// The forward into output buffers allocated once, where it has such a form: a timed
    /// run is then the kernels alone. Attention by hand allocates its table on every call
    /// anyway.
    pub forward_into: Option<ForwardIntoFn>,
    pub backward: DeviceBackwardFn,
}

/// `cuda_naive`'s pair: attention by hand both ways.
pub const BY_HAND: Pair = Pair {
    forward: Gpu::by_hand,
    forward_into: None,
    backward: cuda_by_hand::backward,
};
/// `cuda_flash`'s pair: the kernels.
pub const FLASH: Pair = Pair {
    forward: Gpu::forward,
    forward_into: Some(Gpu::forward_into),
    backward: cuda::backward,
};

/// A forward and its backward, prepared together on the device.
struct Prepared {
    gpu: &'static Gpu,
    pair: Pair,
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    dout: DeviceTensor,
    /// The forward's output buffers, for a pair with `forward_into`.
    out: Option<DeviceAttention>,
}

/// A pair prepared for the benchmark on the inputs `spec` describes (and a random `dout`).
pub fn prepare(pair: Pair, spec: &DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError> {
    let gpu = Gpu::shared()?;
    let [q, k, v] = prepare_inputs(spec)?;
    let dout = gpu.upload(random_normal(spec.shape, spec.seed + 3).view(), q.dtype)?;
    let out = match pair.forward_into {
        Some(_) => Some(gpu.alloc_output(spec.shape, q.dtype)?),
        None => None,
    };
    Ok(Box::new(Prepared {
        gpu,
        pair,
        q,
        k,
        v,
        dout,
        out,
    }))
}

impl Prepared {
    /// The forward and the backward once, as a user calls them, output allocation included.
    fn both(&self) -> Result<(DeviceAttention, DeviceGrads), AttnError> {
        let (gpu, q, k, v, dout) = (self.gpu, &self.q, &self.k, &self.v, &self.dout);
        let fwd = (self.pair.forward)(gpu, q, k, v)?;
        let grads = (self.pair.backward)(gpu, q, k, v, &fwd, dout)?;
        Ok((fwd, grads))
    }
}

impl DeviceRun for Prepared {
    fn time_ms(&mut self) -> Result<f64, AttnError> {
        let (gpu, pair) = (self.gpu, self.pair);
        match (pair.forward_into, &mut self.out) {
            (Some(forward_into), Some(out)) => {
                let (q, k, v, dout) = (&self.q, &self.k, &self.v, &self.dout);
                gpu.time_ms(|| {
                    forward_into(gpu, q, k, v, out)?;
                    (pair.backward)(gpu, q, k, v, out, dout)
                })
            }
            _ => gpu.time_ms(|| self.both()),
        }
    }

    fn peak_bytes(&mut self) -> Result<u64, AttnError> {
        let peak = self.gpu.peak_allocated(|| self.both().map(drop))?.1;
        peak.ok_or_else(|| AttnError::Device {
            what: "this driver has no stream-ordered memory pool to read a peak from"
                .into(),
        })
    }

    fn result(&mut self) -> Result<Attention, AttnError> {
        let fwd = (self.pair.forward)(self.gpu, &self.q, &self.k, &self.v)?;
        self.gpu.download_attention(&fwd)
    }

    fn grads(&mut self) -> Result<Option<Grads>, AttnError> {
        let (_, g) = self.both()?;
        download_grads(self.gpu, &g).map(Some)
    }
}
