# Shared by the project's scripts (sourced): run a command as the postgres OS user. The sourcing
# script defines `die`.
as_postgres() {
    if [ "$(id -un)" = postgres ]; then
        "$@"
    elif [ "$(id -u)" -eq 0 ]; then
        runuser -u postgres -- "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -u postgres "$@"
    else
        die "need root (or sudo) to run as postgres: $*"
    fi
}
