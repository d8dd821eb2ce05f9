#!/usr/bin/env bash
# Runs the decoders' fuzz targets (fuzz/, cargo-fuzz with libFuzzer, stable toolchain: no sanitizer, the crate has
# no unsafe code) one after the other, each bounded by FUZZ_SECS seconds (default 60) or, when set, FUZZ_RUNS
# inputs. Each run grows fuzz/corpus/<target>/ (merged back to a minimal set at the end) and leaves libFuzzer's
# final statistics in fuzz/stats/<target>.txt. A finding stops the script with libFuzzer's report; its input is
# in fuzz/artifacts/<target>/. FUZZ_TARGETS picks targets (default: all four).
#
#   scripts/fuzz.sh                        # 60 s per target
#   FUZZ_RUNS=10000000 scripts/fuzz.sh     # the recorded runs (docs/fuzzing.md)
set -euo pipefail
cd "$(dirname "$0")/.."

targets="${FUZZ_TARGETS:-subject payload row same_event}"
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi
cargo fuzz build --sanitizer none
bin="fuzz/target/$(rustc -vV | sed -n 's/^host: //p')/release"

mkdir -p fuzz/stats
for target in $targets; do
    corpus="fuzz/corpus/$target"
    mkdir -p "$corpus" "fuzz/artifacts/$target"
    if [[ -n "${FUZZ_RUNS:-}" ]]; then bound=(-runs="$FUZZ_RUNS"); else bound=(-max_total_time="${FUZZ_SECS:-60}"); fi
    echo "==> fuzz $target (${bound[*]})" >&2
    # -timeout and -rss_limit_mb make slow or memory-hungry inputs findings: the work per input is bounded.
    "$bin/$target" "$corpus" "${bound[@]}" -dict=fuzz/decoders.dict -max_len=8192 -timeout=2 \
        -rss_limit_mb=1024 -print_final_stats=1 -artifact_prefix="fuzz/artifacts/$target/" \
        2> >(tee "fuzz/stats/$target.log" >&2)
    grep -E '^(stat::|Done )' "fuzz/stats/$target.log" > "fuzz/stats/$target.txt" || true
    rm -f "fuzz/stats/$target.log"
    # Keep only the inputs that add coverage.
    merged="$(mktemp -d)"
    "$bin/$target" -merge=1 "$merged" "$corpus" >/dev/null 2>&1
    rm -rf "$corpus" && mv "$merged" "$corpus"
done
