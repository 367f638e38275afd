"""Session apps from an image's labels (issue 16, item 1): Backend.AI's `ai.backend.service-ports`
label, e.g. `jupyter:http:8080,jupyterlab:http:8090,tensorboard:http:6006`, and the commands of
the apps this console knows how to start. Pure Python (no Django): the model's label validator
and the manager's apply both use it.

The label's grammar and rules are Backend.AI's (`ai.backend.common.service_ports.parse_service_ports`):
comma-separated entries `name:protocol:port` or `name:protocol:[port,port,…]`; `name` of word
characters and "-"; `protocol` one of `tcp`, `http`, `preopen` (`pty` entries are skipped, as
Backend.AI skips them); every port above 1024 and below 65535, none used twice, none of Backend.AI's
reserved 2000-2003, 2200 and 7681. A label that breaks any rule is refused whole (ServicePortsError
naming the entry and the rule): nothing of it is taken, and whatever the image record had stays.

What becomes an app (`apps_from_service_ports`): an `http` or `preopen` entry whose name this
console knows a command for (KNOWN_APPS: Backend.AI's intrinsic Jupyter apps; its other apps are
started from service definitions inside the image, /etc/backend.ai/service-defs, which an image
inspect cannot read), on its first port. A `tcp` entry (no HTTP to proxy) and an entry without a
known command are left out, each with a note saying why. The image record's own `apps` win over
the label's by name (`merged_apps`).
"""

from __future__ import annotations

import re

from protocol import SERVICE_PORTS_LABEL

PROTOCOLS = ("tcp", "http", "preopen")  # Backend.AI's ServicePortProtocols
RESERVED_PORTS = (2000, 2001, 2002, 2003, 2200, 7681)  # Backend.AI's, for its own kernel runner
MAX_LABEL = 1024  # characters (the image record's labels' limit)
_ENTRY = re.compile(r"(?P<name>[\w-]+):(?P<proto>\w+):(?P<ports>\[\d+(?:,\d+)*\]|\d+)(?:,|$)", re.ASCII)


class ServicePortsError(ValueError):
    """A malformed `ai.backend.service-ports` label; the message names the entry and the rule."""


def jupyter_app(
    *,
    python: str = "python3",
    name: str = "jupyter",
    title: str = "JupyterLab",
    port: int = 8888,
    module: str = "jupyterlab",
    path: str = "lab",
) -> dict:
    """JupyterLab (`module` "jupyterlab") or the classic Notebook ("notebook", path "tree") as a
    session app: `python -m <module>` under the console's prefix with the console's token,
    remote access allowed (the Host it sees is the console's; root allowed: the process runtime
    runs sessions as the agent's user). The standalone demo's, and the label's Jupyter apps."""
    return {
        "name": name,
        "title": title,
        "port": port,
        "base_url": True,
        "path": path,
        "timeout": 120,
        "command": f"exec {python} -m {module} --no-browser --ip={{host}} --port={{port}} "
        "--ServerApp.base_url={base_url} --IdentityProvider.token={token} "
        "--ServerApp.allow_remote_access=True --allow-root",
    }


# name in the label → the app (its port filled in from the label). Backend.AI's intrinsic Jupyter apps.
KNOWN_APPS = {
    "jupyter": lambda port: jupyter_app(name="jupyter", title="Jupyter Notebook", port=port, module="notebook", path="tree"),
    "jupyterlab": lambda port: jupyter_app(name="jupyterlab", title="JupyterLab", port=port),
}


def parse_service_ports(label: str) -> list[dict]:
    """The entries of an `ai.backend.service-ports` label: `[{"name", "protocol", "ports": (int,
    …)}]` in the label's order ("" → []). Raises ServicePortsError (see the module docstring for
    the rules, which are Backend.AI's)."""
    if not isinstance(label, str):
        raise ServicePortsError(f'{SERVICE_PORTS_LABEL}: text such as "jupyterlab:http:8090", not {type(label).__name__}')
    if len(label) > MAX_LABEL:
        raise ServicePortsError(f"{SERVICE_PORTS_LABEL}: at most {MAX_LABEL} characters")
    entries, used, rest, position = [], set(), label, 1
    while rest:
        match = _ENTRY.match(rest)
        if match is None:
            shown = rest.split(",", 1)[0][:60]
            raise ServicePortsError(
                f"{SERVICE_PORTS_LABEL}: entry {position} ({shown!r}) is not name:protocol:port "
                "or name:protocol:[port,port] (e.g. jupyterlab:http:8090)"
            )
        rest = rest[match.end() :]
        if match.group(0).endswith(",") and not rest:
            raise ServicePortsError(f"{SERVICE_PORTS_LABEL}: a comma ends the label (an empty entry {position + 1})")
        name, proto = match.group("name"), match.group("proto")
        where = f"{SERVICE_PORTS_LABEL}: entry {position} ({name})"
        position += 1
        if proto == "pty":
            continue  # as Backend.AI: not a service port
        if proto not in PROTOCOLS:
            raise ServicePortsError(f"{where}: protocol {proto!r} is not one of {', '.join(PROTOCOLS)}")
        ports = tuple(int(p) for p in match.group("ports").strip("[]").split(","))
        for port in ports:
            if port in used:
                raise ServicePortsError(f"{where}: port {port} is used by another entry")
            if port <= 1024:
                raise ServicePortsError(f"{where}: port {port} must be above 1024 (to run without root)")
            if port >= 65535:
                raise ServicePortsError(f"{where}: port {port} must be below 65535")
            if port in RESERVED_PORTS:
                raise ServicePortsError(f"{where}: port {port} is reserved (2000-2003, 2200 and 7681)")
            used.add(port)
        entries.append({"name": name, "protocol": proto, "ports": ports})
    return entries


def apps_from_service_ports(label: str) -> tuple[list[dict], list[str]]:
    """The session apps an `ai.backend.service-ports` label declares, and a note for each entry
    left out (why): `([app, …], ["tensorboard: no command known for it …", …])`. Raises
    ServicePortsError for a malformed label (`parse_service_ports`)."""
    apps, notes = [], []
    for entry in parse_service_ports(label):
        name = entry["name"]
        if entry["protocol"] == "tcp":
            notes.append(f"{name}: a tcp service (the console proxies HTTP apps only)")
            continue
        make = KNOWN_APPS.get(name.lower())
        if make is None:
            notes.append(f"{name}: no command known for it (declare it in the image's apps)")
            continue
        apps.append(make(entry["ports"][0]))
    return apps, notes


def merged_apps(explicit: list, labels: dict | None) -> list:
    """An image's apps: its record's own (`explicit`, SessionImage.apps) and, after them, those
    its `ai.backend.service-ports` label in `labels` declares under names and titles the record does
    not use (the record's win: the host image's "jupyter", titled JupyterLab, and its label's
    "jupyterlab" are one app, not two buttons). A label that cannot be parsed adds nothing (it was
    refused when written)."""
    label = (labels or {}).get(SERVICE_PORTS_LABEL) if isinstance(labels, dict) else None
    if not label:
        return explicit
    try:
        from_label, _ = apps_from_service_ports(label)
    except ServicePortsError:
        return explicit
    names = {app.get("name") for app in explicit if isinstance(app, dict)}
    titles = {str(app.get("title") or app.get("name") or "").casefold() for app in explicit if isinstance(app, dict)}
    return [*explicit, *(app for app in from_label if app["name"] not in names and app["title"].casefold() not in titles)]
