//! Each layer's backward against central differences, in `f64`, on seeded random inputs;
//! and the re-layout between a projection's rows and the `[batch, heads, tokens, head_dim]`
//! arrays our kernels take.

use flash_core::inputs::SplitMix64;
use ndarray::Axis; // [step 08]
use ndarray::{Array1, Array2, Array4};
use step05_train::layers::{
    cross_entropy, cross_entropy_backward, from_heads, gelu, gelu_grad, join_qkv,
    layernorm, layernorm_backward, linear, linear_backward, softmax_rows, split_qkv,
    to_heads,
};
use step05_train::layers::{repeat_kv, sum_groups}; // [step 08]

const H: f64 = 1e-6;

fn normal2(rows: usize, cols: usize, seed: u64) -> Array2<f64> {
    let mut rng = SplitMix64::new(seed);
    Array2::from_shape_simple_fn((rows, cols), || rng.next_normal())
}

fn normal1(len: usize, seed: u64) -> Array1<f64> {
    let mut rng = SplitMix64::new(seed);
    Array1::from_shape_simple_fn(len, || rng.next_normal())
}

/// Central differences of `f` along every number of `x`.
fn numeric(x: &Array2<f64>, f: impl Fn(&Array2<f64>) -> f64) -> Array2<f64> {
    let mut out = Array2::zeros(x.dim());
    for (idx, o) in out.indexed_iter_mut() {
        let (mut up, mut down) = (x.clone(), x.clone());
        up[idx] += H;
        down[idx] -= H;
        *o = (f(&up) - f(&down)) / (2.0 * H);
    }
    out
}

fn assert_close(what: &str, analytic: &Array2<f64>, numeric: &Array2<f64>) {
    let worst = analytic
        .iter()
        .zip(numeric)
        .map(|(a, n)| (a - n).abs() / (1.0 + n.abs()))
        .fold(0.0, f64::max);
    assert!(
        worst < 1e-7,
        "{what}: worst error {worst:.2e} against central differences"
    );
}

#[test]
fn layernorm_backward_matches_differences() {
    let (rows, d) = (5, 12);
    let x = normal2(rows, d, 1) * 3.0 + 1.0;
    let w = normal1(d, 2);
    let b = normal1(d, 3);
    let dy = normal2(rows, d, 4);
    // the loss Σ dy ∘ y has the gradient dy with respect to y
    let loss = |x: &Array2<f64>, w: &Array1<f64>, b: &Array1<f64>| {
        (&layernorm(x.view(), w.view(), b.view()).out * &dy).sum()
    };
    let norm = layernorm(x.view(), w.view(), b.view());
    let (mut dx, mut dw, mut db) =
        (Array2::zeros((rows, d)), Array1::zeros(d), Array1::zeros(d));
    layernorm_backward(
        dy.view(),
        x.view(),
        w.view(),
        &norm,
        dx.view_mut(),
        dw.view_mut(),
        db.view_mut(),
    );
    assert_close("dx", &dx, &numeric(&x, |x| loss(x, &w, &b)));
    let row = |v: &Array1<f64>| v.clone().insert_axis(ndarray::Axis(0));
    let as_vec = |m: &Array2<f64>| m.row(0).to_owned();
    assert_close(
        "dw",
        &row(&dw),
        &numeric(&row(&w), |w| loss(&x, &as_vec(w), &b)),
    );
    assert_close(
        "db",
        &row(&db),
        &numeric(&row(&b), |b| loss(&x, &w, &as_vec(b))),
    );
    // without gain and bias, each row comes out with mean 0 and variance 1 (less ε)
    let plain = layernorm(x.view(), Array1::ones(d).view(), Array1::zeros(d).view());
    for r in plain.out.rows() {
        assert!(r.mean().unwrap().abs() < 1e-12);
        assert!((r.mapv(|v| v * v).mean().unwrap() - 1.0).abs() < 1e-4);
    }
}

#[test]
fn linear_backward_matches_differences() {
    let (x, w, b) = (normal2(4, 6, 5), normal2(6, 3, 6), normal1(3, 7));
    let dy = normal2(4, 3, 8);
    let loss = |x: &Array2<f64>, w: &Array2<f64>| {
        (&linear(x.view(), w.view(), b.view()) * &dy).sum()
    };
    let (mut dx, mut dw, mut db) = (
        Array2::zeros(x.dim()),
        Array2::zeros(w.dim()),
        Array1::zeros(3),
    );
    linear_backward(
        dy.view(),
        x.view(),
        w.view(),
        &mut dx.view_mut(),
        &mut dw.view_mut(),
        db.view_mut(),
    );
    assert_close("dx", &dx, &numeric(&x, |x| loss(x, &w)));
    assert_close("dw", &dw, &numeric(&w, |w| loss(&x, w)));
    assert_close(
        "db",
        &db.insert_axis(ndarray::Axis(0)),
        &dy.sum_axis(ndarray::Axis(0)).insert_axis(ndarray::Axis(0)),
    );
}

#[test]
fn gelu_grad_matches_differences() {
    for i in -60..=60 {
        let x = i as f64 / 10.0;
        let fd = (gelu(x + H) - gelu(x - H)) / (2.0 * H);
        assert!(
            (gelu_grad(x) - fd).abs() < 1e-8,
            "at {x}: {} against {fd}",
            gelu_grad(x)
        );
    }
    // the tanh form is within 1e-3 of x·Φ(x) (Hendrycks & Gimpel): at 1, Φ(1) = 0.841345
    assert!((gelu(1.0f64) - 0.841_345).abs() < 1e-3);
    assert_eq!(gelu(0.0f64), 0.0);
}

