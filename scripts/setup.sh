#!/usr/bin/env bash
# Developer/CI bootstrap for Custodian. Idempotent: prints one line per action
# it takes, and a single "setup: ok" line when there was nothing to do.
#
#   - PostgreSQL answering on 127.0.0.1:5432; the roles of scripts/roles.sql
#     (custodian_owner, custodian_app, custodian_service, custodian_reader);
#     database "custodian" owned by custodian_owner
#   - local development only: loopback connections of postgres and of the
#     custodian roles are trusted (no password); nothing else is
#   - anvil (npm @foundry-rs/anvil-linux-amd64) -> .tools/bin/anvil
#   - solc-js (npm solc)                      -> .tools/bin/solcjs
#   - checks that a Rust toolchain (cargo, rustfmt, clippy) is present
set -euo pipefail

ANVIL_VERSION=1.7.1
SOLC_VERSION=0.8.37
PG_HOST=127.0.0.1
PG_PORT=5432
DB_NAME=custodian
PG_WAIT_SECONDS=30

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$ROOT/.tools"

log() { echo "setup: $*"; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    SUDO=()
fi

# Run a command as root (directly, or through sudo when not root).
as_root() {
    if [ "$(id -u)" -ne 0 ] && [ "${#SUDO[@]}" -eq 0 ]; then
        die "need root (or sudo) to run: $*"
    fi
    "${SUDO[@]}" "$@"
}

# as_postgres: run a command as the postgres OS user (peer auth over the local socket).
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

APT_UPDATED=0
apt_install() {
    if [ "$APT_UPDATED" -eq 0 ]; then
        log "apt-get update"
        as_root apt-get update -qq >/dev/null
        APT_UPDATED=1
    fi
    log "apt-get install $*"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# ---------------------------------------------------------------- PostgreSQL

export PGCONNECT_TIMEOUT=5
pg_ready() { pg_isready -q -h "$PG_HOST" -p "$PG_PORT" >/dev/null 2>&1; }
# psql over TCP as postgres, never prompting for a password.
pg_sql() { psql -X -w -q -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -tA "$@"; }
pg_version() { ls /etc/postgresql 2>/dev/null | sort -V | tail -1; }
pg_has_cluster() {
    local v
    v="$(pg_version)"
    [ -n "$v" ] && [ -f "/etc/postgresql/$v/main/postgresql.conf" ]
}

ensure_postgres() {
    if ! command -v pg_isready >/dev/null 2>&1 || ! pg_ready; then
        if ! pg_has_cluster; then
            # No server cluster (maybe only the client is installed).
            apt_install postgresql
            if ! pg_has_cluster; then
                local v
                v="$(ls /usr/lib/postgresql | sort -V | tail -1)"
                [ -n "$v" ] || die "postgresql installed but no server version found in /usr/lib/postgresql"
                log "creating PostgreSQL cluster $v/main"
                as_root pg_createcluster "$v" main >/dev/null
            fi
        fi
        local v
        v="$(pg_version)"
        # The package install may already have started it.
        if ! pg_ready; then
            if pg_lsclusters -h 2>/dev/null | awk -v v="$v" '$1==v && $2=="main" {print $4}' | grep -q online; then
                log "PostgreSQL $v/main is running; waiting for it on $PG_HOST:$PG_PORT"
            else
                log "starting PostgreSQL cluster $v/main"
                as_root pg_ctlcluster --skip-systemctl-redirect "$v" main start
            fi
        fi
        local deadline=$((SECONDS + PG_WAIT_SECONDS))
        until pg_ready; do
            if [ "$SECONDS" -ge "$deadline" ]; then
                die "PostgreSQL not answering on $PG_HOST:$PG_PORT after ${PG_WAIT_SECONDS}s (see /var/log/postgresql/)"
            fi
            sleep 0.5
        done
    fi

    # Development trusts loopback connections of exactly these roles: the set-up and the tests'
    # superuser checks (postgres), the schema owner, the service's login and finance's reader.
    # Every other role, and every other address, keeps the cluster's own rules.
    local trusted="postgres,custodian_owner,custodian_app,custodian_reader"
    if ! pg_sql -c 'select 1' >/dev/null 2>&1 \
        || ! psql -X -w -q -h "$PG_HOST" -p "$PG_PORT" -U custodian_app -d postgres -c 'select 1' >/dev/null 2>&1; then
        local hba marker="# custodian: trust loopback for local development (these roles only)"
        hba="$(as_postgres psql -X -tAc 'show hba_file')" \
            || die "cannot connect as postgres over TCP, nor over the local socket to fix pg_hba.conf"
        if ! as_root grep -qF "$marker" "$hba"; then
            log "pg_hba.conf: trusting $trusted on 127.0.0.1/32 and ::1/128 ($hba)"
            local tmp
            tmp="$(mktemp)"
            {
                echo "$marker"
                echo "host    all    $trusted    127.0.0.1/32    trust"
                echo "host    all    $trusted    ::1/128         trust"
                as_root cat "$hba"
            } >"$tmp"
            as_root cp "$tmp" "$hba"   # cp keeps the file's owner and mode
            rm -f "$tmp"
            log "reloading PostgreSQL configuration"
            as_postgres psql -X -q -tAc 'select pg_reload_conf()' >/dev/null
            sleep 1
        fi
        pg_sql -c 'select 1' >/dev/null \
            || die "still cannot connect as postgres@$PG_HOST:$PG_PORT without a password"
    fi

    # The roles (scripts/roles.sql is idempotent; it only logs when it creates something).
    if [ "$(pg_sql -c "select count(*) from pg_roles where rolname in ('custodian_owner', 'custodian_app', 'custodian_service', 'custodian_reader')")" != 4 ]; then
        log "creating the roles custodian_owner, custodian_app, custodian_service, custodian_reader"
    fi
    PGOPTIONS="-c client_min_messages=warning" pg_sql -f "$ROOT/scripts/roles.sql" >/dev/null

    # TLS: the service and the tests connect with sslmode=verify-full where they ask for it;
    # Debian's cluster serves its snakeoil certificate when ssl is on (the package's default).
    if [ "$(pg_sql -c 'show ssl')" != on ]; then
        if [ -r /etc/ssl/certs/ssl-cert-snakeoil.pem ]; then
            log "turning on TLS in PostgreSQL with the snakeoil certificate"
            pg_sql -c "alter system set ssl = on" \
                -c "alter system set ssl_cert_file = '/etc/ssl/certs/ssl-cert-snakeoil.pem'" \
                -c "alter system set ssl_key_file = '/etc/ssl/private/ssl-cert-snakeoil.key'" >/dev/null
            pg_sql -c 'select pg_reload_conf()' >/dev/null
        else
            log "WARNING: PostgreSQL does not serve TLS and no snakeoil certificate exists (apt-get install ssl-cert)"
        fi
    fi

    # Friendly for plain `psql` as root: a superuser role named root.
    if [ "$(id -u)" -eq 0 ] && [ -z "$(pg_sql -c "select 1 from pg_roles where rolname='root'")" ]; then
        log "creating PostgreSQL superuser role root"
        pg_sql -c 'create role root superuser login' >/dev/null
    fi

    local owner
    owner="$(pg_sql -c "select pg_get_userbyid(datdba) from pg_database where datname='$DB_NAME'")"
    if [ -z "$owner" ]; then
        log "creating database $DB_NAME owned by custodian_owner"
        pg_sql -c "create database $DB_NAME owner custodian_owner" >/dev/null
    elif [ "$owner" != custodian_owner ]; then
        # A database made before the roles existed: hand it and everything in its schema to the
        # owner role, so `custodian migrate` can run as custodian_owner. Nothing is dropped.
        log "database $DB_NAME is owned by $owner: transferring it and its objects to custodian_owner"
        pg_sql -c "alter database $DB_NAME owner to custodian_owner" >/dev/null
        psql -X -w -q -h "$PG_HOST" -p "$PG_PORT" -U postgres -d "$DB_NAME" -v ON_ERROR_STOP=1 -tA >/dev/null <<'SQL'
do $$
declare
    object record;
begin
    for object in
        select case c.relkind when 'S' then 'sequence' when 'v' then 'view' else 'table' end as kind,
               c.relname as name
          from pg_class c join pg_namespace n on n.oid = c.relnamespace
         where n.nspname = 'public' and c.relkind in ('r', 'p', 'v', 'S')
           and pg_get_userbyid(c.relowner) <> 'custodian_owner'
           and not (c.relkind = 'S' and exists (select 1 from pg_depend d
                                                 where d.objid = c.oid and d.deptype in ('a', 'i')))
    loop
        execute format('alter %s public.%I owner to custodian_owner', object.kind, object.name);
    end loop;
    for object in
        select p.oid::regprocedure::text as signature
          from pg_proc p join pg_namespace n on n.oid = p.pronamespace
         where n.nspname = 'public' and pg_get_userbyid(p.proowner) <> 'custodian_owner'
           and not exists (select 1 from pg_depend d where d.objid = p.oid and d.deptype = 'e')
    loop
        execute format('alter function %s owner to custodian_owner', object.signature);
    end loop;
end;
$$;
SQL
    fi
}

# ---------------------------------------------------------------- npm tools

ensure_node() {
    if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
        apt_install nodejs npm
    fi
}

# install_npm_tool NAME PACKAGE VERSION BIN VERSION_REGEX
# Each tool gets its own npm prefix: `npm install --no-save` prunes every
# package that is not in a package.json, so a shared prefix would lose the
# other tool on each install.
install_npm_tool() {
    local name="$1" pkg="$2" version="$3" bin="$4" regex="$5"
    local link="$TOOLS/bin/$name"
    if "$link" --version 2>/dev/null | grep -Eq "$regex"; then
        return 0
    fi
    ensure_node
    local prefix="$TOOLS/npm/$name"
    log "installing $pkg@$version into ${prefix#"$ROOT"/}"
    rm -rf "$prefix"
    mkdir -p "$prefix" "$TOOLS/bin"
    npm install --prefix "$prefix" --no-save --no-package-lock --no-audit --no-fund \
        --loglevel=error "$pkg@$version" >/dev/null
    local pkgdir="$prefix/node_modules/$pkg"
    # Where the binary lands: the package.json "bin" entry.
    local rel
    rel="$(node -e '
        const p = require(process.argv[1]);
        const b = typeof p.bin === "string" ? p.bin : (p.bin || {})[process.argv[2]];
        if (!b) process.exit(1);
        console.log(b);' "$pkgdir/package.json" "$bin")" \
        || die "$pkg@$version has no \"$bin\" in its package.json bin field"
    local target
    target="$(cd "$pkgdir" && realpath "$rel")"
    chmod +x "$target"
    ln -sfn "$(realpath --relative-to="$TOOLS/bin" "$target")" "$link"
    "$link" --version 2>/dev/null | grep -Eq "$regex" \
        || die "$link --version does not report $version: $("$link" --version 2>&1 | head -1)"
    log "$name -> ${target#"$ROOT"/}"
}

ensure_tools() {
    local arch
    arch="$(uname -m)"
    [ "$arch" = x86_64 ] || die "anvil is pinned to @foundry-rs/anvil-linux-amd64; this machine is $arch"
    install_npm_tool anvil @foundry-rs/anvil-linux-amd64 "$ANVIL_VERSION" anvil \
        "Version: ${ANVIL_VERSION//./\\.}([^0-9.]|$)"
    install_npm_tool solcjs solc "$SOLC_VERSION" solcjs \
        "^${SOLC_VERSION//./\\.}\\+"
}

# ---------------------------------------------------------------- Rust

check_rust() {
    if ! command -v cargo >/dev/null 2>&1; then
        if [ -x "$HOME/.cargo/bin/cargo" ]; then
            die "cargo is in ~/.cargo/bin but not on PATH: run 'source ~/.cargo/env' (or add ~/.cargo/bin to PATH)"
        fi
        die "no Rust toolchain (cargo not found). Install one with rustup (https://rustup.rs); this script does not download it"
    fi
    local c
    for c in fmt clippy; do
        cargo "$c" --version >/dev/null 2>&1 \
            || die "cargo $c is missing: run 'rustup component add $([ $c = fmt ] && echo rustfmt || echo clippy)'"
    done
}

# ---------------------------------------------------------------- promtool

# The tests load ops/prometheus/alerts.yml with promtool, from Debian's prometheus package. Its
# recommends (node-exporter, on :9100, the service's default metrics port) are not wanted, and
# policy-rc.d keeps the package from starting a Prometheus server.
ensure_promtool() {
    if command -v promtool >/dev/null 2>&1; then
        return
    fi
    local policy=/usr/sbin/policy-rc.d created=0
    if [ ! -e "$policy" ]; then
        as_root sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy"
        created=1
    fi
    apt_install --no-install-recommends prometheus
    if [ "$created" -eq 1 ]; then
        as_root rm -f "$policy"
    fi
    command -v promtool >/dev/null 2>&1 || die "prometheus installed but promtool not found"
    log "promtool -> $(command -v promtool)"
}

ensure_postgres
ensure_tools
ensure_promtool
check_rust
echo "setup: ok"
