#!/usr/bin/env bash
# A synchronous PostgreSQL standby on this machine (DESIGN §9, high availability), and a private
# primary to pair it with, for trying a failover without touching the main server.
#
#   scripts/pg_standby.sh standby DIR PORT PRIMARY_PORT DATABASE
#       pg_basebackup of the server at 127.0.0.1:PRIMARY_PORT into DIR, started on PORT as its
#       synchronous standby; DATABASE commits wait until the standby has applied them
#       (synchronous_commit = remote_apply for that database only; other databases commit
#       locally, so a standby that is down never holds them up).
#   scripts/pg_standby.sh primary DIR PORT
#       initdb a private server into DIR (trust on loopback, replication allowed), started on PORT.
#   scripts/pg_standby.sh promote DIR      the standby in DIR becomes a primary
#   scripts/pg_standby.sh crash DIR        pg_ctl stop -m immediate (what a dead primary looks like)
#   scripts/pg_standby.sh stop DIR         stop the server in DIR (fast), if it runs
#   scripts/pg_standby.sh remove DIR PRIMARY_PORT DATABASE
#       undo `standby`: the primary commits locally again, the standby is stopped and deleted
#
# `make standby` runs the first against the main server (5432 → .pgdata/standby on 5433). Files
# belong to the postgres OS user; run as root (or that user, or with sudo).
set -euo pipefail

log() { echo "pg_standby: $*" >&2; }
die() { echo "pg_standby: ERROR: $*" >&2; exit 1; }

# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bindir() {
    local v
    v="$(ls /usr/lib/postgresql 2>/dev/null | sort -V | tail -1)"
    [ -n "$v" ] || die "no PostgreSQL server found in /usr/lib/postgresql (run scripts/setup.sh)"
    echo "/usr/lib/postgresql/$v/bin"
}
BIN="$(bindir)"

psql_at() {
    local port="$1"
    shift
    psql -X -w -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 -tA "$@"
}

# A folder the postgres user owns, with every parent traversable.
prepare_dir() {
    local dir="$1"
    mkdir -p "$dir"
    if [ "$(id -u)" -eq 0 ]; then
        chown postgres:postgres "$dir"
    fi
    chmod 700 "$dir"
}

start() {
    local dir="$1" port="$2"
    as_postgres "$BIN/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 60 \
        -o "-p $port -c unix_socket_directories='' -c listen_addresses=127.0.0.1" start >/dev/null \
        || { tail -20 "$dir/server.log" >&2; die "the server in $dir did not start"; }
}

# The primary must let the postgres role connect for replication over loopback (a Debian
# cluster's pg_hba.conf does not by default; a server made by `primary` does).
allow_replication() {
    local port="$1" hba
    if [ "$(psql_at "$port" -c "select count(*) from pg_hba_file_rules
                                  where 'replication' = any(database) and address in ('127.0.0.1', '::1')")" != 0 ]; then
        return
    fi
    hba="$(psql_at "$port" -c "show hba_file")"
    log "pg_hba.conf: allowing replication by postgres over loopback ($hba)"
    as_postgres sh -c "printf '%s\n' '# custodian: a local standby (scripts/pg_standby.sh)' \
        'host    replication    postgres    127.0.0.1/32    trust' >> '$hba'"
    psql_at "$port" -c "select pg_reload_conf()" >/dev/null
}

cmd_primary() {
    local dir="$1" port="$2"
    [ -f "$dir/PG_VERSION" ] && die "$dir already holds a server"
    prepare_dir "$dir"
    as_postgres "$BIN/initdb" -D "$dir" -U postgres --auth=trust -E UTF8 --no-sync >/dev/null
    cat >>"$dir/postgresql.conf" <<EOF
wal_level = replica
max_wal_senders = 5
fsync = on
EOF
    start "$dir" "$port"
    log "primary in $dir on 127.0.0.1:$port"
}

