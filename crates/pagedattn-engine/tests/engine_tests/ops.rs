//! The engine's CPU ops against f64 references written here, on random inputs with fresh
//! seeds (printed; rerun one with `OPS_SEED=<seed>`).

// References index several arrays with one counter, as the formulas read.
#![allow(clippy::needless_range_loop)]

use half::{bf16, f16};
use pagedattn_engine::models::ops::{
    dequantize_row, rms_norm, swiglu, Embedding, Isa, Linear, OpsError, Precision, Rope, RopeStyle,
    GEMM_MIN_ROWS,
};
use pagedattn_engine::models::weights::WeightType;
use pagedattn_engine::serving::sample::{argmax, log_softmax, Sampler, SamplingParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ALL_TYPES: [WeightType; 6] = [
    WeightType::F32,
    WeightType::F16,
    WeightType::BF16,
    WeightType::Q4_0,
    WeightType::Q4_1,
    WeightType::Q8_0,
];

fn rng(test: &str) -> StdRng {
    let seed = std::env::var("OPS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

fn randn(r: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (r.random::<f32>() * 2.0 - 1.0) * scale)
        .collect()
}

fn f16b(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random bytes of `rows` rows of `cols` elements of `ty`.
fn random_bytes(r: &mut StdRng, ty: WeightType, rows: usize, cols: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(ty.row_bytes(cols).unwrap() * rows);
    let n = rows * cols;
    match ty {
        WeightType::F32 => (0..n).for_each(|_| b.extend((r.random::<f32>() - 0.5).to_le_bytes())),
        WeightType::F16 => (0..n).for_each(|_| b.extend(f16b(r.random::<f32>() - 0.5))),
        WeightType::BF16 => (0..n).for_each(|_| {
            b.extend(
                bf16::from_f32(r.random::<f32>() - 0.5)
                    .to_bits()
                    .to_le_bytes(),
            )
        }),
        WeightType::Q4_0 | WeightType::Q4_1 | WeightType::Q8_0 => {
            for _ in 0..n / 32 {
                b.extend(f16b((r.random::<f32>() - 0.5) * 0.1));
                match ty {
                    WeightType::Q4_0 => (0..16).for_each(|_| b.push(r.random())),
                    WeightType::Q4_1 => {
                        b.extend(f16b((r.random::<f32>() - 0.5) * 0.5));
                        (0..16).for_each(|_| b.push(r.random()));
                    }
                    // Every byte value, -128 included.
                    _ => (0..32).for_each(|_| b.push(r.random())),
                }
            }
        }
    }
    b
}

/// The f64 reference dequantization (GGUF's definitions), per row.
fn ref_dequant(ty: WeightType, b: &[u8], cols: usize) -> Vec<f64> {
    let h = |i: usize| f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f64();
    let mut out = vec![0f64; cols];
    match ty {
        WeightType::F32 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()) as f64;
            }
        }
        WeightType::F16 => out.iter_mut().enumerate().for_each(|(i, o)| *o = h(2 * i)),
        WeightType::BF16 => out.iter_mut().enumerate().for_each(|(i, o)| {
            *o = bf16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f64()
        }),
        _ => {
            let bb = ty.block_bytes();
            for blk in 0..cols / 32 {
                let o = blk * bb;
                for e in 0..32 {
                    let nib = |base: usize| {
                        let byte = b[o + base + e % 16];
                        (if e < 16 { byte & 15 } else { byte >> 4 }) as f64
                    };
                    out[blk * 32 + e] = match ty {
                        WeightType::Q4_0 => h(o) * (nib(2) - 8.0),
                        WeightType::Q4_1 => h(o) * nib(4) + h(o + 2),
                        _ => h(o) * (b[o + 2 + e] as i8) as f64,
                    };
                }
            }
        }
    }
    out
}

