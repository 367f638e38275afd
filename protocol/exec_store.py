"""Where streamed execs (`POST /sessions/<id>/exec/` with `"stream": true`) keep their state and
output, so that any web process can answer a read and the agent can push output as it comes.

Two stores with one interface: RedisExecStore (the web and the agents share the Redis that is
already the Celery broker and the channel layer) and MemoryExecStore (standalone mode: the web
and its embedded agents share one process). Neither touches the database.

Redis keys, per node (issue 31: an agent's broker user reaches `fgpu:exec:<its node's tag>:*`
only): a store id is `record_id(node, exec id)` = `<node tag>:<exec id>` (protocol.channel.node_tag),
and `fgpu:exec:<store id>` is a hash, the exec's record (strings: `session`, `node`, `command`
(JSON), `timeout` (s), `cap` (bytes per stream), `state`, `cancel`, `created_ms`, `started_ms`,
`exit_code`, `error`, `duration_ms`, `truncated`, `bytes_o`, `bytes_e`); `fgpu:exec:<store id>:out` is
a list of output chunks, each its stream's letter (`o` stdout, `e` stderr) followed by UTF-8
text. Both expire together (`ttl_s` at creation, re-armed by a transition that passes one).

States: `starting` (the web sent it; no agent took it yet) → `running` → `exited` |
`timed_out` | `cancelled`; `failed` when the agent could not run it or stopped answering;
`starting` → `cancelled` when cancelled before the agent took it. Every change is a
compare-and-set on `state` (`transition`), so the agent and the web never both win.
"""

from __future__ import annotations

import threading
import time

from protocol.channel import node_tag

STDOUT, STDERR = "o", "e"
STREAM_NAMES = {STDOUT: "stdout", STDERR: "stderr"}
STREAMS = tuple(STREAM_NAMES.values())
STATES = ("starting", "running", "exited", "timed_out", "cancelled", "failed")
LIVE_STATES = ("starting", "running")

_KEY = "fgpu:exec:{}"


def record_id(node: str, exec_id: str) -> str:
    """The store id of exec `exec_id` of a session on `node` (the id every method below takes):
    the web computes it from the session's node, the agent from its own, never from a message."""
    return f"{node_tag(node)}:{exec_id}"


# KEYS: record, output. ARGV: allowed states (comma list), ttl ("" keeps it), then field, value, ...
_TRANSITION = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == state then allowed = true end end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
if ARGV[2] ~= '' then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
return 1
"""

# KEYS: record, output. ARGV: stream letter, text, stream letter, text, ... Appends what fits under
# the record's per-stream `cap` (cut back to a UTF-8 character boundary), marks `truncated` when
# something was cut, and answers the letters of the streams that are full (or -1: no such exec).
_APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local cap = tonumber(redis.call('HGET', KEYS[1], 'cap'))
local full = ''
for i = 1, #ARGV, 2 do
  local stream, data = ARGV[i], ARGV[i + 1]
  local field = 'bytes_' .. stream
  local used = tonumber(redis.call('HGET', KEYS[1], field) or '0')
  if #data > cap - used then
    local n = math.max(cap - used, 0)
    while n > 0 do
      local b = string.byte(data, n + 1)
      if b >= 128 and b < 192 then n = n - 1 else break end
    end
    data = string.sub(data, 1, n)
    redis.call('HSET', KEYS[1], 'truncated', '1')
    full = full .. stream
  end
  if #data > 0 then
    redis.call('RPUSH', KEYS[2], stream .. data)
    redis.call('HINCRBY', KEYS[1], field, #data)
  end
end
local ttl = redis.call('TTL', KEYS[1])
if ttl > 0 then redis.call('EXPIRE', KEYS[2], ttl) end
return full
"""


def _fit(text: str, room: int) -> tuple[str, bool]:
    """`text` cut to at most `room` UTF-8 bytes at a character boundary; whether it was cut."""
    data = text.encode()
    if len(data) <= room:
        return text, False
    return data[: max(room, 0)].decode("utf-8", "ignore"), True


