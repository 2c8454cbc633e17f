//! The exercise checker can tell right from wrong: it accepts the kernel's lookup (the
//! solution), which must be `decode.cu`'s, and refuses the template as shipped (a
//! `todo!()`), a lookup that ignores the table, one that forgets the kv heads, and one that
//! answers past a sequence's end. None of them reads `exercises/`, so these keep passing
//! once a reader has filled the template in.

use step08_inference::exercise::{Pool, Table, cases, check, key_offset, table_of};

const DECODE_CU: &str = include_str!("../kernels/decode.cu");

#[test]
fn the_checker_accepts_the_solution() {
    assert_eq!(check(&key_offset), Ok(cases().len()));
}

#[test]
fn the_solution_is_the_kernels_lookup() {
    for line in [
        "const long long page = table[(long long)b * max_pages + kv / PAGE_SIZE];",
        "return base + ((page * KVH + kvh) * PAGE_SIZE + kv % PAGE_SIZE) * HEAD_DIM;",
    ] {
        assert!(
            DECODE_CU.contains(line),
            "decode.cu's key_rows no longer has {line}"
        );
    }
}

#[test]
fn the_figures_table_is_the_figures() {
    let (entries, max_pages) = table_of(&cases()[1]);
    assert_eq!(max_pages, 4);
    assert_eq!(entries, [3, 0, 5, -1, 6, 1, -1, -1]);
}

#[test]
fn the_checker_refuses_the_template() {
    let e = check(
        &|_: &Pool, _: &Table, _: usize, _: usize, _: usize| -> Option<usize> { todo!() },
    )
    .unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_checker_refuses_a_lookup_without_the_table() {
    // right while pages are handed out in the pool's order, to one sequence
    let e = check(
        &|pool: &Pool, table: &Table, _: usize, kvh: usize, t: usize| {
            (t < table.lens[0]).then(|| {
                ((t / pool.page_size * pool.kv_heads + kvh) * pool.page_size
                    + t % pool.page_size)
                    * pool.head_dim
            })
        },
    )
    .unwrap_err();
    assert!(e.case.starts_with("the chapter's figure"), "{e}");
    assert!(e.why.contains("which the table puts in page 3"), "{e}");
}

#[test]
fn the_checker_refuses_a_lookup_without_the_kv_heads() {
    let e = check(
        &|pool: &Pool, table: &Table, b: usize, _: usize, t: usize| {
            let one_head = Pool {
                kv_heads: 1,
                ..*pool
            };
            key_offset(&one_head, table, b, 0, t)
        },
    )
    .unwrap_err();
    assert!(e.case.starts_with("8 kv heads"), "{e}");
}

#[test]
fn the_checker_refuses_an_answer_past_the_end() {
    let e = check(
        &|pool: &Pool, table: &Table, b: usize, kvh: usize, t: usize| {
            let all = vec![usize::MAX; table.lens.len()];
            let unbounded = Table {
                lens: &all,
                ..*table
            };
            let page = table.entries[b * table.max_pages + t / pool.page_size];
            (page >= 0)
                .then(|| key_offset(pool, &unbounded, b, kvh, t))
                .flatten()
        },
    )
    .unwrap_err();
    assert!(e.why.contains("None past its end"), "{e}");
}

// The cache's exercise: the checker accepts the solution and refuses the template, a prompt
// read without its last byte, and an empty prompt that gives an empty cache rather than an
// error.

use ndarray::Array1;
use step05_train::{Params, TrainError};
use step08_inference::exercise::{check_prefill, prefill_by_steps, prefill_cases};
use step08_inference::generate::{ModelCache, step};

#[test]
fn the_prefill_checker_accepts_the_solution() {
    assert_eq!(
        check_prefill(&prefill_by_steps),
        Ok(prefill_cases().len() + 1)
    );
}

#[test]
fn the_prefill_checker_refuses_the_template() {
    let e = check_prefill(&|_: &Params<f32>,
                            _: &[u8]|
     -> Result<(ModelCache, Array1<f32>), TrainError> {
        todo!()
    })
    .unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_prefill_checker_refuses_a_prompt_without_its_last_byte() {
    let e = check_prefill(&|p: &Params<f32>, prompt: &[u8]| {
        let mut cache = ModelCache::new(p.config);
        let mut logits = Array1::zeros(p.config.vocab);
        for &t in &prompt[..prompt.len().saturating_sub(1)] {
            logits = step(p, &mut cache, t)?;
        }
        Ok((cache, logits))
    })
    .unwrap_err();
    assert!(e.why.contains("the cache holds 0 tokens"), "{e}");
}

#[test]
fn the_prefill_checker_refuses_an_empty_cache_for_an_empty_prompt() {
    let e = check_prefill(&|p: &Params<f32>, prompt: &[u8]| {
        if prompt.is_empty() {
            return Ok((ModelCache::new(p.config), Array1::zeros(p.config.vocab)));
        }
        prefill_by_steps(p, prompt)
    })
    .unwrap_err();
    assert_eq!(e.case, "an empty prompt", "{e}");
}

// Chapter 8.2's exercise: the checker accepts step 05's sum and refuses the template, the
// per-query-head gradient left unsummed and groups taken as every kv_heads-th head.

use ndarray::{Array4, ArrayView4, Axis};
use step08_inference::exercise::{GROUP_CASES, check_sum_groups};

#[test]
fn the_group_checker_accepts_the_solution() {
    let solution = |dk: ArrayView4<f32>, kv_heads: usize| {
        step05_train::layers::sum_groups(dk.to_owned(), dk.dim().1 / kv_heads)
    };
    assert_eq!(check_sum_groups(&solution), Ok(GROUP_CASES.len()));
}

#[test]
fn the_group_checker_refuses_the_template() {
    let e = check_sum_groups(&|_: ArrayView4<f32>, _: usize| -> Array4<f32> { todo!() })
        .unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_group_checker_refuses_an_unsummed_gradient() {
    let e = check_sum_groups(&|dk: ArrayView4<f32>, _: usize| dk.to_owned()).unwrap_err();
    assert!(e.why.contains("one gradient for each kv head"), "{e}");
}

#[test]
fn the_group_checker_refuses_interleaved_groups() {
    let interleaved = |dk: ArrayView4<f32>, kv_heads: usize| {
        let (b, _, t, d) = dk.dim();
        let mut out = Array4::zeros((b, kv_heads, t, d));
        for (h, head) in dk.axis_iter(Axis(1)).enumerate() {
            let mut sum = out.index_axis_mut(Axis(1), h % kv_heads);
            sum += &head;
        }
        out
    };
    let e = check_sum_groups(&interleaved).unwrap_err();
    assert!(e.case.starts_with("4 query heads on 2"), "{e}");
    assert!(e.why.contains("h / g"), "{e}");
}
