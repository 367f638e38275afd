"""`python manage.py standalone` (what `make run` starts): the whole console on one machine.

Migrates the SQLite database under FGPU_DATA_DIR (where a migration is not yet applied),
imports the accelerator settings, makes sure user `admin` exists, then serves http://127.0.0.1:$PORT with uvicorn and runs one
embedded agent (one mock node) per agent.toml in FGPU_AGENT_CONFIG on uvicorn's event loop.
Environment: PORT (8000), FGPU_ADMIN_PASSWORD, FGPU_AGENT_CONFIG (demo/agent.toml),
FGPU_ACCELERATOR_CONFIG (an etcd-style JSON; the demo's is imported only on first start),
FGPU_DATA_DIR (./var), FGPU_RUNTIME (auto: docker where Docker Engine answers and holds the
session image, else process; see Command._choose_runtime), FGPU_STOP_SESSIONS_ON_EXIT (false:
sessions that outlive their agent keep running when it stops and the next start adopts them;
true, or `--stop-sessions`: every session is stopped as it exits).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import pkgutil
import secrets
import signal
import socket
import sys
from collections.abc import Callable
from urllib.parse import urlsplit

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.apps import apps
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder

import protocol
from accelerators.config_import import ConfigError, import_accelerator_config
from accelerators.models import FractionalSettings, MigMode, Node, NodeStatus, ResourceGroup
from accelerators.selectors import DEFAULT_GROUP
from common.celery import app as celery_app
from common.env import env_bool, env_int, env_list, env_str
from common.exec_store import exec_store_default
from common.startup import freeze_imported_objects
from agent.boot import build_agent
from agent.config import AgentConfigError, load_agent_config
from sessions.policy.images import image_default, image_save
from sessions.models import SessionImage
from sessions.serving.origin import host_key, origin_key
from sessions.serving.session_apps import jupyter_app
from agent.docker_runtime import docker_engine_probe, docker_engine_where, docker_image_present
from agent.runtimes import DOCKER, PROCESS, RUNTIMES, stop_ignoring_session_signals

log = logging.getLogger("fgpu.standalone")

DEMO_AGENT = settings.BASE_DIR / "demo" / "agent.toml"
DEMO_ACCELERATOR = settings.BASE_DIR / "demo" / "accelerator.json"
DEMO_MIG_AGENT = settings.BASE_DIR / "demo" / "agent-mig-h100.toml"  # `--demo full` (make run DEMO=full): dynamic MIG
DEMO_WHOLE_AGENT = settings.BASE_DIR / "demo" / "agent-rocm.toml"  # `--demo full` too: whole GPUs (rocm, discrete mode)
AUTO = "auto"  # FGPU_RUNTIME: docker where Docker Engine answers and holds the session image, else process
IMAGE_BUILD_TIME = "1-4 minutes"  # `make image` (tests/images/build.sh) on 2 cores: 60 s alone, 3.3 min beside other work


class Command(BaseCommand):
    help = "Run fGPU Console on this machine: web, manager and mock agents in one process."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=env_str("FGPU_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=None)
        parser.add_argument(
            "--stop-sessions",
            action="store_true",
            help="stop every session when the console exits (default: FGPU_STOP_SESSIONS_ON_EXIT, else they keep "
            "running and the next start adopts them)",
        )
        parser.add_argument(
            "--demo",
            choices=["", "full"],
            default="",
            help="full (make run DEMO=full): the demo's MIG node too (demo/agent-mig-h100.toml, where FGPU_AGENT_CONFIG "
            "names no agents), in dynamic MIG mode from its first start, and its whole-GPU node (demo/agent-rocm.toml: "
            "two GPUs of the rocm slot, in discrete mode)",
        )

    def handle(self, *args, host: str, port: int | None, stop_sessions: bool, demo: str = "", **options):
        stop_ignoring_session_signals()
        port = port or env_int("PORT", 8000, minimum=1, maximum=65535)
        self.stop_sessions = stop_sessions or env_bool("FGPU_STOP_SESSIONS_ON_EXIT")
        demo_agents = [DEMO_AGENT] + ([DEMO_MIG_AGENT, DEMO_WHOLE_AGENT] if demo == "full" else [])
        agent_files = env_list("FGPU_AGENT_CONFIG", [str(path) for path in demo_agents])
        self.demo = demo

        def load(runtime: str | None = None) -> list:
            try:
                configs = [load_agent_config(path, runtime=runtime) for path in agent_files]
            except AgentConfigError as exc:
                raise CommandError(f"FGPU_AGENT_CONFIG: {exc}") from None
            return [
                dataclasses.replace(
                    c,
                    scratch_root=settings.FGPU_SESSIONS_DIR / c.node_name,
                    data_root=settings.DATA_DIR / "user-data",
                    storage_shared=True,
                )  # one data-root for every embedded node, as NFS would be: shared storage ([storage] shared)
                for c in configs
            ]

        configs = load()
        names = [c.node_name for c in configs]
        if len(set(names)) != len(names):
            raise CommandError(f"FGPU_AGENT_CONFIG: two agent.toml files use the same [agent] id: {names}")
        configs = load(self._choose_runtime(env_str("FGPU_RUNTIME", AUTO), configs))  # that runtime's defaults (network)

        if not migrations_all_applied():
            call_command("migrate", interactive=False, verbosity=0)
        if not FractionalSettings.objects.filter(slot_name="cuda").exists():  # first start: the demo offers Jupyter
            SessionImage.objects.filter(reference=protocol.HOST_IMAGE, apps=[]).update(apps=[jupyter_app(python=sys.executable)])
        self._import_settings(configs)
        self._seed_new_nodes(configs)
        self._register_node_keys(configs)
        self._register_images(configs)
        admin_password_check = self._ensure_admin()
        agents = []
        for config in configs:
            try:
                agents.append(
                    build_agent(
                        config,
                        celery_app=celery_app,
                        channel_layer=get_channel_layer(),
                        exec_store=exec_store_default(),
                        heartbeat_s=settings.FGPU_HEARTBEAT_INTERVAL,
                        terminal_direct=False,  # its consumers share its loop: the in-memory layer is shorter
                    )
                )
            except Exception as exc:
                raise CommandError(f"{config.path}: could not load the compute plugins: {exc}") from None
        self._serve(host, port, agents, after_start=admin_password_check)

    def _choose_runtime(self, requested: str, configs) -> str:
        """The runtime of every embedded agent, from FGPU_RUNTIME: "process", "docker", or "auto"
        (the default): docker where Docker Engine answers (docker_engine_probe, 3 s at most) and
        holds every agent's `default-image`, else process. Says which and why in one or two lines.
        Raises CommandError for an unknown value, or for "docker" when Docker Engine does not answer."""
        if requested not in (AUTO, *RUNTIMES):
            raise CommandError(f"FGPU_RUNTIME={requested!r}: expected one of {AUTO}, {', '.join(RUNTIMES)}")
        if requested == PROCESS:
            self.stdout.write("Sessions run as processes on this machine (FGPU_RUNTIME=process).")
            return PROCESS
        where = docker_engine_where()
        client, problem = docker_engine_probe(timeout_s=3)
        if client is None:
            if requested == DOCKER:
                raise CommandError(f"FGPU_RUNTIME=docker: Docker Engine does not answer at {where}: {problem}")
            self.stdout.write(
                f"Sessions run as processes on this machine (the process runtime): Docker Engine does not answer "
                f"at {where} ({problem}). FGPU_RUNTIME=docker or process chooses."
            )
            return PROCESS
        try:
            images = sorted({c.default_image for c in configs})
            missing = [image for image in images if not docker_image_present(client, image)]
        finally:
            client.close()
        if missing and requested == AUTO:
            self.stdout.write(
                self.style.WARNING(
                    f"Docker Engine answers at {where}, but the session image {', '.join(missing)} is not on this "
                    f"machine: `sudo make image` builds it from Debian's packages (about {IMAGE_BUILD_TIME}, its "
                    "progress shown), then start again. This start runs sessions as processes on this machine "
                    "(the process runtime)."
                )
            )
            return PROCESS
        if missing:  # docker, asked for by name: a session's image may still be pulled (pull-images)
            self.stdout.write(
                self.style.WARNING(
                    f"The session image {', '.join(missing)} is not on this machine: `sudo make image` builds it "
                    f"(about {IMAGE_BUILD_TIME}); until then a session that needs it is pulled or fails."
                )
            )
        chosen = "FGPU_RUNTIME=docker" if requested == DOCKER else f"Docker Engine answers at {where}"
        self.stdout.write(f"Sessions run in Docker containers (image {', '.join(images)}): {chosen}.")
        return DOCKER

    def _import_settings(self, configs) -> None:
        # On first start (no cuda settings yet) the demo's "1 physical GPU = 2 fGPU" is
        # applied; later starts keep what an administrator changed in the admin pages.
        first_start = not FractionalSettings.objects.filter(slot_name="cuda").exists()
        try:
            for config in configs:
                if config.mock_config:
                    report = import_accelerator_config(config.mock_config)
                    for warning in report.warnings:
                        self.stderr.write(f"warning: {config.mock_config.name}: {warning}")
            explicit = env_str("FGPU_ACCELERATOR_CONFIG")
            if explicit:
                import_accelerator_config(explicit)
            elif first_start:
                import_accelerator_config(DEMO_ACCELERATOR)
        except ConfigError as exc:
            raise CommandError(str(exc)) from None

    def _seed_new_nodes(self, configs) -> None:
        """Each embedded node this console has never seen gets its row before its agent registers
        (LOST, no devices, as `node_agent_key_rotate` makes one): in the resource group "default",
        made here while the console has no resource group at all (so the demo's fragmentation map,
        admin → Compute sessions → Fragmentation maps, lists it), and with `--demo full` the demo's
        MIG node (demo/agent-mig-h100.toml) in dynamic MIG mode, so the launch dialog's MIG tab works
        at once (without it, MIG stays off there as on any new node, and its GPU serves fGPU). A node
        seen before keeps what an administrator set; so do nodes while other groups exist."""
        known = set(Node.objects.filter(name__in=[c.node_name for c in configs]).values_list("name", flat=True))
        new = [c for c in configs if c.node_name not in known]
        if not new:
            return
        group = ResourceGroup.objects.filter(name=DEFAULT_GROUP).first()
        if group is None and not ResourceGroup.objects.exists():
            group = ResourceGroup.objects.create(name=DEFAULT_GROUP, description="the standalone console's nodes")
        for config in new:
            demo_mig = self.demo == "full" and config.path.resolve() == DEMO_MIG_AGENT.resolve()
            mig = MigMode.DYNAMIC if demo_mig else MigMode.OFF
            Node.objects.create(name=config.node_name, status=NodeStatus.LOST, resource_group=group, mig_mode=mig)

    def _register_node_keys(self, configs) -> None:
        """Each embedded node's agent key is its agent.toml's `[manager] node-key` (or FGPU_NODE_KEY):
        the console and its agents share this machine, so what the agent signs and verifies with is
        the key of its Node row, with which the web seals its commands and checks the agent's answers
        (protocol.channel) and derives its app relay's key (protocol.app_relay). A key set there is
        registered (said once); one taken out of agent.toml is taken off the row (its commands then go
        unsealed, as the keyless agent takes them). Raises CommandError for a key longer than the row
        holds (64 characters). Without this, a keyed agent refused every command
        of the web (unsealed: the row had no key) and the web every answer of it."""
        longest = Node._meta.get_field("agent_key").max_length or 0
        for config in configs:
            if len(config.node_key) > longest:
                raise CommandError(
                    f"{config.path}: [manager] node-key is {len(config.node_key)} characters, the most a node's key may "
                    f"be is {longest}: `manage.py node_key {config.node_name}` makes one"
                )
            updated = Node.objects.filter(name=config.node_name).exclude(agent_key=config.node_key)
            if updated.update(agent_key=config.node_key):
                said = "registered its agent.toml node-key" if config.node_key else "has no node-key in agent.toml any more"
                self.stdout.write(f"Node {config.node_name}: {said}.")

    def _register_images(self, configs) -> None:
        """With the docker runtime, each agent's `default-image` is a registered session image, and
        the default while "host" (which no docker node holds) is, so a launch naming no image
        starts; an administrator's choice of default is kept. A newly registered one declares the
        JupyterLab app (`python3 -m jupyterlab` in the image: one without it says so when opened)."""
        for config in configs:
            if config.runtime != DOCKER:
                continue
            image, _ = SessionImage.objects.get_or_create(
                reference=config.default_image,
                defaults={
                    "description": f"the default-image of {config.path.name} (node {config.node_name})",
                    "apps": [jupyter_app(python="python3")],
                },
            )  # the demo offers Jupyter (where the image has it)
            current = image_default()
            if current is None or current.reference == protocol.HOST_IMAGE:
                image.is_default = True
                image_save(image=image)

    def _ensure_admin(self) -> Callable[[], None] | None:
        """Makes user admin where there is none (FGPU_ADMIN_PASSWORD's password, else a random one
        said once). Where admin exists and FGPU_ADMIN_PASSWORD is set, returns the check that sets
        that password if it changed, for `_serve` to run once the console serves: the check hashes
        the password (PBKDF2, Django's 1,000,000 iterations: 0.3-0.4 CPU-s, a sixth of a restart,
        measured 2026-11-28), which the first page need not wait for. Else None."""
        User = get_user_model()
        password = env_str("FGPU_ADMIN_PASSWORD")
        user = User.objects.filter(username="admin").first()
        if user is None:
            generated = not password
            password = password or secrets.token_urlsafe(12)
            User.objects.create_superuser("admin", "admin@localhost", password)
            if generated:
                self.stdout.write(self.style.WARNING(f"Created user admin with password: {password}  (shown once)"))
            else:
                self.stdout.write("Created user admin with the password from FGPU_ADMIN_PASSWORD")
            return None
        if not password:
            return None

        def check() -> None:
            # Only when it changed: set_password rotates the hash, which signs every browser out
            # (Django ties a login session to the password hash) at every restart otherwise.
            if not user.check_password(password):
                user.set_password(password)
                user.save(update_fields=["password"])
                self.stdout.write("Changed the password of user admin to the one from FGPU_ADMIN_PASSWORD")

        return check

    def _serve(self, host: str, port: int, agents, after_start: Callable[[], None] | None = None) -> None:
        """Serve the console on host:port and session apps on their own origin (issue 31.4): a
        second socket of the same uvicorn server, FGPU_APPS_PORT (default port + 1) on `host`;
        the origin is FGPU_APPS_ORIGIN, else http://localhost:<that port> (`_apps_listener`). The
        ASGI app tells the two apart by the request's Host (sessions.serving.origin). `after_start`
        runs in a worker thread once the console serves and its agents have started."""
        import uvicorn

        apps_port, apps_origin = _apps_listener(host, port)
        settings.FGPU_APPS_ORIGIN = apps_origin  # before console.asgi reads it
        from console.asgi import application
        from sessions.lifecycle import events
        from sessions.tasks import node_check_heartbeats, schedule_pending
        from usage.tasks import usage_idle_check, usage_rollup  # also registers the agents' usage_report

        async def periodic():
            while True:
                await asyncio.sleep(settings.FGPU_HEARTBEAT_INTERVAL)
                for task in (node_check_heartbeats, schedule_pending, usage_rollup, usage_idle_check):
                    try:
                        await sync_to_async(task.delay, thread_sensitive=False)()
                    except Exception:
                        log.exception("periodic %s failed", task.name)

        async def serve():
            # log_config None: Django's LOGGING (console.settings) stays; no access log, as before.
            config = uvicorn.Config(application, host=host, port=port, lifespan="off", log_config=None, access_log=False)
            logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # the line below says where it serves
            server = uvicorn.Server(config)

            async def run_server() -> None:
                sockets = []
                try:  # each socket bound as uvicorn binds its own (Config.bind_socket); one server serves both
                    for listen in {port, apps_port}:
                        bound = uvicorn.Config(application, host=host, port=listen, log_config=None).bind_socket()
                        sockets.append(_no_delay(bound))
                    await server.serve(sockets=sockets)
                except SystemExit:  # a bind or uvicorn's startup failed, and it logged why (the port is taken, say)
                    where = ", ".join(f"{host}:{p}" for p in sorted({port, apps_port}))
                    raise CommandError(f"could not serve on {where} (the error above)") from None
                finally:
                    for sock in sockets:
                        sock.close()

            serving = asyncio.create_task(run_server())
            while not server.started:  # the agents start once the port is bound, as daphne's ready_callable did
                if serving.done():
                    return await serving
                await asyncio.sleep(0.02)
            events.use_loop(asyncio.get_running_loop())  # the in-memory channel layer lives on this loop
            for agent in agents:
                await agent.start()
            freeze_imported_objects("standalone")  # after the first page can be served, not before (console.asgi)
            background = asyncio.create_task(periodic())
            self.stdout.write(
                self.style.SUCCESS(
                    f"fGPU Console is serving on http://{host}:{port}/ (user admin; nodes: {', '.join(a.node for a in agents)})"
                )
            )
            self.stdout.write(
                f"Session apps are served on {apps_origin}/ only, their own origin (FGPU_APPS_ORIGIN, FGPU_APPS_PORT): "
                "their pages never see the console's cookies."
                + (
                    " Only this machine's browser reaches localhost: set FGPU_APPS_ORIGIN to a name other machines reach."
                    if host in ("0.0.0.0", "::") and "//localhost:" in apps_origin
                    else ""
                )
            )
            try:
                if after_start is not None:
                    try:
                        await sync_to_async(after_start, thread_sensitive=False)()
                    except Exception:  # the console serves on: it failed after the first page, not the start
                        log.exception("after the start: %s failed", getattr(after_start, "__qualname__", after_start))
                await serving
            finally:
                background.cancel()

        # uvicorn stops gracefully on SIGTERM and SIGINT, then raises the signal again for the
        # handler it found: one that does nothing lets the sessions be let go or killed below
        # (rather than the process die first, SIGTERM's default, or print a traceback, SIGINT's).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stopped)
        try:
            asyncio.run(serve())
        finally:
            self._let_sessions_go(agents)

    def _let_sessions_go(self, agents) -> None:
        """As the console exits (its loop stopped): sessions that outlive their agent (held
        process sessions, docker containers) keep running for the next start to adopt, as a
        kubelet's restart keeps its pods, and the others are killed (an unheld PTY dies with this
        process; their waiting threads would keep it from exiting); with --stop-sessions or
        FGPU_STOP_SESSIONS_ON_EXIT every session is killed. The manager stops with the console, so
        nothing is marked LOST or fenced meanwhile and the kept sessions hold their allocations
        throughout (nothing is granted twice); the next start's agent registers before the periodic
        heartbeat check runs, naming the adopted sessions as running, and those that ended meanwhile
        end with their exit status (sessions_reconcile_node)."""
        kept = sum(agent.kill_all_now(keep_sessions=not self.stop_sessions) for agent in agents)
        if kept:
            self.stdout.write(
                f"{kept} session{'s' if kept != 1 else ''} keep{'s' if kept == 1 else ''} running; the next start adopts "
                f"{'them' if kept != 1 else 'it'} (--stop-sessions or FGPU_STOP_SESSIONS_ON_EXIT=true stops them on exit)."
            )


def migrations_all_applied() -> bool:
    """Whether the database records every migration on disk as applied, so that `migrate` would
    find nothing to do: the names of each app's migration modules (listed as Django's
    MigrationLoader lists them, without importing them) against django_migrations, one query. A
    restart skips `migrate` so (its loader imports every migration: 0.14 of a restart's 2.2 CPU-s,
    measured 2026-11-28); anything else, a new or squashed migration or no table yet, migrates."""
    recorder = MigrationRecorder(connection)
    if not recorder.has_table():
        return False
    on_disk: set[tuple[str, str]] = set()
    for app in apps.get_app_configs():
        module_name, _ = MigrationLoader.migrations_module(app.label)
        if module_name is None:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        if not hasattr(module, "__path__"):
            continue
        on_disk |= {
            (app.label, name) for _, name, is_pkg in pkgutil.iter_modules(module.__path__) if not is_pkg and name[0] not in "_~"
        }
    return on_disk <= set(recorder.applied_migrations())


def _apps_listener(host: str, port: int) -> tuple[int, str]:
    """(the local port, the origin) of session apps in standalone: FGPU_APPS_PORT, else the port of
    FGPU_APPS_ORIGIN where it names one, else `port` + 1; FGPU_APPS_ORIGIN, else
    http://<host>:<that port>, where a loopback or wildcard `host` is named "localhost": another
    host name than the console's 127.0.0.1, so that a browser keeps the console's cookies from the
    apps origin (cookies are per host, not per port). Raises CommandError for a port out of range."""
    origin = settings.FGPU_APPS_ORIGIN
    named = urlsplit(origin).port if origin else None
    default = named or port + 1
    if default > 65535:
        raise CommandError(f"PORT={port}: session apps need a second port (PORT + 1); set FGPU_APPS_PORT")
    apps_port = env_int("FGPU_APPS_PORT", default, minimum=1, maximum=65535)
    if not origin:
        loopback = ("", "0.0.0.0", "::", "127.0.0.1", "::1", "localhost")
        shown = "localhost" if host in loopback else (f"[{host}]" if ":" in host else host)
        origin = f"http://{shown}:{apps_port}"
    if origin_key(origin) == host_key(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", scheme="http"):
        raise CommandError(f"FGPU_APPS_ORIGIN={origin}: that is the console's own origin; apps need one of their own")
    return apps_port, origin


def _stopped(signum, frame) -> None:
    """SIGTERM or SIGINT once uvicorn has stopped (Command._serve)."""


def _no_delay(sock: socket.socket) -> socket.socket:
    """A TCP socket uvicorn bound (Config.bind_socket: made with protocol 0) as one whose
    connections asyncio sets TCP_NODELAY on (it does so only where the socket says IPPROTO_TCP):
    with Nagle's algorithm on, an answer's body written after its headers waited for the client's
    delayed ACK, about 40 ms on each request and websocket message of the console and the app proxy.
    The listening socket gets TCP_NODELAY too, which Linux passes on to the connections it accepts."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return sock
    sock = socket.socket(fileno=sock.detach())  # family, type and protocol read back from the kernel
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
