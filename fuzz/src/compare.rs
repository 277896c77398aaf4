//! Whether a backend's result agrees with `reference`'s, as `docs/semantics.md` ("Ranges,
//! overflow, NaN and Inf") defines agreement: the caches after the call hold the same bytes in
//! the canonical layout, and every output element is in the same class (finite, NaN, ±Inf)
//! and, where finite, within a tolerance derived from the call (the model of
//! `crates/pagedattn/tests/cpu_vs_reference.rs`, computed here per output row from the row's
//! own query and its sequence's keys and values).

use pagedattn::cpu::Isa;
use pagedattn::replay::{ReplayCase, ReplayOutput};
use pagedattn::semantics::{query_position, KeyLocation, KeyMap};
use pagedattn::{AttnType, DType, Fp8Format, HostStorage, Tensor};

/// Which output rows are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Every row, NaN and Inf included: generated calls, whose finite inputs are modest.
    All,
    /// Only rows whose query, keys and values are finite and inside the exactness domain:
    /// arbitrary cases (mutated replay files, edge settings), where a row outside it may
    /// legitimately come out as ±Inf or NaN.
    FiniteInDomain,
}

/// f32 unit roundoff: both backends read the same stored inputs, so the difference comes from
/// the f32 accumulation of `cpu` (and the final rounding to the output dtype, the `ulp` term).
const U: f64 = f32::EPSILON as f64 / 2.0;

/// The constants of `Tolerance` in `cpu_vs_reference.rs`, calibrated there over ~50 000 calls
/// on every ISA (largest error seen: 0.34 of the allowance): `C0` roundings of quantities
/// bounded by the largest value (exponentials, online-softmax rescaling, split-K merges, P·V
/// sums, the normalisation), `C1` per unit of score magnitude (an absolute score error `ds`
/// moves the output by at most `2 * vmax * ds`).
const C0: f64 = 16.0;
const C1: f64 = 3.0;

/// The exactness domain's limit on a row's dot products, value sums and score terms, with a
/// factor 4 of margin so that their sum and its rounding stay finite in f32 too.
const DOMAIN: f64 = f32::MAX as f64 / 4.0;

