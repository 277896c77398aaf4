//! `cpu`, on every instruction set this machine has, against `reference` on random valid
//! calls ([`pagedattn_fuzz::gen`]) with NaN and ±Inf injected where the input says: the same
//! errors, the same cache bytes, and every output element in the contract's agreement
//! (`docs/semantics.md`, "Agreement between backends").

#![no_main]

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use pagedattn_fuzz::{compare_backends, fail, gen, Answer, Rows};

fuzz_target!(|data: &[u8]| {
    let Ok(call) = gen::valid_call(&mut Unstructured::new(data)) else {
        return;
    };
    match compare_backends(&call.case, Rows::All) {
        Ok(Answer::Ran(_)) => {}
        Ok(Answer::Refused(e)) => fail(
            &call.case,
            &format!("every backend refused a valid call: {e}; {}", call.summary),
        ),
        Err(mismatch) => fail(&call.case, &format!("{mismatch}; {}", call.summary)),
    }
});
