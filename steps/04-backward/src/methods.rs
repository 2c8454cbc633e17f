//! This step's part of the registry: it gives the methods of earlier steps their backward, by
//! name, without touching their lines: `naive` the backward by hand, `online` the blockwise
//! backward, `cuda_naive` the backward by hand on the GPU and `cuda_flash` the backward kernels
//! (each GPU one on host arrays, and prepared on the device with its forward for the benchmark).

use flash_core::inputs::random_normal;
use flash_core::method::{DeviceHooks, DeviceRun, DeviceRunSpec};
use flash_core::{Attention, AttnError, Dtype, Method};
use ndarray::ArrayView4;
use step03_cuda_forward::methods::{describe, prepare_inputs};
use step03_cuda_forward::{DeviceAttention, DeviceTensor, Gpu, device_error};

use crate::cuda::{DeviceBackwardFn, DeviceForwardFn, DeviceGrads};
use crate::{BackwardFn, Grads, check_backward, cuda, cuda_by_hand};
use flash_core::method::BackwardDtypeFn;

/// A method's backward: on host arrays, in the element type asked for where it takes one,
/// and prepared on the device for the benchmark.
type Backwards = (
    &'static str,
    BackwardFn,
    Option<BackwardDtypeFn>,
    Option<DeviceHooks>,
);

/// Which backward goes with which method of the earlier steps.
const BACKWARDS: &[Backwards] = &[
    // the tables P and dP, [b, h, T, T] each
    ("naive", crate::backward_by_hand, None, None),
    // P rebuilt from the log-sum-exp a block at a time
    ("online", crate::backward, None, None),
    // cuBLAS through the tables P and dP on the GPU, [b·h, T, T] each
    (
        "cuda_naive",
        gpu_backward::<BY_HAND>,
        Some(gpu_backward_dtype::<BY_HAND>),
        Some(HOOKS[BY_HAND]),
    ),
    // δ, then dK and dV per block of keys, then dQ per block of queries
    (
        "cuda_flash",
        gpu_backward::<FLASH>,
        Some(gpu_backward_dtype::<FLASH>),
        Some(HOOKS[FLASH]),
    ),
];

/// Gives each method of `methods` that has a backward in this step its backward.
pub fn add_backwards(methods: &mut [Method]) {
    for m in methods.iter_mut() {
        if let Some(&(_, host, dtype, gpu)) = BACKWARDS.iter().find(|(name, ..)| *name == m.name) {
            m.backward = Some(host);
            m.backward_dtype = dtype;
            m.gpu_backward = gpu;
        }
    }
}

/// A GPU backward (`PAIRS[P]`'s) on host arrays, in bf16, after a forward that returned `fwd`.
pub fn gpu_backward<const P: usize>(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
) -> Result<Grads, AttnError> {
    gpu_backward_dtype::<P>(q, k, v, fwd, dout, Dtype::Bf16)
}

/// [`gpu_backward`] in bf16 or f16.
pub fn gpu_backward_dtype<const P: usize>(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Grads, AttnError> {
    on_host(PAIRS[P].backward, q, k, v, fwd, dout, dtype)
}

/// A backward on device tensors run on host arrays: the inputs and what the forward returned
/// uploaded in `dtype`, the gradients downloaded and widened to `f32`.
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
    let dtype = step03_cuda_forward::half_dtype(dtype)?;
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
    /// The forward into output buffers allocated once, where it has such a form: a timed run is
    /// then the kernels alone. Attention by hand allocates its table on every call anyway.
    pub forward_into: Option<ForwardIntoFn>,
    pub backward: DeviceBackwardFn,
}

/// The GPU methods' pairs: `cuda_naive`'s, attention by hand both ways, and `cuda_flash`'s, the
/// kernels.
const PAIRS: [Pair; 2] = [
    Pair {
        forward: Gpu::by_hand,
        forward_into: None,
        backward: cuda_by_hand::backward,
    },
    Pair {
        forward: Gpu::forward,
        forward_into: Some(Gpu::forward_into),
        backward: cuda::backward,
    },
];
/// `cuda_naive`'s place in [`PAIRS`].
pub const BY_HAND: usize = 0;
/// `cuda_flash`'s place in [`PAIRS`].
pub const FLASH: usize = 1;

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
            what: "this driver has no stream-ordered memory pool to read a peak from".into(),
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

/// Each pair's forward and backward prepared for the benchmark, in the order of [`PAIRS`].
pub const HOOKS: [DeviceHooks; 2] = [
    DeviceHooks {
        describe,
        prepare: |spec| prepare(PAIRS[BY_HAND], spec),
    },
    DeviceHooks {
        describe,
        prepare: |spec| prepare(PAIRS[FLASH], spec),
    },
];
