//! Step 08's methods for the registry: decoders, query rows against a cache. They take
//! inputs the other methods do not, `q` `[batch, q_heads, q_rows, head_dim]` against `k`
//! and `v` `[batch, kv_heads, context, head_dim]` (the causal diagonal at the cache's end,
//! `q_heads` a multiple of `kv_heads`), so they are a trait of their own beside the
//! forward methods of [`flash_core::method::Method`], described the same way
//! ([`Describe`]): a name resolves to either, and `attend` runs either.

use flash_core::method::{Describe, Descriptor, Device, Dtype, check_f32};
use flash_core::{Attention, AttnError};
use ndarray::ArrayView4;
use step03_cuda_forward::gpu::Gpu;

use crate::cuda::CacheLayout;
use crate::pages::PAGE_SIZE;

/// The chunk of keys [`DecodeSplit`] merges: a split of the GPU kernel at batch 1 and 128k
/// tokens (16 splits of 8,192).
pub const SPLIT_CHUNK: usize = 8192;

/// The step the decoders' descriptors name.
const STEP: &str = "08-inference";

// ANCHOR: decoder
/// A decoding method: what the help says about it ([`Describe`], as for every method), and
/// the attention of `q`'s rows against the cache `k`, `v`, computed in `dtype`.
pub trait Decoder: Describe + Send + Sync {
    /// Each query row's output and log-sum-exp.
    fn decode(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError>;
}
// ANCHOR_END: decoder

/// [`crate::decode()`]: step 02's loop, a query row at a time.
pub struct Decode;
/// [`crate::decode_split`]: the keys in chunks of [`SPLIT_CHUNK`], merged through their
/// log-sum-exps.
pub struct DecodeSplit;
/// [`crate::cuda::decode`] on a cache laid out as `layout`, the split
/// [`plan_splits`](crate::cuda::plan_splits) chooses.
pub struct FlashDecode {
    descriptor: Descriptor,
    pub layout: CacheLayout,
}

/// The decoding kernel on a contiguous cache.
pub static FLASH_DECODE: FlashDecode = FlashDecode {
    descriptor: Descriptor::new(
        "flash_decode",
        STEP,
        Device::Cuda,
        "flash-decoding: the keys split over thread blocks, merged by the last to finish",
    ),
    layout: CacheLayout::Contiguous,
};

/// The decoding kernel on a cache in pages of [`PAGE_SIZE`] tokens.
pub static FLASH_DECODE_PAGED: FlashDecode = FlashDecode {
    descriptor: Descriptor::new(
        "flash_decode_paged",
        STEP,
        Device::Cuda,
        "flash_decode on a cache in pages of 64 tokens (PAGE_SIZE), read through a page table",
    ),
    layout: CacheLayout::Paged {
        page_size: PAGE_SIZE,
    },
};

impl Describe for Decode {
    fn descriptor(&self) -> Descriptor {
        Descriptor::new(
            "decode",
            STEP,
            Device::Cpu,
            "query rows against a cache, step 02's loop a row; grouped-query heads",
        )
    }
}

impl Decoder for Decode {
    fn decode(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        check_f32(dtype)?;
        crate::decode(q, k, v)
    }
}

impl Describe for DecodeSplit {
    fn descriptor(&self) -> Descriptor {
        Descriptor::new(
            "decode_split",
            STEP,
            Device::Cpu,
            "decode with the keys in chunks of 8,192, merged through their log-sum-exps",
        )
    }
}

impl Decoder for DecodeSplit {
    fn decode(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        check_f32(dtype)?;
        crate::decode_split(q, k, v, SPLIT_CHUNK)
    }
}

impl Describe for FlashDecode {
    fn descriptor(&self) -> Descriptor {
        self.descriptor
    }
}

impl Decoder for FlashDecode {
    fn decode(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        let gpu = Gpu::shared()?;
        crate::cuda::decode(gpu, q, k, v, dtype, self.layout)
    }
}

/// Step 08's decoders, CPU first.
pub fn decoders() -> Vec<&'static dyn Decoder> {
    vec![&Decode, &DecodeSplit, &FLASH_DECODE, &FLASH_DECODE_PAGED]
}
