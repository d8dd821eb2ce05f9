//! What the allocator hands out for a request: the cache's weights count each allocation as jemalloc (the
//! worker's allocator, `src/main.rs`) rounds it, so that the byte budget means resident memory
//! ([design 2](../docs/design.md#2)).

/// The bytes jemalloc allocates for a request of `n` bytes: its size classes, 8 and 16 bytes, then four per
/// doubling (spaced at least 16 bytes apart). 0 for no allocation.
pub fn allocated(n: usize) -> usize {
    match n {
        0 => 0,
        1..=8 => 8,
        _ => {
            // A power of two: rounding up is a mask, not a division (the weigher runs this per live event).
            let spacing = (n.next_power_of_two() / 8).max(16);
            (n + spacing - 1) & !(spacing - 1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::allocated;

    #[test]
    fn requests_round_up_to_jemallocs_size_classes() {
        let classes = [
            (1, 8),
            (8, 8),
            (9, 16),
            (17, 32),
            (33, 48),
            (49, 64),
            (65, 80),
            (112, 112),
            (113, 128),
            (129, 160),
            (257, 320),
            (1025, 1280),
            (1792, 1792),
            (1793, 2048),
            (5000, 5120),
            (1 << 20, 1 << 20),
        ];
        for (request, class) in classes {
            assert_eq!(allocated(request), class, "a request of {request} bytes");
        }
        assert_eq!(allocated(0), 0);
    }
}
