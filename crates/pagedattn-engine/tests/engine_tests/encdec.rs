//! Encoder-only and encoder-decoder requests end to end on the synthetic model: both built-in
//! workloads verified call by call against `reference` on `cpu` and `reference`, no block
//! leaked, preemption (swap and recompute) changing no greedy token; and the scheduler's cross
//! blocks (allocated at admission, written once, swapped with the request, freed at finish).

use pagedattn_engine::harness::verify::VerifyMode;
use pagedattn_engine::harness::workload::Builtin;
use pagedattn_engine::models::synthetic::SyntheticConfig;
use pagedattn_engine::serving::blocks::BlockConfig;
use pagedattn_engine::serving::engine::EngineRequest;
use pagedattn_engine::serving::model::ModelKind;
use pagedattn_engine::serving::scheduler::{
    PreemptionPolicy, RequestSpec, Sampled, Scheduler, SchedulerConfig, StepEvent,
};

use crate::common;

use common::{preemption_changes_nothing, requests, serve, small};

#[test]
fn encoder_and_encoder_decoder_workloads_complete_verified_on_cpu_and_reference() {
    let mut pooled = Vec::new();
    for backend in ["cpu", "reference"] {
        let model = small(ModelKind::EncoderOnly);
        let reqs = requests(
            model.build_model().unwrap().as_ref(),
            Builtin::Encoder,
            8,
            64,
            3,
        );
        let report = serve(
            backend,
            &model,
            reqs.clone(),
            (64, 1024),
            PreemptionPolicy::Auto,
            VerifyMode::Every,
        );
        assert_eq!(report.verify.calls_checked, report.verify.calls_total);
        assert!(report.verify.calls_checked >= 2, "{backend}");
        for (r, q) in report.requests.iter().zip(&reqs) {
            assert!(r.rejected.is_none() && r.finished.is_some(), "{backend}");
            assert_eq!(r.generated_tokens(), 0);
            assert_eq!(r.prompt_tokens, q.prompt.len());
            let p = r.pooled.as_ref().expect("a pooled state");
            assert_eq!(p.len(), model.hidden);
            assert!(p.iter().all(|x| x.is_finite()));
        }
        pooled.push(
            report
                .requests
                .iter()
                .map(|r| r.pooled.clone().unwrap())
                .collect::<Vec<_>>(),
        );

        let model = small(ModelKind::EncoderDecoder);
        let reqs = requests(
            model.build_model().unwrap().as_ref(),
            Builtin::EncoderDecoder,
            6,
            64,
            3,
        );
        let want: usize = reqs.iter().map(|r| r.max_new_tokens).sum();
        let report = serve(
            backend,
            &model,
            reqs,
            (256, 1024),
            PreemptionPolicy::Auto,
            VerifyMode::Every,
        );
        assert!(report.requests.iter().all(|r| r.rejected.is_none()));
        assert!(report
            .requests
            .iter()
            .all(|r| r.encoder_prompt_tokens >= 32));
        // No stop token: every request runs to its length.
        assert_eq!(report.generated_tokens(), want, "{backend}");
        assert_eq!(report.verify.calls_checked, report.verify.calls_total);
        // Per step at least each decoder layer's self- and cross-attention.
        assert!(report.verify.calls_checked >= 4 * report.steps.len());
    }
    // The same states on both backends, to bf16's precision through two layers.
    for (a, b) in pooled[0].iter().zip(&pooled[1]) {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 0.05 * scale, "{worst} of {scale}");
    }
}

#[test]
fn preemption_of_encoder_decoder_requests_changes_no_greedy_token() {
    let model = SyntheticConfig {
        max_context: 300,
        ..small(ModelKind::EncoderDecoder)
    };
    let reqs: Vec<EngineRequest> = requests(
        model.build_model().unwrap().as_ref(),
        Builtin::EncoderDecoder,
        10,
        64,
        3,
    )
    .into_iter()
    .map(|r| EngineRequest {
        max_new_tokens: 48,
        ..r
    })
    .collect();
    // The longest request (encoder of up to 299 tokens: 19 cross blocks, 4 decoder blocks)
    // fits alone in 32 blocks; two or three run at a time.
    for (policy, tight) in preemption_changes_nothing(&model, &reqs, (512, 32), 1024) {
        if policy == PreemptionPolicy::Swap {
            assert!(tight.cache.preempted_by_swap > 0 && tight.cache.blocks_swapped_in > 0);
        }
    }
}

