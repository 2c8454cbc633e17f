//! This step's methods in the registry: `cuda_hopper`, what the library runs (rung 1 or 4 of the
//! forward by the shape, the one-pass backward), and each rung of the ladder as a method of its
//! own, on host arrays for the tests and `attend`, and prepared on the device for the
//! benchmark, as step 03's `cuda_flash` is.

use flash_core::method::{DeviceHooks, DeviceRun, DeviceRunSpec};
use flash_core::{Attention, AttnError, Device, Dtype, ForwardFn, Method, check_qkv};
use ndarray::ArrayView4;
use step03_cuda_forward::methods::{describe, prepare_inputs};
use step03_cuda_forward::{DeviceAttention, DeviceTensor, Gpu, half_dtype};
use step04_backward::cuda::{DeviceBackwardFn, DeviceGrads};
use step04_backward::methods::{Pair, on_host, prepare as prepare_pair};

use crate::backward;
use crate::forward;
use crate::kernel::{BackwardKernels, ForwardKernel, ForwardRung};

/// This step's methods: `cuda_hopper`, the forward's rungs 1 to 4, and the backward's rung 1
/// (two passes) after `cuda_hopper`'s forward.
pub fn methods() -> Vec<Method> {
    let mut hopper = Method::new(
        "cuda_hopper",
        "06-hopper",
        Device::Cuda,
        "FlashAttention with Hopper's instructions (TMA, wgmma, warp specialisation), no T×T table: rung 1 or 4 of the forward by the shape, the backward in one pass (compute capability 9.0, head dims 64 and 128)",
        |q, k, v| on_device(ForwardKernel::for_shape, q, k, v, Dtype::Bf16),
    )
    .with_dtype(|q, k, v, dtype| on_device(ForwardKernel::for_shape, q, k, v, dtype))
    .with_implementation(implementation)
    .with_gpu(DeviceHooks {
        describe,
        prepare: |spec| prepare(ForwardKernel::for_shape, spec),
    });
    hopper.backward =
        Some(|q, k, v, fwd, dout| on_host(backward::backward, q, k, v, fwd, dout, Dtype::Bf16));
    hopper.backward_dtype =
        Some(|q, k, v, fwd, dout, dtype| on_host(backward::backward, q, k, v, fwd, dout, dtype));
    hopper.gpu_backward = Some(DeviceHooks {
        describe,
        prepare: |spec| prepare_pair(pair(backward::backward), spec),
    });

    let mut two_passes = Method::new(
        "hopper_two_passes",
        "06-hopper",
        Device::Cuda,
        "Hopper backward rung 1: step 04's two passes (dK and dV, then dQ), the same bits every run; the forward is cuda_hopper's",
        |q, k, v| on_device(ForwardKernel::for_shape, q, k, v, Dtype::Bf16),
    )
    .with_dtype(|q, k, v, dtype| on_device(ForwardKernel::for_shape, q, k, v, dtype))
    .with_gpu(DeviceHooks {
        describe,
        prepare: |spec| prepare(ForwardKernel::for_shape, spec),
    });
    two_passes.backward =
        Some(|q, k, v, fwd, dout| on_host(two_passes_backward, q, k, v, fwd, dout, Dtype::Bf16));
    two_passes.backward_dtype =
        Some(|q, k, v, fwd, dout, dtype| on_host(two_passes_backward, q, k, v, fwd, dout, dtype));
    two_passes.gpu_backward = Some(DeviceHooks {
        describe,
        prepare: |spec| prepare_pair(pair(two_passes_backward), spec),
    });

    let rungs = ForwardRung::ALL.map(|rung| {
        Method::new(
            rung.method(),
            "06-hopper",
            Device::Cuda,
            rung.about(),
            RUNG_FORWARD[rung.number() - 1],
        )
        .with_dtype(RUNG_FORWARD_DTYPE[rung.number() - 1])
        .with_gpu(RUNG_HOOKS[rung.number() - 1])
    });
    // the ladder's order: the forward's rungs, the backward's first, then what runs
    let mut all = Vec::from(rungs);
    all.extend([two_passes, hopper]);
    all
}

/// Rung `R`'s kernel (0-based) for a length and head dim.
fn rung_kernel<const R: usize>(tokens: usize, head_dim: usize) -> ForwardKernel {
    ForwardRung::ALL[R].shape(tokens, head_dim)
}

