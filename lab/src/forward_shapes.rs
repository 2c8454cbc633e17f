//! The tile shapes `forward-tune` times against step 03's default, one head dim at a time.
//! Each is a [`ForwardConfig`], the sizes step 03's kernel takes as `-D` options: warps,
//! rows a warp, keys a block and a step, blocks a multiprocessor, and the heads scheduled
//! together. Whether a lane holds one ldmatrix offset a step or one an operand is the head
//! dim's (one an operand at 128: `Offsets<HEAD_DIM == 128>` in `flash_forward.cu`), not a
//! shape's.

use step03_cuda_forward::ForwardConfig;

/// The default for a head dim, then the shapes compared with it (what each measured is in
/// `lab/logs/03-cuda-forward/`; the variants that lost and left the kernel, in
/// `lab/notes/03-cuda-forward.md`).
pub fn candidates(head_dim: usize) -> Vec<ForwardConfig> {
    let base = ForwardConfig::for_head_dim(head_dim);
    let with = |f: fn(&mut ForwardConfig)| {
        let mut c = base;
        f(&mut c);
        c
    };
    if head_dim <= 64 {
        vec![
            base,
            // one head at a time, or 16 together, rather than all heads' longest blocks
            // first
            with(|c| c.head_group = 1),
            with(|c| c.head_group = 16),
            // 64 keys a block
            with(|c| c.block_n = 64),
            // 8 warps of 32 rows: 256 queries a block
            with(|c| c.warps = 8),
        ]
    } else {
        vec![
            base,
            // 8 warps of 16 rows, the shape before run 14, with 64 or 128 keys at once
            with(|c| (c.warps, c.m_tiles, c.sub_n) = (8, 1, 0)),
            with(|c| (c.warps, c.m_tiles, c.block_n, c.sub_n) = (8, 1, 128, 0)),
            // 32 keys a block; 64 in steps of 16; all 64 at once (FlashAttention-2's loop,
            // which spills)
            with(|c| (c.block_n, c.sub_n) = (32, 0)),
            with(|c| c.sub_n = 16),
            with(|c| c.sub_n = 0),
            // 64 x 64 tiles, two blocks a multiprocessor (FlashAttention-2's causal tile on
            // sm86 and sm89)
            with(|c| (c.m_tiles, c.sub_n, c.min_blocks) = (1, 0, 2)),
            // at head dim 128 a head's keys and values are 8 MB at 16k tokens: fewer heads
            // scheduled together keep fewer of them in flight, for L2's 60 MB
            with(|c| c.head_group = 2),
            with(|c| c.head_group = 4),
            with(|c| c.head_group = 8),
            with(|c| c.head_group = 12),
            with(|c| (c.sub_n, c.head_group) = (0, 2)),
            with(|c| (c.sub_n, c.head_group) = (0, 8)),
            with(|c| (c.sub_n, c.head_group) = (0, 12)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use step03_cuda_forward::kernel::HEAD_DIMS;

    /// The default comes first (the tools' first column), every shape is one the kernel
    /// takes, and no two share a label (the tools' `--only` picks them by it).
    #[test]
    fn the_default_first_every_shape_valid_no_label_twice() {
        for d in HEAD_DIMS {
            let all = candidates(d);
            assert_eq!(all[0], ForwardConfig::for_head_dim(d));
            let mut labels: Vec<String> = all.iter().map(ForwardConfig::label).collect();
            for c in &all {
                c.check().unwrap();
            }
            labels.sort();
            labels.dedup();
            assert_eq!(
                labels.len(),
                all.len(),
                "head dim {d}: two shapes share a label"
            );
        }
    }
}