#[test]
fn requests_that_do_not_fit_the_model_kind_are_rejected_with_the_reason() {
    let model = small(ModelKind::EncoderDecoder);
    let mut reqs = requests(
        model.build_model().unwrap().as_ref(),
        Builtin::EncoderDecoder,
        2,
        64,
        3,
    );
    reqs[1].encoder_prompt = None;
    let report = serve(
        "cpu",
        &model,
        reqs.clone(),
        (64, 1024),
        PreemptionPolicy::Auto,
        VerifyMode::Off,
    );
    assert!(report.requests[0].rejected.is_none());
    assert_eq!(
        report.requests[1].rejected.as_deref(),
        Some("request 1 rejected: encoder_prompt = none: expected the encoder's tokens (the model is encoder-decoder)")
    );
    let decoder = small(ModelKind::Decoder);
    reqs[1].encoder_prompt = Some(vec![1, 2, 3]);
    let report = serve(
        "cpu",
        &decoder,
        reqs[1..].to_vec(),
        (64, 1024),
        PreemptionPolicy::Auto,
        VerifyMode::Off,
    );
    assert_eq!(
        report.requests[0].rejected.as_deref(),
        Some("request 0 rejected: encoder_prompt = 3 tokens: expected none (only an encoder-decoder model takes one)")
    );
}

/// A scheduler of `blocks` device and host blocks of 4 tokens, no prefix caching.
fn scheduler(blocks: usize, policy: PreemptionPolicy) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        max_batched_tokens: 64,
        max_seqs: 8,
        preemption: policy,
        blocks: BlockConfig {
            block_size: 4,
            num_device_blocks: blocks,
            num_host_blocks: blocks,
            prefix_caching: false,
            sliding_window: None,
            watermark_blocks: 0,
        },
    })
    .unwrap()
}

/// Finishes the step in flight, sampling token 1 for every sample asked.
fn finish(
    s: &mut Scheduler,
    batch: &pagedattn_engine::serving::batch::StepBatch,
) -> Vec<StepEvent> {
    let results: Vec<Sampled> = batch
        .seqs
        .iter()
        .map(|q| Sampled {
            seq: q.seq,
            tokens: vec![1; q.num_samples],
        })
        .collect();
    let events = s.finish_step(&results).unwrap();
    s.blocks().check().unwrap();
    events
}

#[test]
fn cross_blocks_are_allocated_at_admission_written_once_and_freed_at_finish() {
    let mut s = scheduler(16, PreemptionPolicy::Swap);
    // 10 encoder tokens: 3 cross blocks; prompt 2 + 3 new tokens: 2 decoder blocks.
    s.add_request(RequestSpec::new(0, vec![5, 6], 3).encoder_prompt((0..10).collect()))
        .unwrap();
    let batch = s.schedule().unwrap();
    assert_eq!(s.blocks().free_device_blocks(), 16 - 3 - 1);
    let seq = &batch.seqs[0];
    let cross = seq.cross.as_ref().expect("cross side");
    assert_eq!(cross.len, 10);
    assert_eq!(cross.block_table.len(), 3);
    assert_eq!(
        cross.encoder_tokens.as_deref(),
        Some(&(0..10).collect::<Vec<u32>>()[..])
    );
    assert!(cross
        .block_table
        .iter()
        .all(|b| !seq.block_table.contains(b)));
    let table = cross.block_table.clone();
    finish(&mut s, &batch);
    // Later steps read the cross cache: same blocks, no encoder run.
    let mut finished = false;
    while !finished {
        let batch = s.schedule().unwrap();
        let cross = batch.seqs[0].cross.as_ref().expect("cross side");
        assert_eq!(
            (cross.block_table.clone(), cross.encoder_tokens.clone()),
            (table.clone(), None)
        );
        finished = finish(&mut s, &batch)
            .iter()
            .any(|e| matches!(e, StepEvent::Finished { .. }));
    }
    assert_eq!(s.blocks().free_device_blocks(), 16, "cross blocks freed");
}

