//! A hostile caller of the safe API: between `plan` and `forward`, random operations through
//! every public way to change what a forward reads — the writable views (`Tensor::host_mut`,
//! `KvCache::host_buffers_mut`: arbitrary values, NaN and ±Inf included, in used and unused
//! cache slots and in the output), cache writes through arbitrary slot mappings, swaps out and
//! back and block copies with arbitrary (also out-of-range) pairs, `Tensor::copy_from` and
//! `Plan::prepared_mut` with the wrong types, tensors of the wrong shape or dtype, a
//! workspace of another plan — on `reference` and on `cpu` (every instruction set here), each
//! with its own cache in its own layout built from the same canonical contents.
//!
//! Every operation and the forward must answer `Ok` or a typed error, the same on every
//! backend, never panic or crash; a call both run must leave the same cache bytes and outputs
//! in the contract's agreement (`docs/semantics.md`; the tolerance here is loose: precision
//! is `cpu_vs_reference`'s business, this suite's is that nothing a caller does reaches
//! undefined behaviour or a panic).
//!
//! Seeds are fresh every run; `PROPTEST_CASES=n` runs n cases (NOTES.md, "Long test
//! campaigns", has the long runs).

mod common;

use common::*;
use pagedattn::cpu::{Cpu, Isa};
use pagedattn::{
    registry, Backend, BlockId, CacheLayout, DType, Error, Inputs, KvPair, Tensor, Workspace,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// A value a hostile caller writes: NaN, ±Inf or a modest finite number.
#[derive(Debug, Clone, Copy)]
enum Value {
    Nan,
    Inf(bool),
    Finite(f32),
}

impl Value {
    fn get(self) -> f32 {
        match self {
            Value::Nan => f32::NAN,
            Value::Inf(negative) => {
                if negative {
                    f32::NEG_INFINITY
                } else {
                    f32::INFINITY
                }
            }
            Value::Finite(x) => x,
        }
    }
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        1 => Just(Value::Nan),
        1 => any::<bool>().prop_map(Value::Inf),
        2 => (-4.0f32..4.0).prop_map(Value::Finite),
    ]
}

/// One thing a caller does between `plan` and `forward`. Indices are taken modulo what they
/// index; block numbers are not (out-of-range pairs must be errors).
#[derive(Debug, Clone)]
enum Op {
    /// `query.host_mut()`: element `at`.
    WriteQuery { at: usize, value: Value },
    /// `key.host_mut()` / `value.host_mut()`: element `at`.
    WriteNewKv { key: bool, at: usize, value: Value },
    /// `cache.host_buffers_mut()`: element `dim` of (`slot`, `head`), located through the
    /// cache's own layout (`KvCache::row_start`); a byte for fp8 caches.
    WriteCache {
        key: bool,
        slot: usize,
        head: usize,
        dim: usize,
        value: Value,
        byte: u8,
    },
    /// `output.host_mut()`: element `at` (the forward must overwrite it).
    WriteOutput { at: usize, value: Value },
    /// `KvCache::write` of the call's own new keys and values through another slot mapping
    /// (slots may be -1, repeated or outside the cache).
    RewriteCache { slots: Vec<i64> },
    /// `swap_out` into a swap space of `swap_blocks` blocks, then `swap_in` back.
    SwapRoundTrip {
        swap_blocks: usize,
        out: Vec<(BlockId, BlockId)>,
        back: Vec<(BlockId, BlockId)>,
    },
    /// `copy_blocks` on the layer's cache.
    CopyBlocks { pairs: Vec<(BlockId, BlockId)> },
    /// `Tensor::copy_from` of the query into the new keys: an error unless their shapes and
    /// dtypes match (H == Hkv), which must leave the keys as they were.
    CopyQueryIntoKey,
    /// `Plan::prepared_mut` with a type no backend prepares.
    PreparedMut,
}

