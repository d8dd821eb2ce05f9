//! Fuzz target: [`checks::row`] over raw bytes.
#![no_main]

#[path = "../checks.rs"]
#[allow(dead_code, reason = "each target runs one of the checks")]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::row(data));
