"""The console's SECRET_KEY (issue 31.7): its own, never a public default.

Django signs sign-in sessions, CSRF tokens and password-reset links with SECRET_KEY; anyone who
knows it can forge them. Outside standalone mode it comes from `FGPU_SECRET_KEY` (at least
MIN_LENGTH characters, not a placeholder such as `change-me`). Settings never fall back to a known
string: without a usable key they get a random one for the process (nothing it signs outlives it
or is shared with another process) and `secret_key_problem` says why, and the processes that sign
for others, the web, the manager worker and beat, refuse to start (`require_secret_key`). The
agent and management commands that sign nothing start without it.

Standalone (`make run`, console.settings_standalone) needs no configuration: it generates a key
once and keeps it in `FGPU_DATA_DIR/secret_key` (mode 0600) (`standalone_secret_key`).

Shell: `python -c "import secrets; print(secrets.token_urlsafe(48))"` makes a key (or the
`.env` generator, deploy/make_env.py, which writes every secret of a compose deployment).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

VARIABLE = "FGPU_SECRET_KEY"
MIN_LENGTH = 32  # characters; secrets.token_urlsafe(48) gives 64
# Values people copy from examples and templates; a key containing one is refused.
PLACEHOLDERS = ("change-me", "changeme", "change_me", "insecure", "dev-only", "placeholder", "your-secret", "xxxxxxxx")
KEY_FILE_NAME = "secret_key"


def secret_key_problem(value: str) -> str | None:
    """Why `value` cannot be the console's SECRET_KEY, or None when it can: unset, shorter than
    MIN_LENGTH characters, or containing a known placeholder (any case)."""
    if not value:
        return f"{VARIABLE} is not set"
    if len(value) < MIN_LENGTH:
        return f"{VARIABLE} has {len(value)} characters; it needs at least {MIN_LENGTH}"
    lowered = value.lower()
    for placeholder in PLACEHOLDERS:
        if placeholder in lowered:
            return f"{VARIABLE} holds the placeholder {placeholder!r}: set a random key of your own"
    return None


def secret_key_from_env() -> tuple[str, str | None]:
    """`(key, problem)`: `FGPU_SECRET_KEY` and None when it is usable; else a random key for this
    process alone and the reason (secret_key_problem), for `require_secret_key` to report."""
    value = os.environ.get("FGPU_SECRET_KEY", "")
    problem = secret_key_problem(value)
    if problem is None:
        return value, None
    return secrets.token_urlsafe(48), problem


def require_secret_key(process: str) -> None:
    """Stop `process` (a name: "web", "manager", "beat") at start when settings have no key of
    their own: prints what to do on stderr and raises SystemExit(2). Returns when the key is
    usable (from FGPU_SECRET_KEY, or standalone's key file)."""
    from django.conf import settings

    problem = getattr(settings, "SECRET_KEY_PROBLEM", None)
    if problem is None:
        return
    print(
        f"fgpu {process}: refusing to start: {problem}. Every process of one console (web, manager, beat) "
        f"needs the same random key of at least {MIN_LENGTH} characters, e.g. "
        f'{VARIABLE}=$(python -c "import secrets; print(secrets.token_urlsafe(48))"); '
        "for compose, `python deploy/make_env.py` writes one into .env. (make run needs none: it keeps its own.)",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(2)


def standalone_secret_key(data_dir: Path) -> tuple[str, bool]:
    """`(key, made)`: the key kept in `data_dir/secret_key`, made (64 random URL-safe
    characters, written with mode 0600, `made` True) when the file does not exist yet. Raises
    ImproperlyConfigured when the file exists but holds no usable key, or others may read it."""
    path = data_dir / KEY_FILE_NAME
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _kept_key(path), False
    key = secrets.token_urlsafe(48)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, True


def _kept_key(path: Path) -> str:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ImproperlyConfigured(f"{path}: mode {mode:o}; the console's key file must be 0600 (chmod 600 it)")
    key = path.read_text().strip()
    problem = secret_key_problem(key)
    if problem is not None:
        raise ImproperlyConfigured(f"{path}: {problem.replace(VARIABLE, 'the key file')}; delete it to have a new one made")
    return key
