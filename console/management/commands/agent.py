"""`python manage.py agent --config agent.toml`: one GPU node's agent.

Consumes Celery queue `agent.<node>` (an embedded worker, solo pool: each task only hands
work to the agent's asyncio loop), talks to the manager through queue `manager`, relays
terminals through the Redis channel layer, pushes streamed exec output to Redis on the same
URL, and never opens the database. A graceful stop (SIGTERM, Ctrl-C) leaves the sessions that
outlive their agent running for the next start to adopt (Agent.shutdown), unless `--stop-sessions`
or FGPU_STOP_SESSIONS_ON_EXIT=true.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from common.broker_acl import agent_transport_options
from common.celery import agent_queue, app
from common.env import env_bool
from common.layers import RedisChannelLayer
from common.startup import freeze_imported_objects
from protocol.exec_store import exec_store_for
from agent.boot import build_agent
from agent.config import AgentConfigError, load_agent_config
from agent.runtimes import stop_ignoring_session_signals

log = logging.getLogger("fgpu.agent")


class Command(BaseCommand):
    help = "Run the agent of one GPU node (see agent.toml in the README)."

    def add_arguments(self, parser):
        parser.add_argument("--config", required=True, help="path to agent.toml")
        parser.add_argument(
            "--stop-sessions",
            action="store_true",
            help="stop every session when the agent exits (default: FGPU_STOP_SESSIONS_ON_EXIT, else they keep "
            "running and the next start adopts them)",
        )

    def handle(self, *args, config: str, stop_sessions: bool, **options):
        stop_ignoring_session_signals()
        keep_sessions = not (stop_sessions or env_bool("FGPU_STOP_SESSIONS_ON_EXIT"))
        try:
            cfg = load_agent_config(config, default_broker=settings.REDIS_URL)
        except AgentConfigError as exc:
            raise CommandError(str(exc)) from None
        if not cfg.broker_url.startswith(("redis://", "rediss://")):
            raise CommandError(f"{cfg.path.name}: manager.broker-url: the agent needs a Redis URL (or set REDIS_URL)")
        app.conf.broker_url = cfg.broker_url  # type: ignore[misc]  # celery-types: read-only; Celery's conf takes it
        app.conf.task_always_eager = False
        # What the broker's ACL user of this node reaches (common/broker_acl.py): its unacknowledged
        # messages under keys of its own, no remote control (no pidbox fanout) and no Celery worker
        # heartbeat events (`without_heartbeat` below; the agent's own heartbeat is a manager task).
        app.conf.broker_transport_options = {**app.conf.broker_transport_options, **agent_transport_options(cfg.node_name)}
        app.conf.worker_enable_remote_control = False
        # Same layer settings as the web's (console.settings), on the agent's broker URL.
        layer = RedisChannelLayer(hosts=[{"address": cfg.broker_url, "socket_timeout": None}], capacity=1000, expiry=60)
        try:
            agent = build_agent(
                cfg,
                celery_app=app,
                channel_layer=layer,
                heartbeat_s=settings.FGPU_HEARTBEAT_INTERVAL,
                exec_store=exec_store_for(cfg.broker_url),
            )
        except Exception as exc:
            raise CommandError(f"{cfg.path.name}: could not start the agent (compute plugins, runtime): {exc}") from None
        for warning in agent.inventory.get("warnings", []):
            self.stderr.write(f"warning: {warning}")

        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run_loop():
            asyncio.set_event_loop(loop)
            loop.run_until_complete(agent.start())
            ready.set()
            loop.run_forever()

        thread = threading.Thread(target=run_loop, name="agent-loop", daemon=True)
        thread.start()
        if not ready.wait(timeout=60):
            raise CommandError("the agent did not start within 60 s (is Redis reachable?)")
        freeze_imported_objects(f"agent {cfg.node_name}")
        self.stdout.write(
            f"agent {cfg.node_name}: {len(agent.inventory['devices'])} device(s), queue {agent_queue(cfg.node_name)}"
        )
        worker = app.Worker(
            hostname=f"agent@{cfg.node_name}",
            queues=[agent_queue(cfg.node_name)],
            pool="solo",
            concurrency=1,
            without_mingle=True,
            without_gossip=True,
            without_heartbeat=True,
            loglevel="INFO",
        )
        try:
            worker.start()
        finally:
            kept = asyncio.run_coroutine_threadsafe(agent.shutdown(keep_sessions=keep_sessions), loop).result(timeout=30)
            loop.call_soon_threadsafe(loop.stop)
            if kept:
                self.stdout.write(f"agent {cfg.node_name}: {kept} session(s) keep running; the next start adopts them")
