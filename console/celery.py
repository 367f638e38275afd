"""The Celery app. Routes are declared here, in one place: manager tasks (`fgpu.manager.*`)
go to queue `manager`; agent tasks (`fgpu.agent.*`) to queue `agent.<node>`, taken from the
task's `node` keyword argument."""
from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

app = Celery("console")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["sessions"])

MANAGER_QUEUE = "manager"


def agent_queue(node: str) -> str:
    return f"agent.{node}"


def route_task(name, args, kwargs, options, task=None, **kw):
    """Celery router: every project task has a queue; an agent task without `node` is a bug."""
    if name.startswith("fgpu.manager."):
        return {"queue": MANAGER_QUEUE}
    if name.startswith("fgpu.agent."):
        node = (kwargs or {}).get("node")
        if not node:
            raise ValueError(f"task {name} needs the keyword argument node= to be routed to its agent")
        return {"queue": agent_queue(node)}
    return None


app.conf.task_routes = (route_task,)
app.conf.task_default_queue = MANAGER_QUEUE
