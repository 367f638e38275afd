"""`fgpu`: the command line of fGPU Console. Talks only to the REST API (`/api/v1/`) and the
terminal websocket; stdlib `urllib` for HTTP, `websockets` for terminals."""

__version__ = "0.1.0"
