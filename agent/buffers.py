"""Text buffers the agent's parts share: a session's output waits as a list of decoded parts (one
a PTY read) in the terminal's outbox (agent.terminal_pipe) and in the log's pending output
(agent.log_shipper), and leaves them from the front."""

from __future__ import annotations


def take_front(parts: list[str], limit: int) -> str:
    """Up to `limit` characters from the front of `parts` (strings, shortened in place): the
    outbox and the log's pending output, which grow by one part a PTY read."""
    taken, size = [], 0
    while parts and size < limit:
        part = parts[0]
        if len(part) > limit - size:
            taken.append(part[: limit - size])
            parts[0] = part[limit - size :]
            break
        taken.append(parts.pop(0))
        size += len(part)
    return "".join(taken)
