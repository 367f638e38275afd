#!/usr/bin/env python3
"""Make the secrets of a compose deployment (compose.yaml), once: `python deploy/make_env.py`.

Writes, with new random values:

- `.env` (mode 0600), which compose reads: FGPU_SECRET_KEY (64 characters), FGPU_METRICS_TOKEN,
  FGPU_ADMIN_PASSWORD (the console's `admin`), FGPU_GRAFANA_PASSWORD (Grafana's `admin`),
  FGPU_POSTGRES_PASSWORD, and the broker passwords of the Redis ACL users, one per role
  (common.broker_acl: FGPU_REDIS_WEB_PASSWORD, FGPU_REDIS_MANAGER_PASSWORD, and
  FGPU_REDIS_AGENT_PASSWORD for the agent of node COMPOSE_NODE);
- and, not a secret, FGPU_APPS_ORIGIN (APPS_ORIGIN: the web's second published port, compose.yaml),
  where session apps are served: change it to a host name of its own that reaches the web's port
  8001 (best: another registrable domain, with TLS), as README's "Session apps" says;
- `deploy/redis/users.acl` (mode 0644: it holds only the SHA-256 of each password, which are
  256-bit random), the Redis ACL file compose's Redis loads: the default user off, one user per
  role (common.broker_acl.acl_file).

An existing `.env` is kept (exit 1, saying so) unless `--force`: new passwords would not match
the database's volume, whose PostgreSQL password was set when it was made. Run it from the
checkout with the project's Python (`.venv/bin/python deploy/make_env.py`, or `python` where the
package is installed): it uses common.broker_acl.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_NODE = "compose-node"  # deploy/agent.toml's [agent] id
APPS_ORIGIN = "http://localhost:8001"  # compose.yaml's web publishes 8001 for it; the console is http://127.0.0.1:8000


def env_text(*, broker_passwords: dict[str, str]) -> str:
    """The `.env` file's text: every secret compose.yaml asks for, new and random, and the apps origin."""
    from common.broker_acl import MANAGER, WEB, agent_user

    values = {
        "FGPU_SECRET_KEY": secrets.token_urlsafe(48),
        "FGPU_METRICS_TOKEN": secrets.token_urlsafe(32),
        "FGPU_ADMIN_PASSWORD": secrets.token_urlsafe(18),
        "FGPU_GRAFANA_PASSWORD": secrets.token_urlsafe(18),
        "FGPU_POSTGRES_PASSWORD": secrets.token_urlsafe(32),
        "FGPU_REDIS_WEB_PASSWORD": broker_passwords[WEB],
        "FGPU_REDIS_MANAGER_PASSWORD": broker_passwords[MANAGER],
        "FGPU_REDIS_AGENT_PASSWORD": broker_passwords[agent_user(COMPOSE_NODE)],
    }
    lines = [
        "# Secrets of this compose deployment, made by deploy/make_env.py. Keep this file private (mode 0600).",
        "# The console's admin signs in with FGPU_ADMIN_PASSWORD, Grafana's admin with FGPU_GRAFANA_PASSWORD.",
    ]
    apps = [
        "# Where session apps are served (not a secret): an origin of their own, never the console's",
        "# (http://127.0.0.1:8000). localhost:8001 is the web's second port; a host name of its own is better.",
        f"FGPU_APPS_ORIGIN={APPS_ORIGIN}",
    ]
    return "\n".join(lines + [f"{name}={value}" for name, value in values.items()] + apps) + "\n"


def write(path: Path, text: str, mode: int) -> None:
    """Write `text` to `path` with `mode` from the start (never readable by others in between)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)  # an existing file keeps its mode on O_TRUNC


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make the secrets of a compose deployment: .env and Redis's ACL file.")
    parser.add_argument("--env-file", default=str(ROOT / ".env"), help="where to write the variables (default: .env)")
    parser.add_argument(
        "--acl-file", default=str(ROOT / "deploy" / "redis" / "users.acl"), help="where to write Redis's ACL users"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing env file (every password changes)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from common.broker_acl import acl_file, broker_users

    env_file, acl_path = Path(args.env_file), Path(args.acl_file)
    if env_file.exists() and not args.force:
        print(
            f"{env_file} exists: kept (its passwords are those the deployment's volumes were made with). --force makes new ones.",
            file=sys.stderr,
        )
        return 1
    users = broker_users([COMPOSE_NODE])
    write(env_file, env_text(broker_passwords={u.name: u.password for u in users}), 0o600)
    write(acl_path, acl_file(users), 0o644)
    print(f"wrote {env_file} (mode 0600) and {acl_path} ({len(users)} broker users, the default user off)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
