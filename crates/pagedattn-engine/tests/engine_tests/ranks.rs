//! An engine of several ranks, without a GPU: every rank a full copy of the synthetic model
//! on `cpu` (no collective joins them, so each computes the whole step). What this checks is
//! the tensor-parallel engine's part that needs no NCCL: one scheduler and block manager for
//! all ranks, every rank's caches moved alike (swaps, copies), every rank's calls verified,
//! rank 0's tokens the step's, and a rank's failure stopping every rank with its error.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagedattn::registry;
use pagedattn_engine::harness::verify::{Verifier, VerifyMode};
use pagedattn_engine::harness::workload::Builtin;
use pagedattn_engine::models::synthetic::SyntheticConfig;
use pagedattn_engine::serving::engine::{
    AbortRanks, Engine, EngineConfig, EngineRequest, RankParts,
};
use pagedattn_engine::serving::model::{Model, ModelKind};
use pagedattn_engine::serving::report::Report;
use pagedattn_engine::serving::scheduler::PreemptionPolicy;

use crate::common::{self, generated, requests, small, ForwardHook, Hooked};

/// Serves `reqs` on `ranks` copies of `model` on `cpu`, every call verified.
fn serve_on_ranks(
    model: &SyntheticConfig,
    ranks: usize,
    reqs: Vec<EngineRequest>,
    blocks: usize,
    policy: PreemptionPolicy,
) -> Report {
    let backends: Vec<_> = (0..ranks)
        .map(|_| registry::backend("cpu").unwrap())
        .collect();
    let parts = backends
        .iter()
        .map(|b| RankParts {
            backend: b.as_ref(),
            model: model.build_model().unwrap(),
        })
        .collect();
    let mut config = common::config(blocks, 256);
    config.scheduler.preemption = policy;
    let engine = Engine::with_ranks(parts, None, &config)
        .unwrap()
        .with_check(Box::new(Verifier::new(VerifyMode::Every, 1).unwrap()));
    assert_eq!(engine.num_ranks(), ranks);
    engine
        .run("ranks", reqs, &AtomicBool::new(false), &mut |_, _, _| {})
        .unwrap()
}

#[test]
fn two_ranks_move_every_block_alike_and_give_one_ranks_tokens() {
    let model = SyntheticConfig {
        max_context: 200,
        ..small(ModelKind::Decoder)
    };
    let reqs = requests(&model.build().unwrap(), Builtin::Chat, 10, 48, 3);
    let one = serve_on_ranks(&model, 1, reqs.clone(), 512, PreemptionPolicy::Auto);
    for policy in [PreemptionPolicy::Swap, PreemptionPolicy::Recompute] {
        // A pool of 16 blocks preempts: swaps (or recomputes) and copy-on-write of the
        // parallel samples run on both ranks, and every call of both is verified against
        // the rank's own cache.
        let two = serve_on_ranks(&model, 2, reqs.clone(), 16, policy);
        let preempted = two.cache.preempted_by_swap + two.cache.preempted_by_recompute;
        assert!(preempted > 0, "{policy:?}: nothing preempted");
        assert_eq!(generated(&two), generated(&one), "{policy:?}");
        assert_eq!(two.verify.calls_checked, two.verify.calls_total);
        assert!(two.verify.calls_total > one.verify.calls_total);
    }
}

/// An engine of `hooks.len()` CPU ranks of `model`, rank i's forwards preceded by `hooks[i]`,
/// without graphs, `abort` its abort hook.
fn hooked_engine<'a>(
    backends: &'a [Box<dyn pagedattn::Backend>],
    model: &SyntheticConfig,
    hooks: Vec<ForwardHook>,
    abort: AbortRanks,
) -> Engine<'a> {
    let parts = backends
        .iter()
        .zip(hooks)
        .map(|(b, hook)| RankParts {
            backend: b.as_ref(),
            model: Box::new(Hooked {
                inner: model.build_model().unwrap(),
                hook,
                calls: 0,
            }) as Box<dyn Model>,
        })
        .collect();
    let config = EngineConfig {
        cuda_graphs: false,
        ..common::config(64, 256)
    };
    Engine::with_ranks(parts, Some(abort), &config).unwrap()
}

