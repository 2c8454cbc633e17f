//! Where each weight lives in the GPU's flat buffers.
//!
//! The GPU keeps every weight in one `f32` buffer (and its gradient, its two moments and
//! its bf16 copy in four more of the same layout), so that one kernel can take an AdamW
//! step of them all and one reduction can take their norm. The matrices come first, so that
//! weight decay, which applies to them only, is one comparison of the index with
//! [`Layout::decay_end`]. Each tensor starts at a multiple of [`ALIGN`] values, so every
//! product's operand is aligned as cuBLAS's tensor-core paths want it.

use std::collections::HashMap;

use ndarray::ArrayViewD;

use crate::model::{Config, Params};

/// Each tensor's offset is a multiple of this many values (256 bytes of `f32`).
pub const ALIGN: usize = 64;

/// One tensor of the layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Its GPT-2 name, as in [`Params::tensors`].
    pub name: String,
    pub offset: usize,
    pub shape: Vec<usize>,
}

impl Slot {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The offsets of one block's weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSlots {
    pub ln_1_w: usize,
    pub ln_1_b: usize,
    pub attn_w: usize,
    pub attn_b: usize,
    pub proj_w: usize,
    pub proj_b: usize,
    pub ln_2_w: usize,
    pub ln_2_b: usize,
    pub fc_w: usize,
    pub fc_b: usize,
    pub fc_proj_w: usize,
    pub fc_proj_b: usize,
}

/// The flat layout of a model's weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub config: Config,
    /// Every tensor, in the order of [`Params::tensors`].
    pub slots: Vec<Slot>,
    /// Values in each buffer, padding included (padding stays 0: its gradient is 0).
    pub len: usize,
    /// Values below this offset belong to matrices, which AdamW decays.
    pub decay_end: usize,
    pub wte: usize,
    pub wpe: usize,
    pub ln_f_w: usize,
    pub ln_f_b: usize,
    pub blocks: Vec<BlockSlots>,
}

impl Layout {
    pub fn new(config: Config) -> Layout {
        let shapes: Vec<(String, Vec<usize>)> = Params::<f32>::zeros(config)
            .tensors()
            .into_iter()
            .map(|(name, t)| (name, t.shape().to_vec()))
            .collect();
        let mut offsets = HashMap::new();
        let mut next = 0;
        // matrices first, then vectors; each group in the order of Params::tensors
        for matrices in [true, false] {
            for (name, shape) in &shapes {
                if (shape.len() == 2) == matrices {
                    offsets.insert(name.clone(), next);
                    next += shape.iter().product::<usize>().next_multiple_of(ALIGN);
                }
            }
            if matrices {
                // every matrix ends at or before here; vectors start here
                offsets.insert("<decay_end>".into(), next);
            }
        }
        let at = |name: &str| offsets[name];
        let blocks = (0..config.layers)
            .map(|i| {
                let b = |what: &str| at(&format!("h.{i}.{what}"));
                BlockSlots {
                    ln_1_w: b("ln_1.weight"),
                    ln_1_b: b("ln_1.bias"),
                    attn_w: b("attn.c_attn.weight"),
                    attn_b: b("attn.c_attn.bias"),
                    proj_w: b("attn.c_proj.weight"),
                    proj_b: b("attn.c_proj.bias"),
                    ln_2_w: b("ln_2.weight"),
                    ln_2_b: b("ln_2.bias"),
                    fc_w: b("mlp.c_fc.weight"),
                    fc_b: b("mlp.c_fc.bias"),
                    fc_proj_w: b("mlp.c_proj.weight"),
                    fc_proj_b: b("mlp.c_proj.bias"),
                }
            })
            .collect();
        Layout {
            config,
            slots: shapes
                .iter()
                .map(|(name, shape)| Slot {
                    name: name.clone(),
                    offset: at(name),
                    shape: shape.clone(),
                })
                .collect(),
            len: next,
            decay_end: at("<decay_end>"),
            wte: at("wte.weight"),
            wpe: at("wpe.weight"),
            ln_f_w: at("ln_f.weight"),
            ln_f_b: at("ln_f.bias"),
            blocks,
        }
    }

    /// The weights of `p` in this layout.
    pub fn pack(&self, p: &Params<f32>) -> Vec<f32> {
        let mut flat = vec![0.0; self.len];
        for (slot, (_, t)) in self.slots.iter().zip(p.tensors()) {
            copy_into(&mut flat[slot.offset..slot.offset + slot.len()], &t);
        }
        flat
    }

    /// The weights of a buffer in this layout, as a [`Params`].
    pub fn unpack(&self, flat: &[f32]) -> Params<f32> {
        let mut p = Params::<f32>::zeros(self.config);
        for (slot, (_, mut t)) in self.slots.iter().zip(p.tensors_mut()) {
            let src = &flat[slot.offset..slot.offset + slot.len()];
            for (d, s) in t.iter_mut().zip(src) {
                *d = *s;
            }
        }
        p
    }
}

fn copy_into(dst: &mut [f32], t: &ArrayViewD<f32>) {
    for (d, s) in dst.iter_mut().zip(t.iter()) {
        *d = *s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrices_come_first_aligned_and_pack_round_trips() {
        let config = Config {
            layers: 2,
            d_model: 24,
            heads: 2,
            kv_heads: 2, // [step 08]
            context: 10,
            vocab: 256,
        };
        let layout = Layout::new(config);
        for s in &layout.slots {
            assert_eq!(s.offset % ALIGN, 0, "{}", s.name);
            assert_eq!(
                s.shape.len() == 2,
                s.offset < layout.decay_end,
                "{}",
                s.name
            );
        }
        let p = Params::<f32>::init(config, 3).unwrap();
        assert_eq!(layout.unpack(&layout.pack(&p)), p);
        assert_eq!(layout.blocks[1].fc_w, layout.slots[2 + 12 + 8].offset);
    }
}