fn ref_matrix(ty: WeightType, bytes: &[u8], rows: usize, cols: usize) -> Vec<Vec<f64>> {
    let rb = ty.row_bytes(cols).unwrap();
    (0..rows)
        .map(|r| ref_dequant(ty, &bytes[r * rb..(r + 1) * rb], cols))
        .collect()
}

/// Known bytes → known values, by hand.
#[test]
fn dequantize_known_blocks() {
    // Q4_0: d = 0.5, byte j = j | (15 - j) << 4 → element j = (j - 8) / 2, j + 16 = (7 - j) / 2.
    let mut b = vec![0x00, 0x38];
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut out = [0f32; 32];
    dequantize_row(WeightType::Q4_0, &b, &mut out).unwrap();
    for j in 0..16 {
        assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
        assert_eq!(out[j + 16], (7.0 - j as f32) * 0.5);
    }
    // Q4_1: d = 0.25, m = -1 → q / 4 - 1.
    let mut b = vec![0x00, 0x34, 0x00, 0xBC];
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    dequantize_row(WeightType::Q4_1, &b, &mut out).unwrap();
    for j in 0..16 {
        assert_eq!(out[j], j as f32 * 0.25 - 1.0);
        assert_eq!(out[j + 16], (15 - j) as f32 * 0.25 - 1.0);
    }
    // Q8_0: d = 2, q = j - 16.
    let mut b = vec![0x00, 0x40];
    b.extend((0..32i32).map(|j| (j - 16) as i8 as u8));
    dequantize_row(WeightType::Q8_0, &b, &mut out).unwrap();
    for (j, &v) in out.iter().enumerate() {
        assert_eq!(v, (j as f32 - 16.0) * 2.0);
    }
    let mut two = [0f32; 2];
    dequantize_row(WeightType::F16, &[0x00, 0x3C, 0x00, 0xC0], &mut two).unwrap();
    assert_eq!(two, [1.0, -2.0]);
    dequantize_row(WeightType::BF16, &[0x80, 0x3F, 0x40, 0xC0], &mut two).unwrap();
    assert_eq!(two, [1.0, -3.0]);
    dequantize_row(
        WeightType::F32,
        &[0, 0, 0x80, 0x3F, 0, 0, 0, 0xC0],
        &mut two,
    )
    .unwrap();
    assert_eq!(two, [1.0, -2.0]);
}

/// f64 reference product and Σ|w x| per output.
fn ref_product(w: &[Vec<f64>], x: &[f32], k: usize) -> (Vec<f64>, Vec<f64>) {
    let t = x.len() / k;
    let mut y = Vec::new();
    let mut mag = Vec::new();
    for c in 0..t {
        for row in w {
            let xs = &x[c * k..(c + 1) * k];
            y.push(row.iter().zip(xs).map(|(a, &b)| a * b as f64).sum());
            mag.push(row.iter().zip(xs).map(|(a, &b)| (a * b as f64).abs()).sum());
        }
    }
    (y, mag)
}

fn shapes(ty: WeightType) -> Vec<(usize, usize, usize)> {
    let mut s = vec![
        (1, 1, 32),
        (1, 33, 64),
        (3, 7, 96),
        (17, 50, 160),
        (GEMM_MIN_ROWS, 40, 64),
        (41, 19, 576),
    ];
    if ty.block_len() == 1 {
        s.extend([(3, 5, 5), (17, 9, 37), (20, 3, 1)]);
    }
    s
}

#[test]
fn linear_exact_every_type() {
    let mut r = rng("linear_exact_every_type");
    for ty in ALL_TYPES {
        for (t, out, k) in shapes(ty) {
            let bytes = random_bytes(&mut r, ty, out, k);
            let w = ref_matrix(ty, &bytes, out, k);
            let x = randn(&mut r, t * k, 2.0);
            let (want, mag) = ref_product(&w, &x, k);
            let lin = Linear::from_gguf(&bytes, ty, out, k, Precision::Exact).unwrap();
            for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
                let mut y = vec![f32::NAN; t * out];
                lin.forward_isa(isa, &x, &mut y).unwrap();
                for i in 0..y.len() {
                    let bound = 1e-6 * k as f64 * mag[i] + 1e-30;
                    assert!(
                        (y[i] as f64 - want[i]).abs() <= bound,
                        "{ty:?} {isa} t={t} out={out} in={k} [{i}]: {} vs {} (bound {bound})",
                        y[i],
                        want[i]
                    );
                }
            }
        }
    }
}

