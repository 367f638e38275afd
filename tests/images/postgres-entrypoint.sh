#!/bin/sh
# The entrypoint of fgpu-compose-postgres (tests/images/build-compose.sh): what compose.yaml asks of the
# official postgres image, for bookworm's PostgreSQL 15. On an empty $PGDATA it makes the cluster with the
# superuser POSTGRES_USER (password POSTGRES_PASSWORD, required: scram-sha-256 over TCP, trust on the local
# socket only, as the official image) and the database POSTGRES_DB; then it runs `postgres` as the user
# postgres, listening on every address of the container.
set -eu
if [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA" /run/postgresql
  chown postgres:postgres "$PGDATA" /run/postgresql
  chmod 0700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}"
  user="${POSTGRES_USER:-postgres}"
  database="${POSTGRES_DB:-$user}"
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  if [ "$database" != postgres ]; then
    postgres --single -D "$PGDATA" -c listen_addresses='' postgres >/dev/null <<SQL
CREATE DATABASE "$database" OWNER "$user";
SQL
  fi
  echo "postgres-entrypoint: made the cluster in $PGDATA (superuser $user, database $database)"
fi
if [ "${1:-}" = postgres ]; then
  shift
  exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