/// Checks `got` (from a `cpu` backend running `isa`) against `want` (from `reference`) for
/// `case`, which both ran successfully. Returns what disagrees.
pub fn check(
    case: &ReplayCase,
    want: &ReplayOutput,
    got: &ReplayOutput,
    isa: Isa,
    rows: Rows,
) -> Result<(), String> {
    same_caches(want, got).map_err(|e| format!("isa {isa}: {e}"))?;
    let (w, g) = (&want.output, &got.output);
    if w.shape() != g.shape() || w.dtype() != g.dtype() {
        return Err(format!(
            "isa {isa}: output {:?} {}, reference {:?} {}",
            g.shape(),
            g.dtype(),
            w.shape(),
            w.dtype()
        ));
    }
    let (wv, gv) = (values(w)?, values(g)?);
    let q = values(&case.query)?;
    let config = &case.config;
    let md = &case.metadata;
    let (h_count, d) = (config.num_heads(), config.head_size());
    let group = config.num_queries_per_kv();
    let keys = KeyStats::new(case, want)?;
    let out = Output::of(w.dtype());
    // The bf16 dot-product kernels (`Isa::bf16_dot_products`; prefill rows, a superset of
    // the decode's): probabilities rounded to bf16 for P·V, and subnormal inputs, products
    // and partial sums flushed to zero (docs/semantics.md, "Subnormal bf16 inputs").
    let bf16_pv = w.dtype() == DType::BF16 && isa.bf16_dot_products(d, true);
    let mut first: Option<String> = None;
    let mut bad = 0usize;
    for s in 0..md.num_seqs() {
        let range = md.query_range(s);
        for (m, t) in range.clone().enumerate() {
            let i = query_position(config.attn_type(), md.seq_lens[s] as usize, range.len(), m);
            for h in 0..h_count {
                let at = (t * h_count + h) * d;
                let q_row = &q[at..at + d];
                let kv = keys.of(s, h / group);
                let qmax = finite_max(q_row);
                let slope = config.alibi_slopes().map_or(0.0, |sl| sl[h].abs() as f64);
                let parts = [
                    config.scale().abs() as f64 * d as f64 * qmax * kv.kmax,
                    slope * i.max(kv.positions) as f64,
                    config.logits_soft_cap().map_or(0.0, f64::from),
                ];
                let smag: f64 = parts.iter().sum();
                if rows == Rows::FiniteInDomain {
                    let finite = q_row.iter().all(|x| x.is_finite()) && kv.finite;
                    // The contract's domain (sums of the stored, unscaled products and
                    // values within f32: f32 accumulators never overflow), and the scaled
                    // sums too (where the tolerance below is meaningful).
                    let (ku, vu) = keys.unscale;
                    let stored = d as f64 * qmax * kv.kmax * ku <= DOMAIN
                        && kv.positions as f64 * kv.vmax * vu <= DOMAIN;
                    let in_domain =
                        stored && smag <= DOMAIN && kv.positions as f64 * kv.vmax <= DOMAIN;
                    if !(finite && in_domain) {
                        continue;
                    }
                }
                let tol = Tolerance {
                    out,
                    abs: kv.vmax * U * (C0 + C1 * smag),
                    // The bf16 kernels round each probability to bf16 (8 significant bits)
                    // for their P·V: at most 2^-8 of each weight, so 2^-8 * vmax.
                    pv: if bf16_pv { kv.vmax / 256.0 } else { 0.0 },
                    flush: if bf16_pv {
                        flush_bound(d, config.scale(), qmax, kv)
                    } else {
                        0.0
                    },
                };
                for x in 0..d {
                    let (wx, gx) = (wv[at + x], gv[at + x]);
                    if tol.agrees(wx, gx) {
                        continue;
                    }
                    bad += 1;
                    if first.is_none() {
                        let class = if wx.is_finite() && gx.is_finite() {
                            "out of tolerance"
                        } else {
                            "NaN/Inf class mismatch"
                        };
                        first = Some(format!(
                            "isa {isa}: {class}: output[{t}][{h}][{x}] = {gx:e}, reference \
                             {wx:e} (allowed difference {:e}; sequence {s}, query position \
                             {i}, max |q| {qmax:e}, max |k| {:e}, max |v| {:e}, {} keys, score \
                             magnitude {smag:e})",
                            tol.bound(wx.abs().max(gx.abs())),
                            kv.kmax,
                            kv.vmax,
                            kv.positions,
                        ));
                    }
                }
            }
        }
    }
    match first {
        None => Ok(()),
        Some(msg) => Err(format!("{msg}; {bad} of {} elements disagree", wv.len())),
    }
}

/// The caches after the call: the same bytes in the canonical layout (the same rounding, the
/// same fp8 codes, poison left alone), or no cache on both.
fn same_caches(want: &ReplayOutput, got: &ReplayOutput) -> Result<(), String> {
    match (&want.kv_cache, &got.kv_cache) {
        (None, None) => Ok(()),
        (Some((wk, wv)), Some((gk, gv))) => {
            for (name, w, g) in [("key", wk, gk), ("value", wv, gv)] {
                let (wb, gb) = (bytes(w)?, bytes(g)?);
                if w.shape() != g.shape() || wb.len() != gb.len() {
                    return Err(format!(
                        "{name} cache shape {:?}, reference {:?}",
                        g.shape(),
                        w.shape()
                    ));
                }
                if let Some(at) = (0..wb.len()).find(|&i| wb[i] != gb[i]) {
                    let es = w.dtype().size_bytes();
                    let e = at / es;
                    let shape = w.shape();
                    let (heads, dim) = (shape[2], shape[3]);
                    return Err(format!(
                        "{name} cache slot {} head {} element {}: bytes {:02x?}, reference {:02x?}",
                        e / (heads * dim),
                        e / dim % heads,
                        e % dim,
                        &gb[e * es..(e + 1) * es],
                        &wb[e * es..(e + 1) * es]
                    ));
                }
            }
            Ok(())
        }
        _ => Err("one backend returned a cache and the other none".into()),
    }
}

