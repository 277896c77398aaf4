//! Prefill on Intel AMX tiles (`tdpbf16ps`, Sapphire Rapids and later): the bf16 prefill's
//! packed keys and values ([`PackedBf16`]) are already in the layout AMX's B operand wants
//! (pairs of consecutive contraction elements side by side, 16 columns of 64 bytes), so the
//! scores are `Q · K^T` on 16 × 32 query tiles against 16-key column groups, and P·V
//! multiplies 16 × 32 probability tiles (rounded to bf16, as in the AVX512-BF16 prefill) by
//! 16 key pairs × 16 dimensions of values, into the accumulators in memory. The softmax in
//! between is the shared tile loop's, on AVX-512.
//!
//! Rust has no AMX intrinsics on stable: the few instructions are `asm!`, with the tile
//! registers named in the templates. Every tile is 16 rows of 64 bytes (one configuration for
//! the whole kernel); query rows are padded to a multiple of 16 with zeros.
//!
//! Linux hands AMX's 8 KiB of tile state to a process only after it asks
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); [`available`] asks once.

use std::arch::asm;
use std::ops::Range;
use std::sync::OnceLock;

use super::bf16::{probs_to_pairs, Bf16Source, PackedBf16};
use super::kernel::{RowStates, TileSource, KEY_TILE};
use super::simd::Simd;

/// Rows of every tile, and the query rows of one block.
pub const TILE_ROWS: usize = 16;

/// Bytes per tile row (16 f32, or 32 bf16).
const TILE_BYTES: usize = 64;

/// Whether this CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use them.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| cpu_has_amx_bf16() && request_tile_data())
}

/// CPUID leaf 7: EDX bit 22 (AMX-BF16) and bit 24 (AMX-TILE).
fn cpu_has_amx_bf16() -> bool {
    // (`is_x86_feature_detected!("amx-tile")` is not stable yet. Leaf 7 exists on every CPU
    // with AVX-512, which callers check first.)
    // SAFETY: CPUID exists on every x86_64 CPU. Newer Rust declares the intrinsic safe; the
    // minimum supported Rust (1.89) still declares it unsafe.
    #[allow(unused_unsafe)]
    let leaf = unsafe { std::arch::x86_64::__cpuid_count(7, 0) };
    leaf.edx & (1 << 22) != 0 && leaf.edx & (1 << 24) != 0
}

/// Asks Linux for the AMX tile data state (once per process; other systems: no AMX).
fn request_tile_data() -> bool {
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with this request only changes the process's permitted extended
        // state; it fails cleanly where the kernel or the CPU lacks it.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// The tile configuration `ldtilecfg` reads: palette 1, tiles 0-7 of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    column_bytes: [u16; 16],
    rows: [u8; 16],
}

/// Loads the configuration on this thread; [`release`] hands the tiles back.
fn configure() {
    let mut config = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        column_bytes: [0; 16],
        rows: [0; 16],
    };
    config.column_bytes[..8].fill(TILE_BYTES as u16);
    config.rows[..8].fill(TILE_ROWS as u8);
    // SAFETY: only called where `available()` (AMX on this CPU, permitted to this process);
    // the configuration is valid (palette 1, 8 tiles within its 16 × 64-byte limits).
    unsafe {
        asm!(
            "ldtilecfg [{}]",
            in(reg) &config as *const TileConfig,
            options(nostack, readonly)
        )
    };
}

/// Releases the tiles (their state is then init again, and saved cheaply on switches).
fn release() {
    // SAFETY: as `configure`.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// `tileloadd tmm$t, [$ptr + $stride]`: 16 rows of 64 bytes, `$stride` bytes apart.
macro_rules! tile_load {
    ($t:literal, $ptr:expr, $stride:expr) => {
        asm!(
            concat!("tileloadd tmm", $t, ", [{0} + {1}*1]"),
            in(reg) $ptr,
            in(reg) $stride,
            options(nostack, readonly)
        )
    };
}

/// `tilestored [$ptr + $stride], tmm$t`.
macro_rules! tile_store {
    ($t:literal, $ptr:expr, $stride:expr) => {
        asm!(
            concat!("tilestored [{0} + {1}*1], tmm", $t),
            in(reg) $ptr,
            in(reg) $stride,
            options(nostack)
        )
    };
}

/// Zeroes the four accumulator tiles, `tmm0`-`tmm3`.
///
/// # Safety
/// Only while the tiles are configured ([`with_tiles`]).
#[inline(always)]
unsafe fn zero_accumulators() {
    asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        options(nostack, nomem)
    );
}

