//! The GPU runtime every step's kernels run on: NVRTC compilation with one set of options
//! ([`compile`], for any [`KernelSpec`]).

mod compile;

pub use compile::{
    FixedKernel, KernelSpec, OPTIONS, compile, missing_nvrtc, nvrtc_present, require_nvrtc,
};
