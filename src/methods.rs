//! Every attention method the repository has, behind one shape of function, so one test table
//! and one benchmark can run them all.

use std::fmt;

use ndarray::ArrayView4;
use step01_naive::{Attention, AttnError, Shape};

/// Where a method runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

impl Device {
    /// The name the benchmark's `--device` takes and the JSON rows carry as `device_kind`.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// One forward method: `f32` inputs `[batch, heads, tokens, head_dim]` in, output and
/// log-sum-exp out.
pub type ForwardFn =
    fn(ArrayView4<f32>, ArrayView4<f32>, ArrayView4<f32>) -> Result<Attention, AttnError>;

/// One backward method: the inputs, the forward's result (its log-sum-exp is what lets the
/// backward rebuild the probabilities without a stored table) and the output gradient `dout`
/// in; the gradients of q, k and v out, as [`Grads`]. Both are step 04's, the step that
/// introduces the backward pass.
pub use step04_backward::{BackwardFn, Grads};

/// The element type a run computes in. CPU methods take `f32`; GPU methods say which they take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    /// The name the benchmark's `--dtype` takes and the JSON rows carry.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    pub fn parse(s: &str) -> Result<Dtype, String> {
        match s {
            "f32" => Ok(Dtype::F32),
            "bf16" => Ok(Dtype::Bf16),
            "f16" => Ok(Dtype::F16),
            _ => Err(format!("unknown dtype {s:?}; accepted: f32, bf16, f16")),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the benchmark asks a GPU method to prepare: one shape, one dtype, one pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRunSpec {
    pub shape: Shape,
    pub dtype: Dtype,
    /// Forward and backward (`fwd+bwd`) rather than the forward alone.
    pub backward: bool,
    /// Seed of the random inputs (and of `dout`).
    pub seed: u64,
}

/// A GPU method with its inputs already on the device, ready to be timed.
///
/// Preparing (compiling kernels, allocating and copying the inputs) happens once, before any
/// timing; each call below then covers the attention alone.
pub trait DeviceRun {
    /// Runs the pass once and returns its time in milliseconds, measured by events recorded on
    /// the stream just before and just after the pass's kernels.
    fn time_ms(&mut self) -> Result<f64, AttnError>;
    /// Runs the pass once and returns the device memory it allocated at its high-water mark,
    /// above what was allocated before it (the inputs): the stream-ordered pool's
    /// `USED_MEM_HIGH` (reset, run, read), or an exact count of the method's allocations.
    fn peak_bytes(&mut self) -> Result<u64, AttnError>;
}

/// How the benchmark drives a GPU method.
#[derive(Clone, Copy, Debug)]
pub struct DeviceHooks {
    /// One line about the device: name, compute capability, driver and NVRTC versions;
    /// `AttnError::Device` when there is no usable device.
    pub describe: fn() -> Result<String, AttnError>,
    /// Makes random inputs of the spec on the device and returns the run that times one pass.
    pub prepare: fn(&DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError>,
}

/// A method and what a reader needs to know to pick it.
#[derive(Clone, Copy, Debug)]
pub struct Method {
    /// The name the benchmark's `--methods` takes.
    pub name: &'static str,
    /// The step that introduces it.
    pub step: &'static str,
    pub device: Device,
    /// One line: what it does and what it keeps in memory.
    pub about: &'static str,
    /// The forward pass on host arrays (a GPU method copies in and out): what the tests and
    /// the `attend` command call.
    pub forward: ForwardFn,
    /// The backward pass, for methods that have one.
    pub backward: Option<BackwardFn>,
    /// What runs on this machine, when that is decided at run time: the SIMD path, the thread
    /// count, the kernel and its tiles. The benchmark prints it next to `about`.
    pub implementation: Option<fn() -> String>,
    /// For GPU methods: how the benchmark prepares one on the device and times it there.
    pub gpu: Option<DeviceHooks>,
}

impl Method {
    /// A forward-only method; add the rest with the `with_*` functions below.
    pub const fn new(
        name: &'static str,
        step: &'static str,
        device: Device,
        about: &'static str,
        forward: ForwardFn,
    ) -> Method {
        Method {
            name,
            step,
            device,
            about,
            forward,
            backward: None,
            implementation: None,
            gpu: None,
        }
    }

    pub const fn with_backward(mut self, backward: BackwardFn) -> Method {
        self.backward = Some(backward);
        self
    }

    pub const fn with_implementation(mut self, implementation: fn() -> String) -> Method {
        self.implementation = Some(implementation);
        self
    }

    pub const fn with_gpu(mut self, gpu: DeviceHooks) -> Method {
        self.gpu = Some(gpu);
        self
    }

    /// What runs here: the method's own report if it has one, else its one-line description.
    pub fn implementation(&self) -> String {
        match self.implementation {
            Some(report) => report(),
            None => self.about.to_string(),
        }
    }
}

/// Every method, in the order of the steps.
pub fn all() -> Vec<Method> {
    vec![
        Method::new(
            "naive",
            "01-naive",
            Device::Cpu,
            "attention by hand: the whole [b, h, T, T] table of scores, single-threaded",
            step01_naive::attention,
        )
        // the backward by hand: the tables P and dP, [b, h, T, T] each
        .with_backward(step04_backward::backward_by_hand),
        Method::new(
            "online_loop",
            "02-online-softmax",
            Device::Cpu,
            "the online softmax as plain loops, blocks of 64: a running max, sum and output per row, no T×T table; single-threaded",
            step02_online_softmax::attention_loop,
        ),
        Method::new(
            "online",
            "02-online-softmax",
            Device::Cpu,
            "the online softmax, parallel over (sequence, head, query block), AVX-512/AVX2 micro-kernels, 2^x by polynomial; no T×T table",
            step02_online_softmax::attention,
        )
        // the blockwise backward: P rebuilt from the log-sum-exp a block at a time
        .with_backward(step04_backward::backward),
        Method::new(
            "cuda_naive",
            "03-cuda-forward",
            Device::Cuda,
            "attention by hand on the GPU: cuBLAS products and a softmax kernel through the whole [b·h, T, T] table in device memory",
            crate::cuda::naive_forward,
        )
        .with_gpu(crate::cuda::NAIVE_HOOKS),
        Method::new(
            "cuda_flash",
            "03-cuda-forward",
            Device::Cuda,
            "the FlashAttention forward kernel: tensor cores (mma.sync), keys and values streamed through shared memory, no T×T table",
            crate::cuda::flash_forward,
        )
        // the backward kernels of step 04: δ, dK and dV per key block, dQ per query block
        .with_backward(crate::cuda::flash_backward)
        .with_implementation(crate::cuda::flash_implementation)
        .with_gpu(crate::cuda::FLASH_HOOKS),
    ]
}

/// The method with this name, or an error listing the names there are.
pub fn by_name(name: &str) -> Result<Method, String> {
    all().into_iter().find(|m| m.name == name).ok_or_else(|| {
        let names: Vec<_> = all().iter().map(|m| m.name).collect();
        format!(
            "no method named {name:?}; the methods are: {}",
            names.join(", ")
        )
    })
}
