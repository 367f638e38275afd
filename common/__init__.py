"""The console's shared library: what the apps (accelerators, accounts, sessions, usage) and the
wiring (console/) import alike, and which imports none of them (an import-linter contract; README,
"The code"). The application error and the API's error shape (errors, api_errors, api_support,
api_async, api_parsers, api_pagination), the request guards the settings name (input_guard,
security_headers), the channel layers (layers), the Celery app with its routes and `agent_send`
(celery; console.celery wires its tasks and worker signals), the broker's repair and its ACL
(broker, broker_acl), the exec store (exec_store), settings helpers (env, secret_key) and a
process's start-up (startup).
"""