/// `tdpbf16ps tmm$c, tmm$a, tmm$b`: C (16 × 16 f32) += A (16 × 32 bf16) · B (16 pairs × 16).
macro_rules! tile_dot {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem)
        )
    };
}

/// A query tile (bf16 pairs, rows padded to [`TILE_ROWS`]) against packed bf16 keys and
/// values, on AMX. Its states must have the padded row count.
#[derive(Debug, Clone, Copy)]
pub struct AmxSource<'a> {
    /// The packed keys and values.
    pub packed: &'a PackedBf16,
    /// Padded rows × d/2 query pairs, unscaled (padding rows zero).
    pub q: &'a [u32],
    /// Score scale: softmax scale × fp8 k_scale.
    pub scale: f32,
}

impl AmxSource<'_> {
    /// Query rows, padded.
    fn rows(&self) -> usize {
        self.q.len() / (self.packed.head_size() / 2)
    }
}

impl TileSource for AmxSource<'_> {
    type Tile<'t>
        = Range<usize>
    where
        Self: 't;

    fn alignment(&self) -> (usize, usize) {
        (self.packed.origin(), TILE_ROWS)
    }

    #[inline(always)]
    fn tile(&self, keys: Range<usize>) -> Range<usize> {
        keys
    }

    #[inline(always)]
    fn scores<S: Simd>(
        &self,
        s: S,
        keys: &Range<usize>,
        _cols: &[Range<usize>],
        scores: &mut [f32],
    ) {
        let p = self.packed;
        let d = p.head_size();
        let rows = self.rows();
        debug_assert!(rows.is_multiple_of(TILE_ROWS) && scores.len() >= rows * KEY_TILE);
        let groups = keys.len().div_ceil(TILE_ROWS);
        let kt = p.key_groups((keys.start - p.origin()) / TILE_ROWS, groups);
        let q_stride = d * 2;
        let s_stride = KEY_TILE * 4;
        for block in 0..rows / TILE_ROWS {
            let q = self.q[block * TILE_ROWS * d / 2..].as_ptr();
            let out = scores[block * TILE_ROWS * KEY_TILE..].as_mut_ptr();
            // Group g's 16 keys, dimensions c..c+32: 16 rows (pairs) of 16 keys, 64 bytes apart.
            let b = |g: usize, c: usize| kt[(g * d / 2 + c / 2) * TILE_ROWS..].as_ptr();
            // SAFETY: the tiles are configured (the caller, `attend_amx`); q holds the block's
            // 16 rows of d bf16 (d % 32 == 0, so every 64-byte row piece is inside); `kt`
            // holds `groups` column groups of d/2 × 16 pairs; the scores hold the block's 16
            // rows of KEY_TILE f32 and the groups' columns lie inside them.
            unsafe {
                zero_accumulators();
                for c in (0..d).step_by(32) {
                    tile_load!(4, q.add(c / 2), q_stride);
                    tile_load!(5, b(0, c), TILE_BYTES);
                    tile_dot!(0, 4, 5);
                    if groups > 1 {
                        tile_load!(6, b(1, c), TILE_BYTES);
                        tile_dot!(1, 4, 6);
                    }
                    if groups > 2 {
                        tile_load!(5, b(2, c), TILE_BYTES);
                        tile_dot!(2, 4, 5);
                    }
                    if groups > 3 {
                        tile_load!(6, b(3, c), TILE_BYTES);
                        tile_dot!(3, 4, 6);
                    }
                }
                tile_store!(0, out, s_stride);
                if groups > 1 {
                    tile_store!(1, out.add(TILE_ROWS), s_stride);
                }
                if groups > 2 {
                    tile_store!(2, out.add(2 * TILE_ROWS), s_stride);
                }
                if groups > 3 {
                    tile_store!(3, out.add(3 * TILE_ROWS), s_stride);
                }
            }
        }
        // The scale, applied to the dot products as the other kernels do.
        let scale = s.splat(self.scale);
        for row in scores[..rows * KEY_TILE].chunks_exact_mut(KEY_TILE) {
            for c in (0..groups * TILE_ROWS).step_by(S::LANES) {
                // SAFETY: c + LANES <= groups * 16 <= KEY_TILE.
                unsafe {
                    let at = row.as_mut_ptr().add(c);
                    s.store(at, s.mul(s.load(at), scale));
                }
            }
        }
    }

    #[inline(always)]
    fn accumulate<S: Simd>(
        &self,
        _s: S,
        keys: &Range<usize>,
        _cols: &[Range<usize>],
        skip: &[bool],
        probs: &mut [f32],
        state: &mut RowStates,
    ) {
        let p = self.packed;
        let d = p.head_size();
        let rows = state.m.len();
        debug_assert_eq!(rows, self.rows());
        probs_to_pairs(probs, rows);
        // Whole chunks of 32 keys (16 pairs): A's width.
        let chunks = keys.len().div_ceil(2 * TILE_ROWS);
        let mut scratch = Vec::new();
        let v = p.tile_values(keys, skip, chunks * TILE_ROWS, &mut scratch);
        let (p_stride, v_stride, acc_stride) = (KEY_TILE * 4, d * 4, d * 4);
        for block in 0..rows / TILE_ROWS {
            let probs = probs[block * TILE_ROWS * KEY_TILE..].as_ptr() as *const u8;
            let acc = state.acc[block * TILE_ROWS * d..].as_mut_ptr();
            // SAFETY: the tiles are configured; each probability row starts with KEY_TILE / 2
            // bf16 pairs (64 keys, 128 bytes: both chunks inside); `v` holds chunks × 16
            // pairs of d u32; the accumulators hold the block's 16 rows of d f32, and
            // n + 16 <= d.
            unsafe {
                tile_load!(6, probs, p_stride);
                if chunks > 1 {
                    tile_load!(7, probs.add(TILE_BYTES), p_stride);
                }
                for n in (0..d).step_by(TILE_ROWS) {
                    let c = acc.add(n);
                    tile_load!(0, c, acc_stride);
                    tile_load!(4, v.as_ptr().add(n), v_stride);
                    tile_dot!(0, 6, 4);
                    if chunks > 1 {
                        tile_load!(5, v.as_ptr().add(TILE_ROWS * d + n), v_stride);
                        tile_dot!(0, 7, 5);
                    }
                    tile_store!(0, c, acc_stride);
                }
            }
        }
    }

    fn value_row(&self, keys: &Range<usize>, t: usize, out: &mut [f32]) {
        self.packed.value_row(keys.start + t, out)
    }
}