/// The fast path's error bound: activation quantization moves each element of block `b` by at
/// most `max|x_b| / 254` (half a step of `max|x_b| / 127`), so the product moves by at most
/// `Σ_b max|x_b| / 254 · Σ_{j∈b} |w_j|`; plus f32 rounding of scales and sums (relative
/// 1e-5 of `Σ |x| (|w| + |d q| + |m|)`, which covers Q4_1's rounded `d q + m` on the exact
/// side too).
fn fast_bound(ty: WeightType, bytes: &[u8], w: &[f64], x: &[f32], row: usize, k: usize) -> f64 {
    let rb = ty.row_bytes(k).unwrap();
    let b = &bytes[row * rb..(row + 1) * rb];
    let mut q = 0.0;
    let mut slack = 0.0;
    for blk in 0..k / 32 {
        let xs = &x[blk * 32..(blk + 1) * 32];
        let amax = xs.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
        let (d, m) = {
            let o = blk * ty.block_bytes();
            let h = |i: usize| f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f64();
            (
                h(o).abs(),
                if ty == WeightType::Q4_1 {
                    h(o + 2).abs()
                } else {
                    0.0
                },
            )
        };
        for j in 0..32 {
            let wj = w[blk * 32 + j].abs();
            q += wj * amax / 254.0;
            slack += xs[j].abs() as f64 * (wj + 255.0 * d + m);
        }
    }
    q * (1.0 + 1e-5) + 1e-5 * slack
}

#[test]
fn linear_fast_within_bound_and_isas_bit_identical() {
    let mut r = rng("linear_fast_within_bound_and_isas_bit_identical");
    let isas: Vec<Isa> = Isa::ALL.into_iter().filter(|i| i.is_available()).collect();
    println!("instruction sets: {isas:?}");
    for ty in ALL_TYPES {
        for (t, out, k) in shapes(ty) {
            let bytes = random_bytes(&mut r, ty, out, k);
            let w = ref_matrix(ty, &bytes, out, k);
            let x = randn(&mut r, t * k, 3.0);
            let exact = Linear::from_gguf(&bytes, ty, out, k, Precision::Exact).unwrap();
            let fast = Linear::from_gguf(&bytes, ty, out, k, Precision::Fast).unwrap();
            assert_eq!(fast.is_quantized(), ty.block_len() == 32);
            let mut ye = vec![0f32; t * out];
            exact.forward_isa(Isa::Scalar, &x, &mut ye).unwrap();
            let mut ys = vec![0f32; t * out];
            fast.forward_isa(Isa::Scalar, &x, &mut ys).unwrap();
            for c in 0..t {
                for o in 0..out {
                    let i = c * out + o;
                    let bound = if fast.is_quantized() {
                        fast_bound(ty, &bytes, &w[o], &x[c * k..(c + 1) * k], o, k)
                    } else {
                        0.0
                    };
                    assert!(
                        (ys[i] - ye[i]).abs() as f64 <= bound,
                        "{ty:?} t={t} out={out} in={k} [{c},{o}]: fast {} exact {} bound {bound}",
                        ys[i],
                        ye[i]
                    );
                }
            }
            if fast.is_quantized() {
                for &isa in &isas {
                    let mut y = vec![f32::NAN; t * out];
                    fast.forward_isa(isa, &x, &mut y).unwrap();
                    assert!(
                        y.iter().zip(&ys).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty:?} {isa} t={t} out={out} in={k}: not bit-identical to scalar"
                    );
                }
            }
        }
    }
}