#[test]
fn cross_entropy_backward_matches_differences() {
    let logits = normal2(6, 10, 9) * 2.0;
    let targets = [0u8, 3, 9, 4, 4, 7];
    let loss = |l: &Array2<f64>| {
        let mut p = l.clone();
        softmax_rows(&mut p);
        cross_entropy(p.view(), &targets)
    };
    let mut probs = logits.clone();
    softmax_rows(&mut probs);
    let analytic = cross_entropy_backward(probs.view(), &targets);
    assert_close("dlogits", &analytic, &numeric(&logits, loss));
    // uniform logits over 256 bytes: the loss of knowing nothing, ln 256
    let mut uniform = Array2::<f64>::zeros((2, 256));
    softmax_rows(&mut uniform);
    assert!((cross_entropy(uniform.view(), b"az") - 256f64.ln()).abs() < 1e-12);
}

#[test]
fn heads_relayout_is_the_layout_our_kernels_take() {
    let (batch, tokens, heads, head_dim) = (2, 5, 3, 4);
    let c = heads * head_dim;
    let qkv =
        Array2::from_shape_fn((batch * tokens, 3 * c), |(r, col)| (r * 1000 + col) as f64);
    let [q, k, v] = split_qkv(
        qkv.view(),
        batch,
        heads,
        heads, // [step 08]
    );
    assert_eq!(q.dim(), (batch, heads, tokens, head_dim));
    for ((b, h, t, d), &x) in q.indexed_iter() {
        let row = b * tokens + t;
        assert_eq!(x, qkv[[row, h * head_dim + d]]);
        assert_eq!(k[[b, h, t, d]], qkv[[row, c + h * head_dim + d]]);
        assert_eq!(v[[b, h, t, d]], qkv[[row, 2 * c + h * head_dim + d]]);
    }
    // from_heads undoes to_heads, and join_qkv undoes split_qkv
    assert_eq!(to_heads(from_heads(q.view()).view(), batch, heads), q);
    assert_eq!(join_qkv(q.view(), k.view(), v.view()), qkv);
    // join is split's adjoint, so the backward may use it: <split(x), y> = <x, join(y)>
    let ys: Vec<Array4<f64>> = (0..3)
        .map(|s| {
            let mut rng = SplitMix64::new(20 + s);
            Array4::from_shape_simple_fn(q.dim(), || rng.next_normal())
        })
        .collect();
    let x = normal2(batch * tokens, 3 * c, 30);
    let [a, b, d] = split_qkv(
        x.view(),
        batch,
        heads,
        heads, // [step 08]
    );
    let lhs = (&a * &ys[0]).sum() + (&b * &ys[1]).sum() + (&d * &ys[2]).sum();
    let rhs = (&x * &join_qkv(ys[0].view(), ys[1].view(), ys[2].view())).sum();
    assert!((lhs - rhs).abs() < 1e-9 * lhs.abs().max(1.0));
}
// [step 08]

#[test]
fn grouped_heads_split_narrower_k_and_v_and_repeat_them_for_their_group() {
    // 6 query heads of 4 dimensions, 2 key and value heads: each serves a group of 3
    let (batch, tokens, heads, kv_heads, head_dim) = (2, 5, 6, 2, 4);
    let (c, kv) = (heads * head_dim, kv_heads * head_dim);
    let qkv = Array2::from_shape_fn((batch * tokens, c + 2 * kv), |(r, col)| {
        (r * 1000 + col) as f64
    });
    let [q, k, v] = split_qkv(qkv.view(), batch, heads, kv_heads);
    assert_eq!(q.dim(), (batch, heads, tokens, head_dim));
    assert_eq!(k.dim(), (batch, kv_heads, tokens, head_dim));
    for ((b, h, t, d), &x) in k.indexed_iter() {
        let row = b * tokens + t;
        assert_eq!(x, qkv[[row, c + h * head_dim + d]]);
        assert_eq!(v[[b, h, t, d]], qkv[[row, c + kv + h * head_dim + d]]);
    }
    assert_eq!(join_qkv(q.view(), k.view(), v.view()), qkv);
    // query head h meets key head h / 3
    let groups = heads / kv_heads;
    let repeated = repeat_kv(k.clone(), groups);
    for h in 0..heads {
        assert_eq!(
            repeated.index_axis(Axis(1), h),
            k.index_axis(Axis(1), h / groups)
        );
    }
    // sum_groups is repeat_kv's adjoint, so the backward may use it
    let y = normal2(batch * heads * tokens, head_dim, 40)
        .into_shape_with_order((batch, heads, tokens, head_dim))
        .unwrap();
    let x = normal2(batch * kv_heads * tokens, head_dim, 41)
        .into_shape_with_order((batch, kv_heads, tokens, head_dim))
        .unwrap();
    let sums = sum_groups(y.clone(), groups);
    assert_eq!(sums.dim(), (batch, kv_heads, tokens, head_dim));
    // kv head 1's gradient is the sum of query heads 3, 4 and 5's
    let expect =
        &y.index_axis(Axis(1), 3) + &y.index_axis(Axis(1), 4) + y.index_axis(Axis(1), 5);
    assert_eq!(sums.index_axis(Axis(1), 1), expect);
    let lhs = (&repeat_kv(x.clone(), groups) * &y).sum();
    let rhs = (&x * &sums).sum();
    assert!((lhs - rhs).abs() < 1e-9 * lhs.abs().max(1.0));
}
// [/step 08]
