# syntax=docker/dockerfile:1
# The image the Helm chart names (helm/chat-history-view, image.repository):
#   docker build -t ghcr.io/aihub/chat-history-view:0.1.0 .
#
# Two stages: a Rust toolchain builds the release binary from the locked dependency set, and a
# distroless runtime (glibc and libgcc only: no shell, no package manager) runs it as the
# non-root user 65532. The builder is Debian bookworm so its glibc matches the runtime's.

ARG RUST_VERSION=1

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
# The cache mounts keep the registry and target/ between builds (BuildKit); the binary is copied
# out of target/ inside the same step because a cache mount is not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked --bin chat-history-view \
    && install -D -m 0755 target/release/chat-history-view /out/chat-history-view

FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="chat-history-view" \
      org.opencontainers.image.description="Chat history views of aihub threads: NATS display events in, history over HTTP" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/chat-history-view /usr/local/bin/chat-history-view
# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 65532:65532
# History API, /healthz, /readyz and /metrics.
EXPOSE 8080
ENV HISTORY_VIEW_LOG_FORMAT=json \
    HISTORY_VIEW_LISTEN=0.0.0.0:8080
ENTRYPOINT ["/usr/local/bin/chat-history-view"]
