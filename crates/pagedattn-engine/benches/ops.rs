//! Hand-timed medians of `Linear` on SmolLM2-135M's shapes, fast (Q4_1 layers, Q8_0 tied head)
//! and exact (f32), against this machine's measured f32 FMA peak.
//!
//! `cargo bench -p pagedattn-engine --bench ops` (`-- quick` for fewer rounds;
//! `-- gemm` to compare the exact path's own kernel with `gemm` at small batches).

use std::hint::black_box;
use std::time::Instant;

use pagedattn::cpu::peak::Peak;
use pagedattn_engine::models::ops::{Isa, Linear, Precision};
use pagedattn_engine::models::weights::WeightType;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `f` over enough runs to fill about `budget` seconds.
fn time(budget: f64, mut f: impl FnMut()) -> f64 {
    f();
    let t0 = Instant::now();
    f();
    let once = t0.elapsed().as_secs_f64().max(1e-7);
    let runs = ((budget / once) as usize).clamp(3, 2000);
    median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn random_bytes(ty: WeightType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let n = ty.row_bytes(cols).unwrap() * rows;
    let mut s = seed;
    let mut b: Vec<u8> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect();
    // Sane f16 scales (0.01) at each block's start (and Q4_1's minimum).
    let bb = ty.block_bytes();
    for blk in b.chunks_mut(bb) {
        blk[..2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
        if ty == WeightType::Q4_1 {
            blk[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_bits().to_le_bytes());
        }
    }
    b
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "quick");
    let budget = if quick { 0.1 } else { 0.4 };
    let isa = pagedattn_engine::models::ops::isa_from_env().unwrap();
    let threads = rayon::current_num_threads();
    // f32 FMA peak: one thread, then every rayon thread at once.
    let iters = 20_000_000u64;
    let t0 = Instant::now();
    let flops = Peak::F32Fma.run(isa, iters).unwrap();
    let one = flops / t0.elapsed().as_secs_f64() / 1e9;
    let t0 = Instant::now();
    let all: f64 = rayon::broadcast(|_| Peak::F32Fma.run(isa, iters).unwrap())
        .iter()
        .sum();
    let peak = all / t0.elapsed().as_secs_f64() / 1e9;
    println!(
        "isa {isa}, {threads} threads; f32 FMA peak {one:.1} GFLOP/s one thread, {peak:.1} all"
    );

    if args.iter().any(|a| a == "gemm") {
        println!("\nexact path: own kernel vs gemm (GFLOP/s)");
        for (out, k) in [(576, 576), (1536, 576), (576, 1536)] {
            let b = random_bytes(WeightType::F32, out, k, 1);
            let mut lin = Linear::from_gguf(&b, WeightType::F32, out, k, Precision::Exact).unwrap();
            for t in [1, 2, 4, 8, 12, 16, 24, 32, 64] {
                let x = vec![0.5f32; t * k];
                let mut y = vec![0f32; t * out];
                let mut r = [0.0; 2];
                for (i, min) in [usize::MAX, 1].into_iter().enumerate() {
                    lin.set_gemm_min_rows(min);
                    let s = time(budget, || lin.forward(black_box(&x), &mut y).unwrap());
                    r[i] = 2.0 * (t * out * k) as f64 / s / 1e9;
                }
                println!(
                    "{out:>6}x{k:<5} t={t:<4} own {:7.1}  gemm {:7.1}",
                    r[0], r[1]
                );
            }
        }
        return;
    }

    println!(
        "\n{:<14} {:>4} | {:>9} {:>9} {:>7} | {:>9} {:>9} {:>7} | {:>6}",
        "out x in",
        "t",
        "fast GF/s",
        "fast GB/s",
        "fast ms",
        "exct GF/s",
        "exct GB/s",
        "exct ms",
        "speedup"
    );
    let shapes = [
        (576, 576, WeightType::Q4_1),
        (192, 576, WeightType::Q4_1),
        (1536, 576, WeightType::Q4_1),
        (576, 1536, WeightType::Q4_1),
        (49152, 576, WeightType::Q8_0),
    ];
    for (out, k, ty) in shapes {
        let b = random_bytes(ty, out, k, 7);
        let fast = Linear::from_gguf(&b, ty, out, k, Precision::Fast).unwrap();
        let exact = Linear::from_gguf(&b, ty, out, k, Precision::Exact).unwrap();
        for t in [1, 8, 32, 128, 256] {
            let x: Vec<f32> = (0..t * k)
                .map(|i| ((i * 7919) % 113) as f32 / 50.0 - 1.1)
                .collect();
            let mut y = vec![0f32; t * out];
            let flop = 2.0 * (t * out * k) as f64;
            let sf = time(budget, || fast.forward(black_box(&x), &mut y).unwrap());
            let se = time(budget, || exact.forward(black_box(&x), &mut y).unwrap());
            let (qb, fb) = (b.len() as f64, (out * k * 4) as f64);
            println!(
                "{:<14} {:>4} | {:>9.1} {:>9.1} {:>7.3} | {:>9.1} {:>9.1} {:>7.3} | {:>5.1}x",
                format!("{out}x{k} {ty:?}"),
                t,
                flop / sf / 1e9,
                qb / sf / 1e9,
                sf * 1e3,
                flop / se / 1e9,
                fb / se / 1e9,
                se * 1e3,
                se / sf
            );
        }
    }
    let _ = Isa::Scalar;
}