cmd_standby() {
    local dir="$1" port="$2" primary_port="$3" database="$4"
    [ -f "$dir/PG_VERSION" ] && die "$dir already holds a server"
    psql_at "$primary_port" -c "select 1" >/dev/null || die "no server answers on 127.0.0.1:$primary_port"
    allow_replication "$primary_port"
    prepare_dir "$dir"
    local name="custodian_standby_$port"
    as_postgres "$BIN/pg_basebackup" -h 127.0.0.1 -p "$primary_port" -U postgres -D "$dir" \
        -X stream --checkpoint=fast -R -d "application_name=$name"
    # A Debian cluster keeps its configuration outside the data directory: the standby gets a
    # minimal one of its own and the primary's client authentication.
    if [ ! -f "$dir/postgresql.conf" ]; then
        as_postgres sh -c "echo '# a standby made by scripts/pg_standby.sh' > '$dir/postgresql.conf'"
    fi
    if [ ! -f "$dir/pg_hba.conf" ]; then
        as_postgres cp "$(psql_at "$primary_port" -c "show hba_file")" "$dir/pg_hba.conf"
        as_postgres touch "$dir/pg_ident.conf"
    fi
    # The copy carries the primary's settings; the standby's own lines go last.
    cat >>"$dir/postgresql.auto.conf" <<EOF
port = $port
hot_standby = on
EOF
    start "$dir" "$port"
    # Synchronous for the ledger database only: the server's default becomes local commits, the
    # ledger's remote_apply (a commit returns once the standby has applied it: nothing a client
    # was told is lost when the standby is promoted, and it reads its own writes at once).
    psql_at "$primary_port" -c "alter system set synchronous_standby_names = '$name'" \
        -c "alter system set synchronous_commit = 'local'" -c "select pg_reload_conf()" >/dev/null
    psql_at "$primary_port" -c "alter database \"$database\" set synchronous_commit = 'remote_apply'" >/dev/null
    local waited=0
    until [ "$(psql_at "$primary_port" -c "select count(*) from pg_stat_replication where application_name = '$name' and sync_state = 'sync'")" = 1 ]; do
        waited=$((waited + 1))
        [ "$waited" -le 60 ] || die "the standby did not become synchronous"
        sleep 0.5
    done
    log "synchronous standby of 127.0.0.1:$primary_port in $dir on 127.0.0.1:$port ($database: remote_apply)"
}

cmd_promote() {
    as_postgres "$BIN/pg_ctl" -D "$1" -w -t 60 promote >/dev/null
    log "promoted the server in $1"
}

cmd_crash() {
    as_postgres "$BIN/pg_ctl" -D "$1" -m immediate stop >/dev/null
    log "stopped the server in $1 (immediate)"
}

cmd_remove() {
    local dir="$1" primary_port="$2" database="$3"
    psql_at "$primary_port" -c "alter system reset synchronous_standby_names" -c "alter system reset synchronous_commit" \
        -c "select pg_reload_conf()" >/dev/null
    psql_at "$primary_port" -c "alter database \"$database\" reset synchronous_commit" >/dev/null
    cmd_stop "$dir"
    rm -rf "$dir"
    log "the standby in $dir is gone; 127.0.0.1:$primary_port commits locally again"
}

cmd_stop() {
    if [ -f "$1/postmaster.pid" ]; then
        as_postgres "$BIN/pg_ctl" -D "$1" -m fast -w stop >/dev/null || true
    fi
}

case "${1:-}" in
    primary) [ $# -eq 3 ] || die "usage: $0 primary DIR PORT"; cmd_primary "$2" "$3" ;;
    standby) [ $# -eq 5 ] || die "usage: $0 standby DIR PORT PRIMARY_PORT DATABASE"; cmd_standby "$2" "$3" "$4" "$5" ;;
    promote) [ $# -eq 2 ] || die "usage: $0 promote DIR"; cmd_promote "$2" ;;
    crash) [ $# -eq 2 ] || die "usage: $0 crash DIR"; cmd_crash "$2" ;;
    remove) [ $# -eq 4 ] || die "usage: $0 remove DIR PRIMARY_PORT DATABASE"; cmd_remove "$2" "$3" "$4" ;;
    stop) [ $# -eq 2 ] || die "usage: $0 stop DIR"; cmd_stop "$2" ;;
    *) die "usage: $0 primary|standby|promote|crash|stop|remove …" ;;
esac
