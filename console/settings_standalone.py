"""Standalone mode (`python manage.py standalone`, what `make run` starts).

One process on one machine: SQLite under `FGPU_DATA_DIR`, the in-memory channel layer,
eager Celery, and embedded agents driven by the same agent code as a GPU node. Nothing
here needs PostgreSQL or Redis; `DATABASE_URL` and `REDIS_URL` are ignored on purpose. Nor a
SECRET_KEY: without a usable FGPU_SECRET_KEY the key is made once and kept in
`FGPU_DATA_DIR/secret_key`, mode 0600 (common.secret_key.standalone_secret_key).
"""

import sys

from common.secret_key import KEY_FILE_NAME, standalone_secret_key
from console.settings import *  # noqa: F401,F403
from console.settings import DATA_DIR, SECRET_KEY_PROBLEM, _database

STANDALONE = True
DATA_DIR.mkdir(parents=True, exist_ok=True)
SECRET_KEY_FILE = None  # FGPU_SECRET_KEY is used as it is
if SECRET_KEY_PROBLEM is not None:
    SECRET_KEY, _made = standalone_secret_key(DATA_DIR)
    SECRET_KEY_FILE = DATA_DIR / KEY_FILE_NAME
    SECRET_KEY_PROBLEM = None
    if _made:
        print(f"fgpu: made this console's secret key, kept in {SECRET_KEY_FILE} (mode 0600)", file=sys.stderr, flush=True)
DATABASES = {"default": _database(f"sqlite:///{DATA_DIR / 'fgpu.sqlite3'}")}
# Terminal output waits for a slow consumer instead of being dropped (common.layers).
CHANNEL_LAYERS = {"default": {"BACKEND": "common.layers.FlowControlledInMemoryChannelLayer"}}
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
CELERY_BROKER_URL = "memory://localhost/"
CELERY_TASK_ALWAYS_EAGER = True