fn op() -> impl Strategy<Value = Op> {
    // Block ids below 0 too: a negative id is an error like one past the cache.
    let pairs = || prop::collection::vec((-2..40 as BlockId, -2..40 as BlockId), 0..4);
    prop_oneof![
        3 => (any::<usize>(), value()).prop_map(|(at, value)| Op::WriteQuery { at, value }),
        2 => (any::<bool>(), any::<usize>(), value())
            .prop_map(|(key, at, value)| Op::WriteNewKv { key, at, value }),
        4 => (any::<bool>(), any::<usize>(), any::<usize>(), any::<usize>(), value(), any::<u8>())
            .prop_map(|(key, slot, head, dim, value, byte)| Op::WriteCache {
                key,
                slot,
                head,
                dim,
                value,
                byte
            }),
        1 => (any::<usize>(), value()).prop_map(|(at, value)| Op::WriteOutput { at, value }),
        1 => prop::collection::vec(-2i64..200, 0..12).prop_map(|slots| Op::RewriteCache { slots }),
        1 => (0..40usize, pairs(), pairs())
            .prop_map(|(swap_blocks, out, back)| Op::SwapRoundTrip { swap_blocks, out, back }),
        1 => pairs().prop_map(|pairs| Op::CopyBlocks { pairs }),
        1 => Just(Op::CopyQueryIntoKey),
        1 => Just(Op::PreparedMut),
    ]
}

/// How the forward call itself is made hostile.
#[derive(Debug, Clone, Copy)]
enum Forward {
    /// As planned.
    AsPlanned,
    /// With a query one token longer than the plan's.
    LongerQuery,
    /// With the query in another dtype.
    OtherDtype,
    /// With a workspace reserved for an empty plan.
    EmptyWorkspace,
    /// Without the cache.
    NoCache,
}

fn forward() -> impl Strategy<Value = Forward> {
    prop_oneof![
        6 => Just(Forward::AsPlanned),
        1 => Just(Forward::LongerQuery),
        1 => Just(Forward::OtherDtype),
        1 => Just(Forward::EmptyWorkspace),
        1 => Just(Forward::NoCache),
    ]
}

/// What one backend answered: each operation's error (if any), then the forward's output
/// and the cache after it (canonical bytes), or its error.
#[derive(Debug)]
struct Answer {
    ops: Vec<Option<String>>,
    forward: Result<(Vec<f32>, Vec<u8>), Error>,
    /// Whether the plan asked for workspace memory (backends differ in that).
    needs_workspace: bool,
}

/// The variant and field of an error: what every backend must agree on.
fn kind(e: &Error) -> String {
    match e {
        Error::Invalid { field, .. } => format!("Invalid({field})"),
        other => format!("{other:?}")
            .split(['(', ' '])
            .next()
            .unwrap_or("")
            .to_string(),
    }
}

/// A host tensor of `dtype` with `t`'s shape and values (rounded).
fn as_dtype(t: &Tensor, dtype: DType) -> Tensor {
    Tensor::from_f32(dtype, t.shape(), &t.to_f32_vec().unwrap()).unwrap()
}

/// Writes `x` at element `at` (mod the length) of a writable view.
fn write(mut view: pagedattn::HostSliceMut<'_>, at: usize, x: f32, byte: u8) {
    if view.is_empty() {
        return;
    }
    let at = at % view.len();
    match &mut view {
        pagedattn::HostSliceMut::F32(v) => v[at] = x,
        pagedattn::HostSliceMut::F16(v) => v[at] = pagedattn::f16::from_f32(x),
        pagedattn::HostSliceMut::BF16(v) => v[at] = pagedattn::bf16::from_f32(x),
        pagedattn::HostSliceMut::U8(v) => v[at] = byte,
    }
}