/// Larger batches through the parallel split (groups × activation-row tiles).
#[test]
fn linear_fast_parallel_split() {
    let mut r = rng("linear_fast_parallel_split");
    for (ty, t, out, k) in [
        (WeightType::Q4_1, 130, 192, 576),
        (WeightType::Q8_0, 9, 1000, 256),
        (WeightType::Q4_0, 64, 48, 1536),
    ] {
        let bytes = random_bytes(&mut r, ty, out, k);
        let x = randn(&mut r, t * k, 1.0);
        let fast = Linear::from_gguf(&bytes, ty, out, k, Precision::Fast).unwrap();
        let mut y = vec![0f32; t * out];
        fast.forward(&x, &mut y).unwrap();
        let mut ys = vec![0f32; t * out];
        fast.forward_isa(Isa::Scalar, &x, &mut ys).unwrap();
        assert!(y.iter().zip(&ys).all(|(a, b)| a.to_bits() == b.to_bits()));
        // Row c of a batch equals the same row alone.
        for c in [0, t / 2, t - 1] {
            let mut one = vec![0f32; out];
            fast.forward(&x[c * k..(c + 1) * k], &mut one).unwrap();
            assert_eq!(&one[..], &y[c * out..(c + 1) * out]);
        }
    }
}

#[test]
fn linear_bad_sizes() {
    let b = vec![0u8; 20 * 4];
    assert!(matches!(
        Linear::from_gguf(&b, WeightType::Q4_1, 4, 33, Precision::Fast),
        Err(OpsError::NotBlockMultiple { .. })
    ));
    assert!(matches!(
        Linear::from_gguf(&b[1..], WeightType::Q4_1, 4, 32, Precision::Fast),
        Err(OpsError::Length { .. })
    ));
    assert!(matches!(
        Linear::from_gguf(&b, WeightType::Q4_1, 0, 32, Precision::Exact),
        Err(OpsError::Empty { .. })
    ));
    assert!(matches!(
        Linear::from_f32(&[0.0; 5], 2, 3, Precision::Exact),
        Err(OpsError::Length { .. })
    ));
    let lin = Linear::from_gguf(&b, WeightType::Q4_1, 4, 32, Precision::Fast).unwrap();
    let mut y = vec![0f32; 8];
    assert!(lin.forward(&[0.0; 33], &mut y).is_err());
    assert!(lin.forward(&[0.0; 64], &mut y[..7]).is_err());
    assert!(lin.forward(&[0.0; 64], &mut y).is_ok());
    assert!(lin.forward(&[], &mut []).is_ok());
}

#[test]
fn linear_from_f32_matches_reference() {
    let mut r = rng("linear_from_f32_matches_reference");
    for (t, out, k) in [(1, 9, 24), (5, 3, 7), (GEMM_MIN_ROWS + 3, 11, 40)] {
        let wv = randn(&mut r, out * k, 1.0);
        let w: Vec<Vec<f64>> = wv
            .chunks(k)
            .map(|c| c.iter().map(|&v| v as f64).collect())
            .collect();
        let x = randn(&mut r, t * k, 1.0);
        let (want, mag) = ref_product(&w, &x, k);
        for p in [Precision::Exact, Precision::Fast] {
            let lin = Linear::from_f32(&wv, out, k, p).unwrap();
            let mut y = vec![0f32; t * out];
            lin.forward(&x, &mut y).unwrap();
            for i in 0..y.len() {
                assert!((y[i] as f64 - want[i]).abs() <= 1e-6 * k as f64 * mag[i] + 1e-30);
            }
        }
    }
}