fn bytes(t: &Tensor) -> Result<&[u8], String> {
    Ok(t.host().map_err(|e| e.to_string())?.as_bytes())
}

fn values(t: &Tensor) -> Result<Vec<f64>, String> {
    t.host()
        .and_then(HostStorage::to_f64_vec)
        .map_err(|e| e.to_string())
}

/// The largest finite magnitude in `xs` (0 for none).
fn finite_max(xs: &[f64]) -> f64 {
    xs.iter()
        .filter(|x| x.is_finite())
        .fold(0.0, |m, x| m.max(x.abs()))
}

/// The output dtype's rounding: one ulp relative (`2^-23`, `2^-10`, `2^-7`), its smallest
/// subnormal, and its largest finite value.
#[derive(Debug, Clone, Copy)]
struct Output {
    ulp: f64,
    tiny: f64,
    max: f64,
}

impl Output {
    fn of(dtype: DType) -> Self {
        let (ulp, tiny, max) = match dtype {
            DType::F16 => (-10, -24, pagedattn::f16::MAX.to_f64()),
            DType::BF16 => (-7, -133, pagedattn::bf16::MAX.to_f64()),
            _ => (-23, -149, f32::MAX as f64),
        };
        Output {
            ulp: 2f64.powi(ulp),
            tiny: 2f64.powi(tiny),
            max,
        }
    }
}

/// What flushing subnormal bf16 inputs, products and partial sums to zero may change in an
/// output element of a row whose query has largest magnitude `qmax` (docs/semantics.md,
/// "Subnormal bf16 inputs"): `vmax · (e^(2δ) − 1) + (n + 1) · 2^-126`, with `δ = D · 2^-126 ·
/// (1 + |scale|) · (qmax + kmax + 1)`.
fn flush_bound(d: usize, scale: f32, qmax: f64, kv: Stats) -> f64 {
    let tiny = 2f64.powi(-126);
    let delta = d as f64 * tiny * (1.0 + scale.abs() as f64) * (qmax + kv.kmax + 1.0);
    kv.vmax * (2.0 * delta).exp_m1() + (kv.positions + 1) as f64 * tiny
}

/// The tolerance of one output row.
#[derive(Debug, Clone, Copy)]
struct Tolerance {
    out: Output,
    abs: f64,
    pv: f64,
    /// The flush of subnormals on the bf16 dot-product instructions.
    flush: f64,
}

impl Tolerance {
    /// The largest difference allowed around a value of magnitude `mag`.
    fn bound(&self, mag: f64) -> f64 {
        self.out.ulp * mag + self.out.tiny + self.abs + self.pv + self.flush
    }

    /// The contract's agreement of one element: `g` (the backend) against `w` (reference).
    fn agrees(&self, w: f64, g: f64) -> bool {
        // Rounding near the dtype's largest finite value may give Inf on one side.
        let near_overflow = |finite: f64, inf: f64| {
            finite.signum() == inf.signum()
                && finite.abs() + self.bound(self.out.max) >= self.out.max
        };
        if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            // The same infinity, or NaN where an f32 weight underflowed to 0 and met the
            // infinite value (`reference`'s f64 weight stayed positive).
            g == w || g.is_nan() || (g.is_finite() && near_overflow(g, w))
        } else if g.is_finite() {
            (g - w).abs() <= self.bound(w.abs().max(g.abs()))
        } else {
            g.is_infinite() && near_overflow(w, g)
        }
    }
}

/// Per (sequence, kv head): the largest finite key and value magnitudes the sequence's keys
/// have as the backends read them (fp8 codes times their scale), whether all of them are
/// finite, and how many keys it has.
struct KeyStats {
    num_kv_heads: usize,
    stats: Vec<Stats>,
    /// What turns a decoded key or value back into the stored one (1 / the fp8 scale; 1
    /// where no scale applies): the exactness domain bounds the stored values.
    unscale: (f64, f64),
}

#[derive(Debug, Clone, Copy)]
struct Stats {
    kmax: f64,
    vmax: f64,
    finite: bool,
    positions: usize,
}