/// Runs the case's operations and its forward on `backend`.
fn answer(
    paged: &DecoderPaged,
    backend: &dyn Backend,
    ops: &[Op],
    how: Forward,
) -> Result<Answer, TestCaseError> {
    let call = &paged.call;
    let mut cache = paged.cache(backend.kv_cache_layout())?;
    let attention = ok(backend.attention(&call.config), "attention")?;
    let mut plan = ok(attention.plan(&call.metadata, Some(cache.spec())), "plan")?;
    let mut workspace = ok(backend.workspace(&plan), "workspace")?;
    let mut query = call.query.try_clone().unwrap();
    let (mut key, mut value) = {
        let (k, v) = call.kv.as_ref().expect("decoder calls carry keys");
        (k.try_clone().unwrap(), v.try_clone().unwrap())
    };
    let mut output = Tensor::zeros(query.dtype(), query.shape()).unwrap();
    output.fill_nan().unwrap();
    let spec = *cache.spec();
    let mut results = Vec::new();
    for op in ops {
        let result: pagedattn::Result<()> = match op {
            Op::WriteQuery { at, value } => {
                write(query.host_mut().unwrap(), *at, value.get(), 0);
                Ok(())
            }
            Op::WriteNewKv {
                key: is_key,
                at,
                value: x,
            } => {
                let t = if *is_key { &mut key } else { &mut value };
                write(t.host_mut().unwrap(), *at, x.get(), 0);
                Ok(())
            }
            Op::WriteCache {
                key: is_key,
                slot,
                head,
                dim,
                value: x,
                byte,
            } => {
                let (slot, head, dim) = (
                    slot % spec.num_slots().max(1),
                    head % spec.num_kv_heads,
                    dim % spec.head_size,
                );
                let at = cache.row_start(slot, head) + dim;
                let (k, v) = cache.host_buffers_mut().unwrap();
                write(if *is_key { k } else { v }, at, x.get(), *byte);
                Ok(())
            }
            Op::WriteOutput { at, value: x } => {
                write(output.host_mut().unwrap(), *at, x.get(), 0);
                Ok(())
            }
            Op::RewriteCache { slots } => {
                let n = key.shape()[0].min(slots.len());
                let rows = |t: &Tensor| {
                    let row = t.shape()[1] * t.shape()[2];
                    let xs = t.to_f32_vec().unwrap();
                    tensor(t.dtype(), &[n, t.shape()[1], t.shape()[2]], &xs[..n * row])
                };
                cache.write(&rows(&key), &rows(&value), &slots[..n], call.scales)
            }
            Op::SwapRoundTrip {
                swap_blocks,
                out,
                back,
            } => backend
                .allocate_swap_space(&spec, *swap_blocks)
                .and_then(|swap| {
                    let mut swaps = [swap];
                    backend.swap_out(std::slice::from_ref(&cache), &mut swaps, out)?;
                    backend.swap_in(&swaps, std::slice::from_mut(&mut cache), back)
                }),
            Op::CopyBlocks { pairs } => {
                backend.copy_blocks(std::slice::from_mut(&mut cache), pairs)
            }
            Op::CopyQueryIntoKey => {
                let bytes = |t: &Tensor| t.host().unwrap().as_bytes().to_vec();
                let before = bytes(&key);
                let result = key.copy_from(&query);
                if result.is_err() {
                    prop_assert!(bytes(&key) == before, "a refused copy wrote");
                }
                result
            }
            Op::PreparedMut => {
                let result = plan.prepared_mut::<Vec<u64>>(backend.name()).map(drop);
                prop_assert!(result.is_err(), "prepared_mut handed out a Vec<u64>");
                result
            }
        };
        results.push(result.err().map(|e| kind(&e)));
    }
    let longer;
    let other;
    let query = match how {
        Forward::LongerQuery => {
            let mut shape = query.shape().to_vec();
            shape[0] += 1;
            longer = Tensor::zeros(query.dtype(), &shape).unwrap();
            &longer
        }
        Forward::OtherDtype => {
            let dtype = if query.dtype() == DType::F32 {
                DType::BF16
            } else {
                DType::F32
            };
            other = as_dtype(&query, dtype);
            &other
        }
        _ => &query,
    };
    if let Forward::EmptyWorkspace = how {
        workspace = Workspace::empty(backend.device());
    }
    let inputs = Inputs::new(query).with_kv_pair(Some(KvPair {
        key: &key,
        value: &value,
    }));
    let inputs = match how {
        Forward::NoCache => inputs,
        _ => inputs.with_cache(&mut cache),
    };
    let forward = attention
        .forward_into(&plan, &mut workspace, inputs, &mut output)
        .map(|()| {
            let out = output.to_f32_vec().unwrap();
            let (k, v) = cache.to_canonical().unwrap();
            let mut bytes = k.as_bytes().to_vec();
            bytes.extend_from_slice(v.as_bytes());
            (out, bytes)
        });
    Ok(Answer {
        ops: results,
        forward,
        needs_workspace: plan.workspace_bytes() > 0,
    })
}