const RUNG_FORWARD: [ForwardFn; 4] = [
    |q, k, v| on_device(rung_kernel::<0>, q, k, v, Dtype::Bf16),
    |q, k, v| on_device(rung_kernel::<1>, q, k, v, Dtype::Bf16),
    |q, k, v| on_device(rung_kernel::<2>, q, k, v, Dtype::Bf16),
    |q, k, v| on_device(rung_kernel::<3>, q, k, v, Dtype::Bf16),
];
const RUNG_FORWARD_DTYPE: [flash_core::method::ForwardDtypeFn; 4] = [
    |q, k, v, dtype| on_device(rung_kernel::<0>, q, k, v, dtype),
    |q, k, v, dtype| on_device(rung_kernel::<1>, q, k, v, dtype),
    |q, k, v, dtype| on_device(rung_kernel::<2>, q, k, v, dtype),
    |q, k, v, dtype| on_device(rung_kernel::<3>, q, k, v, dtype),
];
const RUNG_HOOKS: [DeviceHooks; 4] = [
    DeviceHooks {
        describe,
        prepare: |spec| prepare(rung_kernel::<0>, spec),
    },
    DeviceHooks {
        describe,
        prepare: |spec| prepare(rung_kernel::<1>, spec),
    },
    DeviceHooks {
        describe,
        prepare: |spec| prepare(rung_kernel::<2>, spec),
    },
    DeviceHooks {
        describe,
        prepare: |spec| prepare(rung_kernel::<3>, spec),
    },
];

/// Which forward kernel a method runs for a length and head dim.
pub type PickForward = fn(usize, usize) -> ForwardKernel;

/// The backward's rung 1, the two passes.
fn two_passes_backward(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    let kernels = BackwardKernels::two_passes(q.shape.tokens, q.shape.head_dim);
    backward::backward_with(gpu, kernels, q, k, v, fwd, dout)
}

/// `cuda_hopper`'s forward with `backward`, prepared together for the benchmark's backward.
fn pair(backward: DeviceBackwardFn) -> Pair {
    Pair {
        forward: forward::forward,
        forward_into: Some(|gpu, q, k, v, out| {
            let kernel = ForwardKernel::for_shape(q.shape.tokens, q.shape.head_dim);
            forward::forward_with(gpu, kernel, q, k, v, out)
        }),
        backward,
    }
}

/// The forward `pick` chooses, on host arrays, in bf16 or f16: inputs rounded to it, the output
/// widened back.
pub fn on_device(
    pick: PickForward,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Attention, AttnError> {
    check_qkv(&q, &k, &v)?;
    let dtype = half_dtype(dtype)?;
    let gpu = Gpu::shared()?;
    let up = |x: ArrayView4<f32>| gpu.upload(x, dtype);
    let (q, k, v) = (up(q)?, up(k)?, up(v)?);
    let mut result = gpu.alloc_output(q.shape, dtype)?;
    let kernel = pick(q.shape.tokens, q.shape.head_dim);
    forward::forward_with(gpu, kernel, &q, &k, &v, &mut result)?;
    gpu.download_attention(&result)
}

/// What `cuda_hopper` runs, in a line.
pub fn implementation() -> String {
    let f = |t, d| ForwardKernel::for_shape(t, d).name();
    format!(
        "forward rung 1 (kernels/forward_1_wgmma.cu) at head dim 64 up to 4k tokens ({}), rung 4 (forward_4_overlap.cu) beyond ({}) and at 128 ({}); backward in one pass (backward_2_one_pass.cu: {}); warpgroups x stages x blocks a multiprocessor; NVRTC sm_90a",
        f(4096, 64),
        f(8192, 64),
        f(8192, 128),
        BackwardKernels::for_shape(8192, 64).name(),
    )
}

struct Prepared {
    gpu: &'static Gpu,
    pick: PickForward,
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    out: DeviceAttention,
}

fn prepare(pick: PickForward, spec: &DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError> {
    let gpu = Gpu::shared()?;
    forward::check_hopper(gpu)?;
    let [q, k, v] = prepare_inputs(spec)?;
    forward::check(&q, &k, &v)?;
    let out = gpu.alloc_output(spec.shape, q.dtype)?;
    Ok(Box::new(Prepared {
        gpu,
        pick,
        q,
        k,
        v,
        out,
    }))
}

impl Prepared {
    fn kernel(&self) -> ForwardKernel {
        (self.pick)(self.q.shape.tokens, self.q.shape.head_dim)
    }
}

impl DeviceRun for Prepared {
    fn time_ms(&mut self) -> Result<f64, AttnError> {
        let kernel = self.kernel();
        let (gpu, q, k, v, out) = (self.gpu, &self.q, &self.k, &self.v, &mut self.out);
        gpu.time_ms(|| forward::forward_with(gpu, kernel, q, k, v, out))
    }

    fn peak_bytes(&mut self) -> Result<u64, AttnError> {
        let kernel = self.kernel();
        let (gpu, q, k, v) = (self.gpu, &self.q, &self.k, &self.v);
        gpu.peak_allocated(|| {
            let mut out = gpu.alloc_output(q.shape, q.dtype)?;
            forward::forward_with(gpu, kernel, q, k, v, &mut out)?;
            Ok(out)
        })?
        .1
        .ok_or_else(|| AttnError::Device {
            what: "this driver has no stream-ordered memory pool to read a peak from".into(),
        })
    }

    fn result(&mut self) -> Result<Attention, AttnError> {
        let kernel = self.kernel();
        let mut out = self.gpu.alloc_output(self.q.shape, self.q.dtype)?;
        forward::forward_with(self.gpu, kernel, &self.q, &self.k, &self.v, &mut out)?;
        self.gpu.download_attention(&out)
    }
}
