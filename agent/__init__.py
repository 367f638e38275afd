"""The node side: one agent per GPU node (`python manage.py agent --config agent.toml`).

Flow: the manager's start message arrives on Celery queue `agent.<node>` (agent/tasks.py) →
the Agent (agent/core.py) prepares the session (protocol/environment.py: the environment contract;
agent/nvidia_smi.py: the virtual nvidia-smi; agent/mig.py: MIG instances on the node) and
starts it through a runtime (agent/runtimes.py: the interface and the `process` runtime;
agent/docker_runtime.py: one container per session) → the session's PTY is relayed through the
channel layer to the terminal consumers; reports go back to the manager as Celery tasks.
agent/config.py reads agent.toml, agent/boot.py builds an Agent from it; the process itself
(the Django command, which wires in the console's Celery app, channel layer and broker ACL) is
console/management/commands/agent.py.

The agent talks to the manager only through `protocol` (task, queue and group names, message
shapes, the exec store); of the rest of the project it imports only `accelerators.allocation`,
the compute plugins (`accelerators.plugins`) and the pure config parse they read
(`accelerators.config_parse`): no Django, nothing of the console or the manager's services,
scheduler or models (import-linter's contracts in pyproject.toml and tests/test_layering.py keep
it so); it never opens the database.
"""