/// The backends under test: `cpu` on every instruction set this machine has.
fn cpus() -> Vec<Cpu> {
    Isa::ALL
        .into_iter()
        .filter(|i| i.is_available())
        .map(|i| Cpu::with_isa(i).unwrap())
        .collect()
}

/// Whether `got` agrees with `want` as the contract's "Agreement between backends" says: the
/// same NaN / Inf classes and, where `values` (the call's inputs were all finite and modest),
/// finite elements within a loose tolerance of the largest finite reference value. (With
/// infinities in the inputs, an fp8 cache saturates them to its largest value, and the scores'
/// f32 rounding at that magnitude is within the contract's tolerance, which
/// `cpu_vs_reference` models, but beyond a fixed relative one.)
fn agrees(want: &[f32], got: &[f32], dtype: DType, values: bool) -> Result<(), String> {
    let scale = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(1.0f32, |m, x| m.max(x.abs()));
    let rel = match dtype {
        DType::F32 => 1e-3,
        DType::F16 => 1e-2,
        _ => 5e-2,
    };
    for (i, (&w, &g)) in want.iter().zip(got).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w || g.is_nan()
        } else {
            // Rounding may give Inf on one backend near the dtype's largest value.
            g.is_infinite() || g.is_finite() && (!values || (g - w).abs() <= rel * scale)
        };
        if !ok {
            return Err(format!("output element {i}: {g}, reference {w}"));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn hostile_calls_are_answered_alike_and_never_crash(
        case in decoder_case(),
        ops in prop::collection::vec(op(), 0..8),
        how in forward(),
    ) {
        let paged = DecoderPaged::build(&case)?;
        let reference = registry::backend("reference").unwrap();
        prop_assert_eq!(reference.kv_cache_layout(), CacheLayout::Nhd);
        let want = answer(&paged, &*reference, &ops, how)?;
        if matches!(how, Forward::LongerQuery | Forward::OtherDtype | Forward::NoCache) {
            prop_assert!(want.forward.is_err(), "reference ran a mismatched call");
        }
        let dtype = paged.call.query.dtype();
        let finite_inputs = case.settings.specials == 0.0
            && ops.iter().all(|op| match op {
                Op::WriteQuery { value, .. } | Op::WriteNewKv { value, .. } => {
                    matches!(value, Value::Finite(_))
                }
                // An fp8 cache gets an arbitrary code: its largest values or NaN.
                Op::WriteCache { value, .. } => {
                    matches!(value, Value::Finite(_))
                        && case.settings.kv_cache_dtype == pagedattn::KvCacheDtype::Auto
                }
                _ => true,
            });
        for cpu in cpus() {
            let isa = cpu.isa();
            let got = answer(&paged, &cpu, &ops, how)?;
            prop_assert_eq!(&got.ops, &want.ops, "isa {}: operations answered differently", isa);
            if let (Forward::EmptyWorkspace, true) = (how, got.needs_workspace) {
                // Backends need different workspaces: this one's plan needed one.
                let refused = got.forward.as_ref().err().map(kind);
                prop_assert_eq!(refused.as_deref(), Some("Invalid(workspace bytes)"), "isa {}", isa);
                continue;
            }
            match (&want.forward, &got.forward) {
                (Ok((wo, wc)), Ok((go, gc))) => {
                    prop_assert!(wc == gc, "isa {}: the caches differ after the call", isa);
                    if let Err(e) = agrees(wo, go, dtype, finite_inputs) {
                        return Err(TestCaseError::fail(format!("isa {isa}: {e}")));
                    }
                }
                (Err(w), Err(g)) => prop_assert_eq!(kind(w), kind(g), "isa {}", isa),
                (w, g) => {
                    return Err(TestCaseError::fail(format!(
                        "isa {isa}: forward {:?} where reference {:?}",
                        g.as_ref().map(drop),
                        w.as_ref().map(drop)
                    )))
                }
            }
        }
    }
}
