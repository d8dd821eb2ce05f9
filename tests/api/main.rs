//! One integration test binary; a module per feature.

// The shared conformance cases.
mod cases;
// Conformance cases through the pure projector.
mod projector;
// Property tests of the pure core (order, duplicates, decoder agreement, no panics).
mod properties;
// Random thread generator shared by property and convergence tests.
mod threads;
