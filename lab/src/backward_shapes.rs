//! The tile shapes `backward-tune` times against step 04's default, one head dim at a time,
//! each one change of the default (or of the shape before it at head dim 128). Each is a
//! [`BackwardConfig`], the sizes step 04's kernels take as `-D` options.

use step04_backward::cuda::BackwardConfig;

/// The default for a head dim, then the shapes compared with it (what each measured is in
/// `lab/logs/04-backward/`; the variants that lost and left the kernels, in
/// `lab/notes/04-backward.md`).
pub fn candidates(head_dim: usize) -> Vec<BackwardConfig> {
    let base = BackwardConfig::for_head_dim(head_dim);
    if head_dim <= 64 {
        vec![
            base,
            BackwardConfig {
                dkdv_stream: 64,
                ..base
            },
            BackwardConfig {
                dq_stream: 128,
                ..base
            },
            // wider steps: more scores in registers at once (both spill)
            BackwardConfig {
                dkdv_sub: 32,
                ..base
            },
            BackwardConfig { dq_sub: 64, ..base },
        ]
    } else {
        // the shapes measured beside 64 queries a stage for dK/dV, the default before run 6
        let old = BackwardConfig {
            dkdv_stream: 64,
            ..base
        };
        vec![
            base,
            old,
            BackwardConfig {
                dq_stream: 128,
                ..old
            },
            BackwardConfig { dq_sub: 16, ..old },
            BackwardConfig { dq_sub: 64, ..old },
            // 64-row blocks of four warps, two blocks a multiprocessor
            BackwardConfig {
                warps: 4,
                dkdv_min_blocks: 2,
                dq_min_blocks: 2,
                ..old
            },
            BackwardConfig {
                warps: 4,
                dkdv_min_blocks: 2,
                dq_min_blocks: 2,
                ..base
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use step04_backward::cuda::HEAD_DIMS;

    /// The default comes first (the tool's first column), every shape is one the kernels
    /// take, and no two share a label.
    #[test]
    fn the_default_first_every_shape_valid_no_label_twice() {
        for d in HEAD_DIMS {
            let all = candidates(d);
            assert_eq!(all[0], BackwardConfig::for_head_dim(d));
            for c in &all {
                c.check().unwrap();
            }
            let mut labels: Vec<String> = all.iter().map(BackwardConfig::label).collect();
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
