"""Where `fgpu login` keeps the server URL and token: `$XDG_CONFIG_HOME/fgpu/config.json`
(default `~/.config/fgpu/config.json`), mode 0600 in a 0700 directory. `FGPU_URL` and
`FGPU_TOKEN` in the environment override what the file says."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


class ConfigError(Exception):
    """No usable URL or token (exit 3)."""


@dataclass
class Credentials:
    url: str
    token: str
    username: str = ""


def config_path(environ=None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "fgpu" / "config.json"


def normalize_url(url: str) -> str:
    """`localhost:8000/` → `http://localhost:8000`; keeps a path prefix, drops the trailing slash."""
    url = url.strip()
    if not url:
        raise ValueError("the server URL is empty")
    if "://" not in url:
        url = "http://" + url
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: the server URL must start with http:// or https://")
    return url.rstrip("/")


def load(environ=None) -> dict:
    """The stored config ({} when there is none or it cannot be read)."""
    path = config_path(environ)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save(data: dict, environ=None) -> Path:
    """Write atomically with mode 0600 (never readable by others, not even for an instant)."""
    path = config_path(environ)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.chmod(path.parent, 0o700)  # fgpu's own directory: nobody else lists it
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".json", dir=path.parent)  # mkstemp: 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def remove(environ=None) -> bool:
    path = config_path(environ)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def credentials(environ=None) -> Credentials:
    """URL and token from the environment, else from the config file. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    stored = load(environ)
    url = environ.get("FGPU_URL") or stored.get("url") or ""
    token = environ.get("FGPU_TOKEN") or stored.get("token") or ""
    if not url or not token:
        missing = "server URL" if not url else "token"
        raise ConfigError(f"not logged in (no {missing}): run `fgpu login URL --username USER`, or set FGPU_URL and FGPU_TOKEN")
    try:
        url = normalize_url(url)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    # The stored username names the caller only when the stored token is the one in use.
    username = stored.get("username", "") if token == stored.get("token") else ""
    return Credentials(url=url, token=token, username=username)
