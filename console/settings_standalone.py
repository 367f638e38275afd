"""Standalone mode (`python manage.py standalone`, what `make run` starts).

One process on one machine: SQLite under `FGPU_DATA_DIR`, the in-memory channel layer,
eager Celery, and embedded agents driven by the same agent code as a GPU node. Nothing
here needs PostgreSQL or Redis; `DATABASE_URL` and `REDIS_URL` are ignored on purpose.
"""

from console.settings import *  # noqa: F401,F403
from console.settings import DATA_DIR, _database

STANDALONE = True
DATA_DIR.mkdir(parents=True, exist_ok=True)
DATABASES = {"default": _database(f"sqlite:///{DATA_DIR / 'fgpu.sqlite3'}")}
# Terminal output waits for a slow consumer instead of being dropped (console.layers).
CHANNEL_LAYERS = {"default": {"BACKEND": "console.layers.FlowControlledInMemoryChannelLayer"}}
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
CELERY_BROKER_URL = "memory://localhost/"
CELERY_TASK_ALWAYS_EAGER = True