impl Bf16Source for AmxSource<'_> {
    const AMX: bool = true;
}

/// The padded row count of `rows` query rows.
pub fn padded_rows(rows: usize) -> usize {
    rows.next_multiple_of(TILE_ROWS)
}

/// Loads the tile configuration for the duration of `f` on this thread.
pub fn with_tiles<R>(f: impl FnOnce() -> R) -> R {
    assert!(available(), "AMX was detected by the dispatcher");
    configure();
    let out = f();
    release();
    out
}

/// FLOPs of one `tdpbf16ps`: 16 × 16 outputs, each adding 32 products.
#[cfg(feature = "probes")]
pub const TILE_DOT_FLOPS: f64 = (2 * TILE_ROWS * TILE_ROWS * (TILE_BYTES / 2)) as f64;

/// The `tdpbf16ps` peak probe (feature `probes`): `iters` rounds of a GEMM micro-kernel's 2 × 2 block (four
/// accumulator tiles, `C[i][j] += A[i] · B[j]`) on this thread: one `tdpbf16ps` issues every
/// 16 cycles on Sapphire Rapids and its latency is a few times that, so each tile's next
/// product comes four issues after its last. The operands are loaded once, outside the loop,
/// so that the figure is the instruction's own rate, which the prefill's loads and softmax
/// then spend. Returns the FLOPs done, or None without AMX.
#[cfg(feature = "probes")]
pub fn peak(iters: u64) -> Option<f64> {
    if !available() {
        return None;
    }
    // bf16 1e-3 in every element: products of 1e-6, so the accumulators grow by 3.2e-5 per
    // round, far from overflow and never subnormal.
    #[repr(C, align(64))]
    struct Operand([u16; TILE_ROWS * TILE_BYTES / 2]);
    let operand = Operand([half::bf16::from_f32(1e-3).to_bits(); TILE_ROWS * TILE_BYTES / 2]);
    let at = operand.0.as_ptr();
    with_tiles(|| {
        // SAFETY: the tiles are configured (`with_tiles`, after `available()`); `operand`
        // holds 16 rows of 64 bytes, TILE_BYTES apart.
        unsafe {
            zero_accumulators();
            tile_load!(4, at, TILE_BYTES);
            tile_load!(5, at, TILE_BYTES);
            tile_load!(6, at, TILE_BYTES);
            tile_load!(7, at, TILE_BYTES);
            for _ in 0..iters {
                tile_dot!(0, 4, 6);
                tile_dot!(1, 4, 7);
                tile_dot!(2, 5, 6);
                tile_dot!(3, 5, 7);
            }
        }
    });
    Some(iters as f64 * 4.0 * TILE_DOT_FLOPS)
}