#[test]
fn embedding_lookup_and_tied_head() {
    let mut r = rng("embedding_lookup_and_tied_head");
    for ty in ALL_TYPES {
        let (vocab, hidden) = (37, 64);
        let bytes = random_bytes(&mut r, ty, vocab, hidden);
        let w = ref_matrix(ty, &bytes, vocab, hidden);
        let e = Embedding::from_gguf(&bytes, ty, vocab, hidden).unwrap();
        let toks = [0u32, 36, 5, 5];
        let mut out = vec![0f32; toks.len() * hidden];
        e.lookup(&toks, &mut out).unwrap();
        for (i, &tk) in toks.iter().enumerate() {
            for j in 0..hidden {
                let want = w[tk as usize][j];
                assert!((out[i * hidden + j] as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3));
            }
        }
        assert!(matches!(
            e.lookup(&[37], &mut out[..hidden]),
            Err(OpsError::Token {
                token: 37,
                vocab: 37
            })
        ));
        // The tied head: logits = rows · x.
        let head = e.to_linear(Precision::Exact).unwrap();
        let x = randn(&mut r, hidden, 1.0);
        let mut logits = vec![0f32; vocab];
        head.forward(&x, &mut logits).unwrap();
        let (want, mag) = ref_product(&w, &x, hidden);
        for i in 0..vocab {
            assert!((logits[i] as f64 - want[i]).abs() <= 1e-6 * 64.0 * mag[i] + 1e-30);
        }
    }
    assert!(Embedding::from_gguf(&[0; 10], WeightType::Q8_0, 1, 32).is_err());
}

#[test]
fn rms_norm_matches_reference() {
    let mut r = rng("rms_norm_matches_reference");
    for (t, h) in [(1, 576), (3, 64), (17, 7), (200, 576)] {
        let x = randn(&mut r, t * h, 4.0);
        let w = randn(&mut r, h, 2.0);
        let mut out = vec![0f32; t * h];
        rms_norm(&x, &w, 1e-5, &mut out).unwrap();
        for c in 0..t {
            let xs = &x[c * h..(c + 1) * h];
            let ms = xs.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / h as f64;
            let rr = 1.0 / (ms + 1e-5).sqrt();
            for j in 0..h {
                let want = w[j] as f64 * xs[j] as f64 * rr;
                let got = out[c * h + j] as f64;
                assert!(
                    (got - want).abs() <= 4e-7 * want.abs() + 1e-30,
                    "{got} vs {want}"
                );
            }
        }
    }
    let mut out = [0f32; 5];
    assert!(rms_norm(&[1.0; 5], &[1.0; 2], 1e-5, &mut out).is_err());
    assert!(rms_norm(&[1.0; 4], &[1.0; 2], 1e-5, &mut out).is_err());
}

#[test]
fn swiglu_matches_reference() {
    let mut r = rng("swiglu_matches_reference");
    let g = randn(&mut r, 3 * 1536, 8.0);
    let u = randn(&mut r, 3 * 1536, 2.0);
    let mut out = vec![0f32; g.len()];
    swiglu(&g, &u, &mut out).unwrap();
    for i in 0..g.len() {
        let gd = g[i] as f64;
        let want = gd / (1.0 + (-gd).exp()) * u[i] as f64;
        assert!((out[i] as f64 - want).abs() <= 1e-6 * want.abs() + 1e-30);
    }
    assert!(swiglu(&g, &u[1..], &mut out).is_err());
}

fn ref_rope(x: &[f32], pos: usize, d: usize, inv: &[f32], style: RopeStyle) -> Vec<f64> {
    let mut y: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for (h, head) in x.chunks(d).enumerate() {
        for i in 0..d / 2 {
            let (a, b) = match style {
                RopeStyle::Normal => (2 * i, 2 * i + 1),
                RopeStyle::Neox => (i, i + d / 2),
            };
            let th = (pos as f32 * inv[i]) as f64;
            let (x1, x2) = (head[a] as f64, head[b] as f64);
            y[h * d + a] = x1 * th.cos() - x2 * th.sin();
            y[h * d + b] = x2 * th.cos() + x1 * th.sin();
        }
    }
    y
}

