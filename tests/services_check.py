"""`python -m tests.services_check`: fail fast, with a clear message, when PostgreSQL, Redis or
Debian's chromium is missing. The suite never skips a test for a missing service."""
from __future__ import annotations

import os
import shutil
import socket
import sys
from urllib.parse import urlparse


def reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), timeout=3):
            return True
    except OSError:
        return False


def main() -> int:
    problems = []
    db = os.environ.get("DATABASE_URL", "")
    if db.startswith("postgres") and not reachable(db, 5432):
        problems.append(f"PostgreSQL is not reachable at {db}. Start it: "
                        "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start")
    redis = os.environ.get("REDIS_URL", "")
    if not redis:
        problems.append("REDIS_URL is not set: the tests need Redis (Celery broker and channel layer)")
    elif not reachable(redis, 6379):
        problems.append(f"Redis is not reachable at {redis}. Start it: "
                        'redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no')
    if not shutil.which("chromium") and not os.path.exists("/usr/bin/chromium"):
        problems.append("Debian's chromium is missing (browser test): apt-get install chromium")
    for problem in problems:
        print(f"services_check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
