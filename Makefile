# Custodian developer/CI entry points. `make test` is what CI runs.

# The service's least-privileged login, and the schema owner that only `custodian migrate` uses.
CUSTODIAN_DATABASE_URL ?= postgres://custodian_app@127.0.0.1:5432/custodian
CUSTODIAN_MIGRATE_DATABASE_URL ?= postgres://custodian_owner@127.0.0.1:5432/custodian
CUSTODIAN_ANVIL        ?= $(CURDIR)/.tools/bin/anvil
CUSTODIAN_SOLCJS       ?= $(CURDIR)/.tools/bin/solcjs
export CUSTODIAN_DATABASE_URL CUSTODIAN_MIGRATE_DATABASE_URL CUSTODIAN_ANVIL CUSTODIAN_SOLCJS

# Project tools (anvil, solcjs) and rustup's cargo on PATH for every recipe.
export PATH := $(CURDIR)/.tools/bin:$(HOME)/.cargo/bin:$(PATH)

PSQL := psql -X -w -h 127.0.0.1 -p 5432 -U postgres -d postgres

.PHONY: setup test demo bench standby standby-remove clean-test-dbs

setup:
	bash scripts/setup.sh

test: setup
	cargo test --workspace --locked
	# Every bench once, small where it has a size and unoptimised: a bench that stops working (its
	# fixtures out of step with the schema, say) fails here rather than in `make bench` days later.
	# The figures it prints at this size mean nothing.
	LEDGER_DEPOSITS=1000 LEDGER_ACCOUNTS=100 BACKFILL_BLOCKS=20 ANVIL_BLOCKS=10 WORKER_BURST=20 \
		cargo test --locked --bench '*'
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings

demo: setup
	cargo run --locked --features demo -- demo

bench: setup
	cargo bench --workspace --locked --no-fail-fast

# A synchronous standby of the local server (5432) in .pgdata/standby on 5433; the ledger database
# commits with synchronous_commit = remote_apply. Connect with
# postgres://custodian_app@127.0.0.1:5432,127.0.0.1:5433/custodian?target_session_attrs=read-write
standby: setup
	bash scripts/pg_standby.sh standby $(CURDIR)/.pgdata/standby 5433 5432 custodian

# Undo `make standby`: the local server commits locally again.
standby-remove:
	bash scripts/pg_standby.sh remove $(CURDIR)/.pgdata/standby 5432 custodian

# Drop the per-test databases (custodian_t_*) that tests leave behind.
clean-test-dbs:
	@$(PSQL) -tAc "select datname from pg_database where datname like 'custodian\_t\_%'" | \
	while read -r db; do \
		[ -n "$$db" ] || continue; \
		echo "dropping $$db"; \
		$(PSQL) -qc "drop database if exists \"$$db\" with (force)"; \
	done
