//! Fuzz target: [`checks::same_event`] over a generated event.
#![no_main]

#[path = "../checks.rs"]
#[allow(dead_code, reason = "each target runs one of the checks")]
mod checks;

libfuzzer_sys::fuzz_target!(|event: checks::Event| checks::same_event(&event));