#[test]
fn a_failing_rank_stops_every_rank_with_its_error() {
    let model = small(ModelKind::Decoder);
    let reqs = requests(&model.build().unwrap(), Builtin::Chat, 4, 8, 5);
    let backends: Vec<_> = (0..2).map(|_| registry::backend("cpu").unwrap()).collect();
    let aborted = Arc::new(AtomicBool::new(false));
    let aborts = Arc::new(AtomicUsize::new(0));
    let abort: AbortRanks = {
        let (aborted, aborts) = (aborted.clone(), aborts.clone());
        Arc::new(move || {
            aborts.fetch_add(1, Ordering::SeqCst);
            aborted.store(true, Ordering::SeqCst);
        })
    };
    let calls: Vec<_> = (0..2).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    // At the third step rank 1 fails while rank 0 waits in its collective until the engine
    // aborts the ranks, as an NCCL collective waits for a rank that never comes.
    let hook = |rank: usize| -> ForwardHook {
        let (calls, aborted) = (calls[rank].clone(), aborted.clone());
        Box::new(move |call| {
            calls.fetch_add(1, Ordering::SeqCst);
            if call != 2 {
                return Ok(());
            }
            if rank == 1 {
                return Err(pagedattn_engine::Error::Model(
                    "rank 1's device failed".into(),
                ));
            }
            let start = Instant::now();
            while !aborted.load(Ordering::SeqCst) {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "rank 0 was never released"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(pagedattn_engine::Error::Model(
                "rank 0's collective was aborted".into(),
            ))
        })
    };
    let engine = hooked_engine(&backends, &model, vec![hook(0), hook(1)], abort);
    let err = engine
        .run("failing", reqs, &AtomicBool::new(false), &mut |_, _, _| {})
        .unwrap_err()
        .to_string();
    // Rank 1's failure must abort rank 0 (else this test would time out inside rank 0), and
    // the error is rank 1's.
    assert!(err.contains("rank 1's device failed"), "{err}");
    assert!(aborts.load(Ordering::SeqCst) >= 1);
    assert!(calls[1].load(Ordering::SeqCst) == 3);
}

#[test]
fn ranks_that_serve_different_models_are_refused() {
    let backends: Vec<_> = (0..2).map(|_| registry::backend("cpu").unwrap()).collect();
    let models = [
        small(ModelKind::Decoder),
        SyntheticConfig {
            vocab: 300,
            ..small(ModelKind::Decoder)
        },
    ];
    let parts = backends
        .iter()
        .zip(&models)
        .map(|(b, m)| RankParts {
            backend: b.as_ref(),
            model: m.build_model().unwrap(),
        })
        .collect();
    let err = Engine::with_ranks(parts, None, &common::config(64, 256))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("rank 1 serves another model than rank 0"),
        "{err}"
    );
}

/// Ranks that all wait in a "collective" that never completes (no rank fails of itself) are
/// aborted by the engine's watchdog once the step runs past the rank timeout, and the run
/// fails saying so instead of hanging.
#[test]
fn a_step_whose_ranks_all_wait_is_aborted_at_the_rank_timeout() {
    let model = small(ModelKind::Decoder);
    let reqs = requests(&model.build().unwrap(), Builtin::Chat, 2, 4, 5);
    let backends: Vec<_> = (0..2).map(|_| registry::backend("cpu").unwrap()).collect();
    let aborted = Arc::new(AtomicBool::new(false));
    let abort: AbortRanks = {
        let aborted = aborted.clone();
        Arc::new(move || aborted.store(true, Ordering::SeqCst))
    };
    let hooks = (0..2)
        .map(|_| {
            let aborted = aborted.clone();
            Box::new(move |call: usize| {
                if call < 1 {
                    return Ok(());
                }
                let start = Instant::now();
                while !aborted.load(Ordering::SeqCst) {
                    assert!(start.elapsed() < Duration::from_secs(30), "never aborted");
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(pagedattn_engine::Error::Model("collective aborted".into()))
            }) as ForwardHook
        })
        .collect();
    let start = Instant::now();
    let err = hooked_engine(&backends, &model, hooks, abort)
        .with_rank_timeout(Duration::from_millis(300))
        .run("stuck", reqs, &AtomicBool::new(false), &mut |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ran past the ranks' timeout of 300ms"),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
}
