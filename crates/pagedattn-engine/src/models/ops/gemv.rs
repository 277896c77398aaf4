//! The exact path's f32 kernel for few activation rows (decode): tiles of 4 weight rows ×
//! up to 4 activation rows (8 × 1 for a single row), each weight row read once per tile of activation rows.

use pagedattn::cpu::simd::{Simd, WithSimd};

/// `y[c, o] = Σ_k w[o, k] x[c, k]` for rows `o0..o1` of `w` (`[out, k]`) and all of `x`
/// (`[t, k]`); `y` points at `y[0, 0]` of a `[t, ldy]` matrix.
pub(crate) struct Gemv<'a> {
    pub w: &'a [f32],
    pub x: &'a [f32],
    pub k: usize,
    pub o0: usize,
    pub o1: usize,
    pub y: *mut f32,
    pub ldy: usize,
}

impl WithSimd for Gemv<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, s: S) {
        let t = self.x.len() / self.k;
        let mut o = self.o0;
        while o < self.o1 {
            // One activation row: 8 weight rows a tile, so that 8 FMA chains hide the latency.
            let r = (self.o1 - o).min(if t == 1 { 8 } else { 4 });
            let mut c = 0;
            while c < t {
                let n = (t - c).min(4);
                macro_rules! go {
                    ($r:literal) => {
                        match n {
                            4 => self.tile::<S, $r, 4>(s, o, c),
                            3 => self.tile::<S, $r, 3>(s, o, c),
                            2 => self.tile::<S, $r, 2>(s, o, c),
                            _ => self.tile::<S, $r, 1>(s, o, c),
                        }
                    };
                }
                match r {
                    8 => self.tile::<S, 8, 1>(s, o, c),
                    7 => self.tile::<S, 7, 1>(s, o, c),
                    6 => self.tile::<S, 6, 1>(s, o, c),
                    5 => self.tile::<S, 5, 1>(s, o, c),
                    4 => go!(4),
                    3 => go!(3),
                    2 => go!(2),
                    _ => go!(1),
                }
                c += n;
            }
            o += r;
        }
    }
}

impl Gemv<'_> {
    #[inline(always)]
    fn tile<S: Simd, const R: usize, const C: usize>(&self, s: S, o: usize, c: usize) {
        let k = self.k;
        let mut acc = [[s.splat(0.0); C]; R];
        let w = &self.w[o * k..(o + R) * k];
        let x = &self.x[c * k..(c + C) * k];
        let mut i = 0;
        while i + S::LANES <= k {
            let mut xv = [s.splat(0.0); C];
            for (j, v) in xv.iter_mut().enumerate() {
                // SAFETY: i + LANES <= k, so the vector lies in row j of x.
                *v = unsafe { s.load(x.as_ptr().add(j * k + i)) };
            }
            for (r, a) in acc.iter_mut().enumerate() {
                // SAFETY: as above, in row r of w.
                let wv = unsafe { s.load(w.as_ptr().add(r * k + i)) };
                for (aj, &xj) in a.iter_mut().zip(&xv) {
                    *aj = s.fma(wv, xj, *aj);
                }
            }
            i += S::LANES;
        }
        for (r, a) in acc.iter().enumerate() {
            for (j, &aj) in a.iter().enumerate() {
                let mut sum = s.reduce_sum(aj);
                for q in i..k {
                    sum += w[r * k + q] * x[j * k + q];
                }
                // SAFETY: (c + j, o + r) lies in y, which the caller gave as [t, ldy] with
                // o + r < ldy; no other task writes rows o..o1.
                unsafe { *self.y.add((c + j) * self.ldy + o + r) = sum };
            }
        }
    }
}