class RedisExecStore:
    """The store on a Redis URL (redis://, rediss://, unix://). Thread-safe; blocking calls."""

    def __init__(self, url: str) -> None:
        import redis

        self.redis = redis.Redis.from_url(url)
        self._transition = self.redis.register_script(_TRANSITION)
        self._append = self.redis.register_script(_APPEND)

    @staticmethod
    def _keys(exec_id: str) -> list[str]:
        key = _KEY.format(exec_id)
        return [key, key + ":out"]

    def create(self, exec_id: str, record: dict[str, str], *, ttl_s: int) -> None:
        """Write a new exec's record (its `state` included), expiring after `ttl_s` seconds."""
        key, _ = self._keys(exec_id)
        with self.redis.pipeline() as pipe:
            # redis-py's annotation: a Mapping's key type is invariant, so it refuses dict[str, str].
            pipe.hset(key, mapping=record)  # type: ignore[arg-type]
            pipe.expire(key, ttl_s)
            pipe.execute()

    def transition(self, exec_id: str, *, from_states: tuple[str, ...], fields: dict[str, str], ttl_s: int | None = None) -> bool:
        """Set `fields` (at least one) only while the exec's state is one of `from_states`; re-arm
        the expiry to `ttl_s` seconds when given. False if the state was another or the exec is
        unknown (expired)."""
        args = [",".join(from_states), "" if ttl_s is None else str(ttl_s)]
        for name, value in fields.items():
            args += [name, value]
        return bool(self._transition(keys=self._keys(exec_id), args=args))

    def append(self, exec_id: str, chunks: list[tuple[str, str]]) -> set[str] | None:
        """Append `(stream letter, text)` chunks in order, each stream cut at the record's `cap`
        bytes. Returns the letters of the streams that are full (later output of theirs is
        dropped), or None when the exec is unknown (expired)."""
        if not chunks:
            return set()
        args = [part for chunk in chunks for part in chunk]
        answer = self._append(keys=self._keys(exec_id), args=args)
        if answer == -1:
            return None
        return set(answer.decode() if isinstance(answer, bytes) else answer)

    def get(self, exec_id: str) -> dict[str, str] | None:
        """The exec's record, or None when unknown (expired)."""
        # redis-py types replies bytes | str; this client does not decode them: bytes.
        record: dict[bytes, bytes] = self.redis.hgetall(self._keys(exec_id)[0])  # type: ignore[assignment]
        return {k.decode(): v.decode() for k, v in record.items()} or None

    def read(self, exec_id: str, *, since: int, max_chunks: int) -> tuple[dict[str, str] | None, list[tuple[str, str]], int]:
        """In one transaction: the record (None when unknown), at most `max_chunks` chunks from
        index `since` as `(stream letter, text)`, and how many chunks there are in all."""
        key, out = self._keys(exec_id)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.lrange(out, since, since + max_chunks - 1)
            pipe.llen(out)
            record, raw, total = pipe.execute()
        if not record:
            return None, [], 0
        chunks = [(item[:1].decode(), item[1:].decode("utf-8", "replace")) for item in raw]
        return {k.decode(): v.decode() for k, v in record.items()}, chunks, total


class MemoryExecStore:
    """The same store in this process's memory (standalone mode). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._execs: dict[str, tuple[dict[str, str], list[tuple[str, str]], list[float]]] = {}

    def _live(self, exec_id: str) -> tuple[dict[str, str], list[tuple[str, str]], list[float]] | None:
        entry = self._execs.get(exec_id)
        if entry is not None and entry[2][0] <= time.monotonic():
            del self._execs[exec_id]
            return None
        return entry

    def create(self, exec_id: str, record: dict[str, str], *, ttl_s: int) -> None:
        with self._lock:
            now = time.monotonic()
            for old in [k for k, (_, _, expires) in self._execs.items() if expires[0] <= now]:
                del self._execs[old]
            self._execs[exec_id] = (dict(record), [], [now + ttl_s])

    def transition(self, exec_id: str, *, from_states: tuple[str, ...], fields: dict[str, str], ttl_s: int | None = None) -> bool:
        with self._lock:
            entry = self._live(exec_id)
            if entry is None or entry[0].get("state") not in from_states:
                return False
            entry[0].update(fields)
            if ttl_s is not None:
                entry[2][0] = time.monotonic() + ttl_s
            return True

    def append(self, exec_id: str, chunks: list[tuple[str, str]]) -> set[str] | None:
        with self._lock:
            entry = self._live(exec_id)
            if entry is None:
                return None
            record, output, _ = entry
            full = set()
            for stream, text in chunks:
                used = int(record.get(f"bytes_{stream}", "0"))
                text, cut = _fit(text, int(record["cap"]) - used)
                if cut:
                    record["truncated"] = "1"
                    full.add(stream)
                if text:
                    output.append((stream, text))
                    record[f"bytes_{stream}"] = str(used + len(text.encode()))
            return full

    def get(self, exec_id: str) -> dict[str, str] | None:
        with self._lock:
            entry = self._live(exec_id)
            return dict(entry[0]) if entry else None

    def read(self, exec_id: str, *, since: int, max_chunks: int) -> tuple[dict[str, str] | None, list[tuple[str, str]], int]:
        with self._lock:
            entry = self._live(exec_id)
            if entry is None:
                return None, [], 0
            record, output, _ = entry
            return dict(record), output[since : since + max_chunks], len(output)


_MEMORY = MemoryExecStore()
_REDIS: dict[str, RedisExecStore] = {}
_REDIS_LOCK = threading.Lock()


def exec_store_for(url: str) -> RedisExecStore | MemoryExecStore:
    """The store on Redis URL `url` (one per URL and process), or this process's memory store
    when `url` is empty or not a Redis URL (`memory://`)."""
    if not url or not url.startswith(("redis://", "rediss://", "unix://")):
        return _MEMORY
    with _REDIS_LOCK:
        if url not in _REDIS:
            _REDIS[url] = RedisExecStore(url)
        return _REDIS[url]