#[test]
fn rope_both_modes() {
    let mut r = rng("rope_both_modes");
    for (d, base) in [(64usize, 100000.0f32), (8, 10000.0), (128, 500000.0)] {
        let normal = Rope::new(d, base, RopeStyle::Normal).unwrap();
        let neox = Rope::new(d, base, RopeStyle::Neox).unwrap();
        for (i, &f) in normal.inv_freq().iter().enumerate() {
            let want = 1.0 / (base as f64).powf((2 * i) as f64 / d as f64);
            assert!(
                (f as f64 - want).abs() <= 2.0 * f32::EPSILON as f64 * want,
                "inv_freq {i}"
            );
        }
        let heads = 3;
        let positions: Vec<usize> = vec![0, 1, 17, 4095, 100_000];
        let x = randn(&mut r, positions.len() * heads * d, 3.0);
        for rope in [&normal, &neox] {
            let mut y = x.clone();
            rope.apply(&mut y, &positions, heads).unwrap();
            for (c, &p) in positions.iter().enumerate() {
                let row = &x[c * heads * d..(c + 1) * heads * d];
                let want = ref_rope(row, p, d, rope.inv_freq(), rope.style());
                for j in 0..heads * d {
                    let got = y[c * heads * d + j] as f64;
                    assert!(
                        (got - want[j]).abs() <= 1e-6 * 6.0,
                        "{:?} pos {p} [{j}]",
                        rope.style()
                    );
                }
            }
        }
        // Normal on a head permuted to adjacent pairs is Neox on the original: the same bits.
        let mut a = x.clone();
        neox.apply(&mut a, &positions, heads).unwrap();
        let perm = |v: &[f32]| -> Vec<f32> {
            v.chunks(d)
                .flat_map(|h| (0..d / 2).flat_map(move |i| [h[i], h[i + d / 2]]))
                .collect()
        };
        let mut b = perm(&x);
        normal.apply(&mut b, &positions, heads).unwrap();
        assert_eq!(perm(&a), b);
    }
    assert!(Rope::new(7, 1e4, RopeStyle::Normal).is_err());
    let rope = Rope::new(8, 1e4, RopeStyle::Normal).unwrap();
    assert!(rope.apply(&mut [0.0; 12], &[0, 1], 1).is_err());
    assert!(rope.apply(&mut [0.0; 16], &[0, 1], 1).is_ok());
}

#[test]
fn argmax_ties_and_nan() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    assert_eq!(argmax(&[-5.0, -5.0]), 0);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY, -1.0]), 2);
    assert_eq!(argmax(&[1.0, f32::NAN, 9.0]), 1);
}

