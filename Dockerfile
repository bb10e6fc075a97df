# outboxd in a container: built with the Rust toolchain, run from a slim Debian image.
# docker-compose.yml beside this file runs it with PostgreSQL and Mailpit.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin outboxd --example demo

FROM debian:bookworm-slim
# ca-certificates: the TLS roots for smtps:// and STARTTLS relays and https webhooks.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/outboxd /usr/local/bin/outboxd
# The newcomer's demo (docker-compose.yml runs it once, beside the worker).
COPY --from=build /src/target/release/examples/demo /usr/local/bin/outboxd-demo
USER nobody
# Migrations are idempotent and safe to run from several workers at once.
CMD ["sh", "-c", "outboxd migrate && exec outboxd run"]
