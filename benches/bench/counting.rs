//! The bench's global allocator: jemalloc, as the worker's (`src/main.rs`), counting per OS thread the bytes held
//! (the usable size jemalloc gave each allocation, less what that thread freed). P5's breakdown builds views on one
//! thread and reads how many bytes they hold from it ([`held`]).

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;

use tikv_jemallocator::Jemalloc;

pub struct Counting;

thread_local! {
    static HELD: Cell<isize> = const { Cell::new(0) };
}

fn count(ptr: *mut u8, sign: isize) {
    if !ptr.is_null() {
        // SAFETY: `ptr` was just returned by jemalloc (or is about to be freed by it) and is live.
        let usable = unsafe { tikv_jemallocator::usable_size(ptr) } as isize;
        // A thread being torn down has no counter left: its bytes are not counted.
        let _ = HELD.try_with(|held| held.set(held.get() + sign * usable));
    }
}

// SAFETY: every call is forwarded to jemalloc unchanged; the counting only reads the sizes of live allocations.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { Jemalloc.alloc(layout) };
        count(ptr, 1);
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { Jemalloc.alloc_zeroed(layout) };
        count(ptr, 1);
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(ptr, -1);
        unsafe { Jemalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(ptr, -1);
        let new = unsafe { Jemalloc.realloc(ptr, layout, new_size) };
        // A failed realloc leaves the old allocation in place.
        count(if new.is_null() { ptr } else { new }, 1);
        new
    }
}

/// The bytes the calling thread holds: allocated by it and not freed by it since it started.
pub fn held() -> isize {
    HELD.with(Cell::get)
}