#[test]
fn sampling() {
    let mut r = rng("sampling");
    let mut s = Sampler::new();
    let logits = randn(&mut r, 1000, 5.0);
    let greedy = argmax(&logits);
    // Temperature 0 and top-k 1 are greedy, whatever the seed.
    for seed in 0..20 {
        let p = SamplingParams {
            temperature: 0.0,
            top_p: 0.5,
            top_k: 0,
            seed,
        };
        assert_eq!(s.sample(&logits, &p, seed).unwrap(), greedy);
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 1,
            seed,
        };
        assert_eq!(s.sample(&logits, &p, 3).unwrap(), greedy);
    }
    // Reproducible: a draw depends on (seed, step) only, not on what was drawn before.
    let p = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 50,
        seed: r.random(),
    };
    let a: Vec<u32> = (0..50)
        .map(|st| s.sample(&logits, &p, st).unwrap())
        .collect();
    let mut s2 = Sampler::new();
    let other = randn(&mut r, 77, 1.0);
    let b: Vec<u32> = (0..50)
        .rev()
        .map(|st| {
            s2.sample(&other, &SamplingParams { seed: 1, ..p }, st)
                .unwrap();
            s2.sample(&logits, &p, st).unwrap()
        })
        .collect();
    assert_eq!(a, b.into_iter().rev().collect::<Vec<_>>());
    // Top-p: probabilities 0.5, 0.3, 0.15, 0.05; p = 0.7 keeps the first two, renormalized.
    let probs = [0.15f64, 0.5, 0.05, 0.3];
    let logits: Vec<f32> = probs.iter().map(|v| v.ln() as f32).collect();
    let n = 20000;
    let mut count = [0usize; 4];
    let seed = r.random();
    for st in 0..n {
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.7,
            top_k: 0,
            seed,
        };
        count[s.sample(&logits, &p, st).unwrap() as usize] += 1;
    }
    assert_eq!(count[0] + count[2], 0, "{count:?}");
    let f = count[1] as f64 / n as f64;
    assert!((f - 0.625).abs() < 0.02, "{count:?}");
    // Plain temperature 1: frequencies follow the softmax; top-k 3 drops the smallest.
    let mut count = [0usize; 4];
    let mut count_k = [0usize; 4];
    for st in 0..n {
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed,
        };
        count[s.sample(&logits, &p, st).unwrap() as usize] += 1;
        let p = SamplingParams { top_k: 3, ..p };
        count_k[s.sample(&logits, &p, st).unwrap() as usize] += 1;
    }
    for i in 0..4 {
        assert!(
            (count[i] as f64 / n as f64 - probs[i]).abs() < 0.02,
            "{count:?}"
        );
    }
    assert_eq!(count_k[2], 0);
    assert!(
        (count_k[1] as f64 / n as f64 - 0.5 / 0.95).abs() < 0.02,
        "{count_k:?}"
    );
    // Top-p over a large vocabulary with a long tail (the nucleus grows past the first head).
    let flat = vec![0.0f32; 5000];
    let p = SamplingParams {
        temperature: 1.0,
        top_p: 0.5,
        top_k: 0,
        seed,
    };
    for st in 0..200 {
        assert!(s.sample(&flat, &p, st).unwrap() < 2500);
    }
    assert!(s
        .sample(&flat, &SamplingParams { top_p: 0.0, ..p }, 0)
        .is_err());
    assert!(s.sample(&[], &p, 0).is_err());
}

#[test]
fn log_softmax_matches_reference() {
    let mut r = rng("log_softmax_matches_reference");
    let l = randn(&mut r, 49152, 20.0);
    let mut out = vec![0f32; l.len()];
    log_softmax(&l, &mut out).unwrap();
    let m = l.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let lse = m + l.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
    for i in 0..l.len() {
        assert!(
            (out[i] as f64 - (l[i] as f64 - lse)).abs() <= 1e-6 * (l[i] as f64 - lse).abs() + 1e-6
        );
    }
    let total: f64 = out.iter().map(|&v| (v as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-4);
}

/// The activation quantization (vectorized where the CPU allows) against its definition:
/// `d = max|x| / 127`, `q = round_half_even(x · (1 / d))`.
#[test]
fn quantize_activations_matches_definition() {
    use pagedattn_engine::models::ops::quantize_row_q8;
    let mut r = rng("quantize_activations_matches_definition");
    let mut x = randn(&mut r, 32 * 40, 10.0);
    x[32..64].fill(0.0); // an all-zero block
    x[64] = 127.0 * 0.25; // exact steps and halves
    x[65] = -0.5 * 0.25;
    x[66] = 1.5 * 0.25;
    for v in &mut x[67..96] {
        *v = 0.0;
    }
    let (mut q, mut d, mut s) = (vec![0i8; x.len()], vec![0f32; 40], vec![0i32; 40]);
    quantize_row_q8(&x, &mut q, &mut d, &mut s);
    for b in 0..40 {
        let xb = &x[b * 32..(b + 1) * 32];
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let db = amax / 127.0;
        let inv = if db != 0.0 { 1.0 / db } else { 0.0 };
        assert_eq!(d[b], db);
        let mut sum = 0;
        for j in 0..32 {
            let want = (xb[j] * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
            assert_eq!(q[b * 32 + j], want, "block {b} [{j}] x={}", xb[j]);
            sum += want as i32;
        }
        assert_eq!(s[b], sum);
    }
    assert_eq!(&q[64..67], &[127, 0, 2]);
}
