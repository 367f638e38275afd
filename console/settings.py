"""Settings for the distributed processes (web, manager worker, agent) and the test suite.

Everything that differs between machines comes from the environment (see `.env.example`):
`DATABASE_URL` (default: SQLite under `FGPU_DATA_DIR`), `REDIS_URL` (Celery broker and
Channels layer; without it the channel layer is in-memory), `FGPU_SECRET_KEY`, `FGPU_DEBUG`,
`FGPU_ALLOWED_HOSTS`. `console.settings_standalone` builds the single-machine mode on top.
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from common.env import env_bool, env_int, env_list, env_str, env_url
from common.secret_key import secret_key_from_env

BASE_DIR = Path(__file__).resolve().parent.parent

DATA_DIR = Path(env_str("FGPU_DATA_DIR", str(BASE_DIR / "var"))).resolve()
# FGPU_SECRET_KEY, never a public default: without a usable one the key is random for this process and the
# web, manager and beat refuse to start (common.secret_key); standalone keeps a key of its own.
SECRET_KEY, SECRET_KEY_PROBLEM = secret_key_from_env()
DEBUG = env_bool("FGPU_DEBUG", False)
ALLOWED_HOSTS = env_list("FGPU_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("FGPU_CSRF_TRUSTED_ORIGINS", [])

# Not "daphne" (whose app only makes `runserver` serve ASGI, and costs every process Twisted's
# import), and the admin without its autodiscovery at start-up: console/urls.py loads the admin
# modules, so the manager and the agents never import them (issue 33.6: start-up).
INSTALLED_APPS = [
    "django.contrib.admin.apps.SimpleAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from here (no CDN)
    "channels",
    "console",
    "accelerators",
    "sessions.apps.ComputeSessionsConfig",
    "accounts",
    "usage",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "common.security_headers.ContentSecurityPolicyMiddleware",
    "common.input_guard.RefusedCharactersMiddleware",  # a NUL in the path: 404; in the query: 400 naming it
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "console.urls"
ASGI_APPLICATION = "console.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


# PostgreSQL connections are kept and reused, so web and manager do not pay a new connection
# per request or task (issue 14: 21 % of the manager's samples were spent connecting). Kept in a
# pool per process (Django's, psycopg_pool), not by CONN_MAX_AGE: Django serves each ASGI request
# on a thread of its own, so a connection kept by its thread is never reused, and stays open
# until garbage-collected (measured under daphne: 30 new connections a second, 50 open at once).
# A request or task takes a connection at its first query and gives it back when it ends; a
# connection is checked before it is handed out (CONN_HEALTH_CHECKS), so one the server dropped
# (a restart, pg_terminate_backend) is replaced, not an error. At most "max_size" per process
# (a request holds its connection to its end: a blocking exec, up to its timeout), a request
# finding none free waits up to "timeout" seconds; idle ones above "min_size" are closed after
# "max_idle" seconds. SQLite (standalone) opens a file: nothing to keep.
# A database that cannot be reached (stopped, restarting, its host gone) is answered within about
# a second (issue 33): a request that gets no connection within the pool's "timeout" (1 s) fails
# with PoolTimeout, which the API answers 503 with Retry-After and the pages with their "try
# again" page (common.api_errors, common.api_support.server_error), instead of holding the
# client 30 s for a 500. The pool makes its connections in the background, each attempt given up
# after DATABASE_CONNECT_TIMEOUT seconds (libpq's connect_timeout; 2 is the least libpq and
# psycopg honour) and retried with backoff (1 s, 2 s, …) for at most "reconnect_timeout" seconds,
# after which the next request starts afresh: so the pool is whole again within a few seconds of
# the database's return, however long it was away (psycopg_pool's default, 300 s, let the backoff
# grow to minutes while every request answered 503).
DATABASE_POOL = {"min_size": 2, "max_size": 32, "timeout": 1, "max_idle": 60, "reconnect_timeout": 4}
DATABASE_CONNECT_TIMEOUT = 2  # seconds


def _database(url: str) -> dj_database_url.DBConfig:
    try:
        config = dj_database_url.parse(url, conn_max_age=0, conn_health_checks=True)
    except Exception as exc:  # dj-database-url raises several types for a bad URL
        raise ImproperlyConfigured(f"DATABASE_URL={url!r}: {exc}") from None
    if config["ENGINE"] == "django.db.backends.postgresql":
        config["OPTIONS"] = {
            "connect_timeout": DATABASE_CONNECT_TIMEOUT,
            **config.get("OPTIONS", {}),
            "pool": dict(DATABASE_POOL),
        }
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # Writers queue instead of failing with "database is locked"; IMMEDIATE makes every
        # transaction take the write lock at BEGIN, which is what select_for_update means here.
        # WAL: readers never wait for the writer, and a commit appends to the log instead of
        # syncing the database file twice (synchronous=NORMAL: a power cut may lose the last
        # commits, never corrupt the file — https://www.sqlite.org/wal.html).
        config["OPTIONS"] = {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    return config


DATABASE_URL = env_str("DATABASE_URL")
if not DATABASE_URL:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    DATABASE_URL = f"sqlite:///{DATA_DIR / 'fgpu.sqlite3'}"
DATABASES = {"default": _database(DATABASE_URL)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTHENTICATION_BACKENDS = ["accounts.backends.ThrottledModelBackend"]  # ModelBackend behind the login throttle
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "static"

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "session-list"
LOGOUT_REDIRECT_URL = "login"

REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    REDIS_URL = env_url("REDIS_URL", REDIS_URL, schemes=("redis", "rediss", "unix"))
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "common.layers.RedisChannelLayer",  # channels_redis with fewer round trips
            # socket_timeout None: channels_redis waits for messages with a 5 s BZPOPMIN, and
            # redis-py 8's default 5 s socket timeout would cut every idle wait.
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": None}], "capacity": 1000, "expiry": 60},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
# The login throttle's counters: shared by every web process through Redis, else per process.
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}
    if REDIS_URL
    else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
}

CELERY_BROKER_URL = REDIS_URL or "memory://localhost/"
CELERY_TASK_ALWAYS_EAGER = env_bool("FGPU_CELERY_EAGER", not REDIS_URL)
CELERY_TASK_EAGER_PROPAGATES = False
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None  # a restarted broker is waited for, however long it takes
# Healing (DESIGN.md): a manager that dies holding messages it took (acks_late) gives them back to
# the queue FGPU_BROKER_VISIBILITY_TIMEOUT seconds later (kombu's default is an hour); each worker
# thread holds at most one message it has not started; a publish gives up after about a second
# (the caller logs it, the reconciliation repairs it) instead of hanging a web request.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env_int("FGPU_BROKER_VISIBILITY_TIMEOUT", 30, minimum=5, maximum=86400),
    "socket_timeout": 10,
    "socket_connect_timeout": 5,
    "health_check_interval": 10,
    # No priority sub-queues (nothing is sent with a priority): each queue is one Redis key, which
    # the broker's ACL users name (common/broker_acl.py).
    "priority_steps": [0],
}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 3, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE = {
    "node-heartbeat-check": {"task": "fgpu.manager.node_check_heartbeats", "schedule": 5.0},
    "schedule-pending": {"task": "fgpu.manager.schedule_pending", "schedule": 10.0},
    "usage-rollup": {"task": "fgpu.manager.usage_rollup", "schedule": 300.0},  # 5-minute means, retention
    "usage-idle-check": {"task": "fgpu.manager.usage_idle_check", "schedule": 30.0},  # idle reclamation
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "accounts.authentication.ApiTokenAuthentication",  # named API tokens, then DRF authtoken keys
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "EXCEPTION_HANDLER": "common.api_errors.exception_handler",
    "DEFAULT_PARSER_CLASSES": [
        "common.api_parsers.DepthLimitedJSONParser",  # DRF's JSONParser, refusing bodies nested too deep
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "common.api_pagination.StrictLimitOffsetPagination",
    "PAGE_SIZE": 100,
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_SCHEMA_CLASS": "common.api_support.AutoSchema",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "fGPU Console API",
    "DESCRIPTION": (
        "Share GPUs by fractions: launch sessions with a slice of a GPU (fGPU shares, memory + cores, "
        "a fraction, whole devices), read the inventory, and (administrators) edit slot formats, "
        "fractional settings, resource groups, projects, quotas and session images.\n\n"
        "Authenticate with `Authorization: Token <key>` (POST /api/v1/auth/token/) or a signed-in session. "
        'Every error has one shape: `{"type", "title", "detail", "field_errors"}`. '
        "Administrators' edits need `If-Match` with the ETag from a GET (428 without, 412 when stale). "
        "Amounts: fGPU as decimal text, memory in bytes, compute in SMs."
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "PARSER_WHITELIST": ["rest_framework.parsers.JSONParser"],  # documented bodies are JSON
    "SCHEMA_PATH_PREFIX": r"/api/v1",
    "ENUM_NAME_OVERRIDES": {
        "SessionStatusEnum": "sessions.models.SessionStatus",
        "NodeStatusEnum": "accelerators.models.NodeStatus",
        "AllocationModeEnum": "accelerators.models.AllocationMode",
        "MigCatalogSourceEnum": "accelerators.api_mig.CATALOG_SOURCES",
        "ExecStateEnum": "protocol.exec_store.STATES",
        "ExecStreamEnum": "protocol.exec_store.STREAMS",
        "EtaOutcomeEnum": "sessions.api.eta.ETA_OUTCOMES",
        "WhatIfChangeEnum": "sessions.api.eta.WHAT_IF_CHANGES",
    },
}

# fGPU Console's own knobs.
FGPU_HEARTBEAT_INTERVAL = env_int("FGPU_HEARTBEAT_INTERVAL", 5, minimum=1, maximum=300)  # seconds
FGPU_HEARTBEAT_TIMEOUT = env_int("FGPU_HEARTBEAT_TIMEOUT", 30, minimum=2, maximum=3600)  # seconds
# Fencing (sessions.lifecycle.reconcile): seconds of silence, counted from a LOST node's last heartbeat, after
# which the console assumes the node's processes are gone and releases its sessions' devices (as
# Slurm's SlurmdTimeout, 300 s by default, sets a silent node DOWN); 0: never, the console waits
# for the node's agent or an administrator's "mark dead".
FGPU_FENCE_TIMEOUT_SECONDS = env_int("FGPU_FENCE_TIMEOUT_SECONDS", 300, minimum=0, maximum=30 * 86400)
# Refuse every agent message from a node without an agent key (manage.py node_key); off: such a
# node's messages are applied unauthenticated, as before keys existed.
FGPU_REQUIRE_NODE_KEYS = env_bool("FGPU_REQUIRE_NODE_KEYS", False)
FGPU_TERMINAL_TICKET_TTL = env_int("FGPU_TERMINAL_TICKET_TTL", 60, minimum=5, maximum=3600)  # seconds
# How many later sessions may start past a pending one that does not fit (backfill) before
# it reserves the node and devices it waits for (sessions.scheduling.backfill); 0: it reserves at once.
FGPU_BACKFILL_LIMIT = env_int("FGPU_BACKFILL_LIMIT", 8, minimum=0, maximum=10000)
# Fair share over time (sessions.scheduling.fairshare): usage older by this many days counts half; 0 turns it
# off (first in, first out within a priority).
FGPU_FAIRSHARE_HALF_LIFE_DAYS = env_int("FGPU_FAIRSHARE_HALF_LIFE_DAYS", 7, minimum=0, maximum=3650)
# Preemption with notice (sessions.scheduling.preemption, issue 17.2): off by default. On, a waiting session of
# higher priority (or of an owner under its fair share) may have preemptible sessions stopped for
# it: each is warned, then stopped this many seconds later.
FGPU_PREEMPTION = env_bool("FGPU_PREEMPTION", False)
FGPU_PREEMPTION_GRACE_SECONDS = env_int("FGPU_PREEMPTION_GRACE_SECONDS", 300, minimum=0, maximum=7 * 86400)
FGPU_SESSIONS_DIR = DATA_DIR / "sessions"
# The most characters of output kept per session (the oldest are dropped): 4 Mi characters,
# about 4 MiB of plain text. GET /api/v1/sessions/<id>/logs/ serves what is kept.
FGPU_SESSION_LOG_MAX_CHARS = 4 * 1024 * 1024
# Exec (POST /api/v1/sessions/<id>/exec/): default and largest command timeout, seconds.
FGPU_EXEC_DEFAULT_TIMEOUT = 30
FGPU_EXEC_MAX_TIMEOUT = 300
# Streamed exec ("stream": true): the most output kept per stream (stdout, stderr), bytes, as
# the blocking exec's 1 MiB; later output is dropped (`truncated`). Seconds the state and output
# stay readable (in Redis, or memory in standalone mode) after the command ends.
FGPU_EXEC_STREAM_MAX_BYTES = 1024 * 1024
FGPU_EXEC_OUTPUT_TTL = 3600
# A session's files (issue 18): the most bytes a user may keep in their persistent folder (~/data),
# and in one session's home; an upload that would pass it is refused (413 over-cap).
FGPU_FILES_USER_CAP = env_int("FGPU_FILES_USER_CAP", 10 * 1024**3, minimum=1, maximum=1024**5)  # bytes
# Usage (issue 15): samples at full resolution are kept FGPU_USAGE_RAW_RETENTION seconds, their
# 5-minute means FGPU_USAGE_ROLLUP_RETENTION; a bucket is closed FGPU_USAGE_LATENESS seconds after
# it ends (later samples are refused). GET /metrics answers only `Authorization: Bearer
# <FGPU_METRICS_TOKEN>` (unset: /metrics is off, 404).
FGPU_USAGE_RAW_RETENTION = 24 * 3600
FGPU_USAGE_ROLLUP_RETENTION = 90 * 86400
FGPU_USAGE_LATENESS = 3600
FGPU_METRICS_TOKEN = env_str("FGPU_METRICS_TOKEN")
if FGPU_METRICS_TOKEN and (len(FGPU_METRICS_TOKEN) < 16 or not FGPU_METRICS_TOKEN.isprintable()):
    raise ImproperlyConfigured("FGPU_METRICS_TOKEN: at least 16 printable characters (or unset: /metrics off)")


# Session apps on their own origin (issue 31.4; sessions.serving.origin): FGPU_APPS_ORIGIN is where
# they are served ("http://apps.gpu.example.org", "http://127.0.0.1:8001"), never the console's
# origin. Unset: apps are off (their pages say so), except in standalone, which serves them on
# its port + 1 (FGPU_APPS_PORT). The console's sign-in reaches it by a one-time ticket of
# FGPU_APP_TICKET_TTL seconds, turned into the app-origin cookie FGPU_APPS_COOKIE, kept
# FGPU_APP_COOKIE_AGE seconds.
def _apps_origin(value: str) -> str:
    if not value:
        return ""
    from urllib.parse import urlsplit

    parts = urlsplit(value.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.path not in ("", "/"):
        raise ImproperlyConfigured(
            f"FGPU_APPS_ORIGIN={value!r}: expected an origin, http(s)://host[:port], with no path (e.g. http://apps.gpu.example.org)"
        )
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ImproperlyConfigured(f"FGPU_APPS_ORIGIN={value!r}: an origin has no user, query or fragment")
    return f"{parts.scheme}://{parts.netloc.lower()}"


FGPU_APPS_ORIGIN = _apps_origin(env_str("FGPU_APPS_ORIGIN"))
FGPU_APPS_COOKIE = "fgpu_app"
FGPU_APP_TICKET_TTL = env_int("FGPU_APP_TICKET_TTL", 30, minimum=5, maximum=300)  # seconds
FGPU_APP_COOKIE_AGE = env_int("FGPU_APP_COOKIE_AGE", 12 * 3600, minimum=60, maximum=30 * 86400)  # seconds
FGPU_APP_TOKEN_TTL = 30 * 86400  # seconds an app's token is kept after its last open (sessions.serving.session_apps)

# Security headers of the console's origin (common.security_headers): a strict
# Content-Security-Policy (scripts only from the console's own files), no framing, no referrer
# to other origins, no MIME sniffing. Over TLS (FGPU_TLS=true, or a proxy's header named by
# FGPU_SECURE_PROXY_SSL_HEADER, e.g. "X-Forwarded-Proto"): HSTS and Secure cookies.
FGPU_TLS = env_bool("FGPU_TLS", False)
_proxy_ssl_header = env_str("FGPU_SECURE_PROXY_SSL_HEADER")
if _proxy_ssl_header:
    if not _proxy_ssl_header.replace("-", "").isalnum():
        raise ImproperlyConfigured(f"FGPU_SECURE_PROXY_SSL_HEADER={_proxy_ssl_header!r}: a header name, e.g. X-Forwarded-Proto")
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + _proxy_ssl_header.upper().replace("-", "_"), "https")
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "font-src 'self'; connect-src 'self'; frame-src 'self'; frame-ancestors 'none'; base-uri 'self'; "
    "form-action 'self'; object-src 'none'"
)
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
CSRF_COOKIE_HTTPONLY = True  # the pages read the token from their form (console.js), not the cookie
if FGPU_TLS or _proxy_ssl_header:
    SECURE_HSTS_SECONDS = env_int("FGPU_HSTS_SECONDS", 365 * 86400, minimum=0, maximum=2 * 365 * 86400)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "common.logs.ProcessStderrHandler", "formatter": "plain"}},  # fd 2, looked up per record
    "root": {"handlers": ["console"], "level": env_str("FGPU_LOG_LEVEL", "INFO")},
    "loggers": {
        "daphne": {"level": "WARNING"},
        "django.channels.server": {"level": "WARNING"},
        "celery.app.trace": {"level": "WARNING"},
        "celery.worker.strategy": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},  # a line per request the app proxy sends, its URL with the app's token in a query
    },
}