impl KeyStats {
    fn new(case: &ReplayCase, want: &ReplayOutput) -> Result<Self, String> {
        let config = &case.config;
        let md = &case.metadata;
        let (hkv, d) = (config.num_kv_heads(), config.head_size());
        let attn_type = config.attn_type();
        // Where the keys are read: the cache after the call (whose bytes both backends must
        // share), and the input tensors (a new token with slot -1 beside a cache: as the
        // cache would hold it).
        let mut unscale = (1.0, 1.0);
        let (mut input_keys, mut input_values) = match &case.key_value {
            Some((k, v)) => (values(k)?, values(v)?),
            None => (Vec::new(), Vec::new()),
        };
        let (keys, values, block_size) = match (&case.kv_cache, &want.kv_cache) {
            (Some(cache), Some((k, v))) => {
                let fp8 = config.kv_cache_dtype().fp8_format();
                let scales = config.kv_scales();
                if let Some(f) = fp8 {
                    unscale = (
                        1.0 / f64::from(scales.k_scale).abs(),
                        1.0 / f64::from(scales.v_scale).abs(),
                    );
                    for (xs, scale) in [
                        (&mut input_keys, scales.k_scale),
                        (&mut input_values, scales.v_scale),
                    ] {
                        for x in xs.iter_mut() {
                            *x = f.decode(f.encode(*x as f32 / scale)) as f64 * scale as f64;
                        }
                    }
                }
                (
                    decoded(k, fp8, scales.k_scale)?,
                    decoded(v, fp8, scales.v_scale)?,
                    Some(cache.spec().block_size),
                )
            }
            _ => (input_keys.clone(), input_values.clone(), None),
        };
        // The plan's rule: a cross-attention call with a cache carries key/value (whose
        // tokens with slot -1 are keys from the inputs) exactly when it has a cross slot
        // mapping.
        let has_new_kv = match (attn_type, block_size) {
            (AttnType::EncoderDecoder, Some(_)) => md
                .encoder
                .as_ref()
                .is_some_and(|e| !e.cross_slot_mapping.is_empty()),
            _ => true,
        };
        let key_map = KeyMap::new(md, attn_type, block_size, has_new_kv);
        let mut stats = Vec::with_capacity(md.num_seqs() * hkv);
        for s in 0..md.num_seqs() {
            for g in 0..hkv {
                let mut st = Stats {
                    kmax: 0.0,
                    vmax: 0.0,
                    finite: true,
                    positions: 0,
                };
                // Only sequences with queries have rows to check (and the targets bound the
                // work of those, not of key positions no query reads).
                if !md.query_range(s).is_empty() {
                    for j in 0..key_map.num_positions(s) {
                        let (keys, values, row) = match key_map.locate(s, j) {
                            KeyLocation::Slot(slot) => (&keys, &values, (slot * hkv + g) * d),
                            KeyLocation::InputToken(t) if block_size.is_some() => {
                                (&input_keys, &input_values, (t * hkv + g) * d)
                            }
                            KeyLocation::InputToken(t) => (&keys, &values, (t * hkv + g) * d),
                        };
                        st.positions += 1;
                        for x in row..row + d {
                            let (k, v) = (keys[x], values[x]);
                            st.finite &= k.is_finite() && v.is_finite();
                            if k.is_finite() {
                                st.kmax = st.kmax.max(k.abs());
                            }
                            if v.is_finite() {
                                st.vmax = st.vmax.max(v.abs());
                            }
                        }
                    }
                }
                stats.push(st);
            }
        }
        Ok(KeyStats {
            num_kv_heads: hkv,
            stats,
            unscale,
        })
    }

    fn of(&self, s: usize, g: usize) -> Stats {
        self.stats[s * self.num_kv_heads + g]
    }
}

/// A canonical cache buffer as the attention reads it: fp8 codes decoded times `scale`.
fn decoded(t: &Tensor, fp8: Option<Fp8Format>, scale: f32) -> Result<Vec<f64>, String> {
    let host = t.host().map_err(|e| e.to_string())?;
    Ok(match (host, fp8) {
        (HostStorage::U8(codes), Some(f)) => codes
            .iter()
            .map(|&c| f.decode(c) as f64 * scale as f64)
            .collect(),
        _ => host.to_f64_vec().map_err(|e| e.to_string())?,
    })
}
