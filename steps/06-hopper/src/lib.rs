//! # Step 06: Hopper's own instructions
//!
//! Warpgroup products (`wgmma`) read their operands from shared memory through 64-bit matrix
//! descriptors, in the swizzled layout the tensor memory accelerator writes. [`probe`] runs
//! the two products of attention once, on one 64×64 tile, to pin down the descriptors'
//! encoding on the GPU at hand before the kernels rely on it. [`forward`] is the forward
//! kernel, [`backward`] step 04's two backward passes with the same products.

pub mod backward;
pub mod forward;
pub mod layout;
pub mod methods;
pub mod probe;

pub use methods::methods;