#[test]
fn cross_blocks_swap_with_their_request_and_are_recomputed_with_it() {
    for policy in [PreemptionPolicy::Swap, PreemptionPolicy::Recompute] {
        // Two requests of 3 cross blocks and 1 full decoder block each fill 8 blocks; the
        // first one's first decode needs a block, so the second is preempted.
        let mut s = scheduler(8, policy);
        for id in 0..2 {
            s.add_request(
                RequestSpec::new(id, vec![5, 6, 7, 8], 8).encoder_prompt((0..12).collect()),
            )
            .unwrap();
        }
        let batch = s.schedule().unwrap();
        assert_eq!(batch.seqs.len(), 2);
        assert_eq!(s.blocks().free_device_blocks(), 0);
        finish(&mut s, &batch);
        let batch = s.schedule().unwrap();
        match policy {
            PreemptionPolicy::Swap => {
                // The victim's decoder block and its 3 cross blocks go out together.
                assert_eq!(batch.swap_out.len(), 4);
                assert_eq!(s.blocks().free_host_blocks(), 4);
            }
            _ => assert!(batch.swap_out.is_empty()),
        }
        finish(&mut s, &batch);
        // Run to the end: the victim comes back (swapped in with its cross blocks, or
        // admitted again with its encoder run again) and both finish.
        let (mut done, mut encoder_runs, mut swapped_in) = (0, 0, 0);
        for _ in 0..64 {
            let batch = s.schedule().unwrap();
            swapped_in += batch.swap_in.len();
            encoder_runs += batch
                .seqs
                .iter()
                .filter(|q| q.cross.as_ref().is_some_and(|c| c.encoder_tokens.is_some()))
                .count();
            done += finish(&mut s, &batch)
                .iter()
                .filter(|e| matches!(e, StepEvent::Finished { .. }))
                .count();
            if done == 2 {
                break;
            }
        }
        assert_eq!(done, 2, "{policy:?}");
        match policy {
            PreemptionPolicy::Swap => assert_eq!((swapped_in, encoder_runs), (4, 0)),
            _ => assert_eq!((swapped_in, encoder_runs), (0, 1)),
        }
        assert_eq!(s.blocks().free_device_blocks(), 8);
        assert_eq!(s.blocks().free_host_blocks(), 8);
    }
}

#[test]
fn encoder_requests_are_refused_what_they_cannot_have() {
    let mut s = scheduler(16, PreemptionPolicy::Swap);
    let err = |s: &mut Scheduler, spec| s.add_request(spec).unwrap_err().to_string();
    assert_eq!(
        err(&mut s, RequestSpec::encode(0, vec![1; 65])),
        "request 0 rejected: prompt = 65 tokens: expected at most max_batched_tokens = 64 (an encoder-only prompt is computed in one step)"
    );
    assert_eq!(
        err(&mut s, RequestSpec::new(0, vec![1], 2).encoder_prompt(vec![1; 64])),
        "request 0 rejected: encoder_prompt = 64 tokens: expected in [1, 63] (the encoder runs in one step with at least one decoder token, under max_batched_tokens = 64)"
    );
    assert!(err(
        &mut s,
        RequestSpec::new(0, vec![1], 2).encoder_prompt(vec![1; 61])
    )
    .contains("at most 16 device blocks of 4 tokens in all (17 needed)"));
    // An encoder-only request takes no block and finishes in its one step, with no sample.
    s.add_request(RequestSpec::encode(1, vec![3; 40])).unwrap();
    let batch = s.schedule().unwrap();
    assert!(batch.seqs[0].encoder_only && batch.seqs[0].block_table.is_empty());
    assert_eq!(s.blocks().free_device_blocks(), 16);
    let events = finish(&mut s, &batch);
    assert_eq!(
        events,
        vec![StepEvent::Finished {
            request: 1,
            samples: Vec::new()
        }]
    );
    assert!(!s.has_unfinished());
}

#[test]
fn an_encoder_prompt_is_refused_with_prefix_caching_on() {
    let mut config = scheduler(16, PreemptionPolicy::Swap).config().clone();
    config.blocks.prefix_caching = true;
    let mut s = Scheduler::new(config).unwrap();
    let e = s
        .add_request(RequestSpec::new(0, vec![1], 2).encoder_prompt(vec![1; 8]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("none while prefix caching is on"), "{e}");
}
