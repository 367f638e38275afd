"""`fgpu`: fGPU Console from the command line.

Exit codes: 0 ok; 1 refused or failed (the server's reason on one line); 2 bad usage;
3 server unreachable or not logged in; `fgpu exec` exits with the command's own status.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
import urllib.parse
import uuid
from decimal import Decimal

from fgpu_cli import __version__, config, files, terminal
from fgpu_cli.client import ApiError, Client, Unreachable
from fgpu_cli.formatting import (
    FINAL_STATUSES,
    LIVE_STATUSES,
    age,
    amount,
    decimal_text,
    eta_band,
    eta_start,
    flatten,
    gib,
    key_values,
    printable,
    shares_text,
    short_id,
    size,
    table,
    until,
)
from fgpu_cli.launch import UsageError, build_body
from fgpu_cli.mig import layout_text, node_text, profiles_text
from fgpu_cli.sessions import SESSIONS, NotFound, resolve
from fgpu_cli.usage import storage_text, usage_csv, usage_text

OK, FAILED, USAGE, UNREACHABLE = 0, 1, 2, 3
POLL_INTERVAL = 0.5
LAUNCH_RETRY_DELAYS = (1.0, 2.0)  # seconds before sending a launch a 2nd and a 3rd time
LAUNCH_RETRY_STATUSES = (502, 503, 504)  # answers worth retrying (besides no answer at all)
EXEC_POLL_INTERVAL = 0.2  # seconds between reads of a streamed exec while no output comes


class Failed(Exception):
    """A refusal or failure with a message for `fgpu: error: …` (exit 1 unless `code`)."""

    def __init__(self, message: str, code: int = FAILED) -> None:
        super().__init__(message)
        self.code = code


# --- helpers ----------------------------------------------------------------------------------


def _client(args) -> tuple[Client, config.Credentials]:
    creds = config.credentials()
    return Client(creds.url, creds.token, timeout=args.http_timeout), creds


def _emit_json(value) -> None:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _info(message: str) -> None:
    """One line on stderr; control characters (in a session's name, a server's reason) escaped."""
    sys.stderr.write(printable(message) + "\n")
    sys.stderr.flush()


def _slot_formats(client: Client) -> dict[str, dict]:
    """slot_name → how its fGPU amounts are shown ({"unit", "round_length", "binary"}), from the
    slot formats API; the default format ("1.50 fGPU") where it cannot be read."""
    formats = {}
    try:
        for fmt in client.get_all("/api/v1/slot-formats/"):
            if fmt.get("subtype") == "shares":
                number = fmt.get("number_format") or {}
                formats[fmt.get("slot_name")] = {
                    "unit": fmt.get("display_unit") or "fGPU",
                    "round_length": int(number.get("round_length", 2) or 0),
                    "binary": bool(number.get("binary", False)),
                }
    except (ApiError, Unreachable, AttributeError, TypeError, ValueError):
        return {}
    return formats


def _fgpu(value, formats: dict, slot_name: str | None) -> str:
    fmt = formats.get(slot_name) or {"unit": "fGPU", "round_length": 2, "binary": False}
    return amount(value, unit=fmt["unit"], round_length=fmt["round_length"], binary=fmt.get("binary", False))


def _running_session(client, creds, ref: str, *, interactive_only: bool = False) -> dict:
    session = resolve(client, ref, username=creds.username)
    if session["status"] != "RUNNING":
        reason = f": {session['status_reason']}" if session.get("status_reason") else ""
        raise Failed(
            f"session {session.get('name') or short_id(session['id'])} is {session['status']}{reason}; "
            "it takes commands and terminals only while it is RUNNING"
        )
    if interactive_only and session.get("command"):
        raise Failed(
            f"session {session.get('name') or short_id(session['id'])} runs the batch command "
            f"{session['command']!r}; exec needs an interactive session (launched without --command)"
        )
    return session


def _terminal_url(client: Client, session: dict) -> str:
    ticket = client.post(f"{SESSIONS}{session['id']}/terminal-ticket/")
    return client.websocket_url(ticket["url"])


def _run_async(coroutine) -> int:
    import asyncio  # only the terminal needs it: `fgpu --help` and the REST commands start without it

    return asyncio.run(coroutine)


# --- commands -------------------------------------------------------------------------------


def cmd_login(args) -> int:
    try:
        url = config.normalize_url(args.url)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    username = args.username
    if not username:
        if not sys.stdin.isatty() or args.password_stdin:
            raise UsageError("--username is required")
        username = input("Username: ").strip()
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = getpass.getpass(f"Password for {username} at {url}: ")
    if not password:
        raise UsageError("an empty password")
    client = Client(url, timeout=args.http_timeout)
    try:
        answer = client.post("/api/v1/auth/token/", {"username": username, "password": password}, auth=False)
    except ApiError as exc:
        if exc.status in (400, 401, 403):
            raise Failed(f"login refused: {exc.detail}") from None
        raise
    token = (answer or {}).get("token") if isinstance(answer, dict) else None
    if not token:
        raise Failed(f"{url} answered no token: is it an fGPU Console?")
    path = config.save({"url": url, "token": token, "username": username})
    me = Client(url, token, timeout=args.http_timeout).get("/api/v1/me/") or {}  # the token works
    role = " (administrator)" if me.get("is_admin") else ""
    if args.output == "json":
        _emit_json({"url": url, "username": username, "config": str(path), "is_admin": bool(me.get("is_admin"))})
    else:
        _info(f"Logged in to {url} as {username}{role} (token stored in {path}).")
    return OK


def cmd_whoami(args) -> int:
    """Who the stored token (or FGPU_TOKEN) belongs to: `GET /api/v1/me/`."""
    client, creds = _client(args)
    me = client.get("/api/v1/me/")
    if args.output == "json":
        _emit_json(me)
        return OK
    headroom = me.get("quota_headroom") or {}
    formats = _slot_formats(client) if headroom.get("fgpu") is not None else {}
    print(
        key_values(
            [
                ("User", me["username"] + (" (administrator)" if me.get("is_admin") else "")),
                ("Server", creds.url),
                ("Projects", ", ".join(me.get("projects") or []) or "-"),
                ("Live sessions", str(me.get("live_sessions", 0))),
                ("Headroom", _headroom_text(headroom, formats)),
            ]
        )
    )
    return OK


def cmd_logout(args) -> int:
    removed = config.remove()
    _info("Logged out." if removed else "Not logged in.")
    if os.environ.get("FGPU_TOKEN"):
        _info("FGPU_TOKEN is still set in the environment.")
    return OK


def cmd_launch(args) -> int:
    body = build_body(
        name=args.name,
        command=args.command,
        priority=args.priority,
        image=args.image,
        preset=args.preset,
        preemptible=args.preemptible,
        min_runtime=args.min_runtime,
        preempt_signal=args.preempt_signal,
        requeue=args.requeue,
        gpu=args.gpu,
        gpu_memory=args.gpu_memory,
        gpu_cores=args.gpu_cores,
        gpus=args.gpus,
        fgpu=args.fgpu,
        mig_profile=args.mig_profile,
        isolation=args.isolation,
        slot=args.slot,
        cpu=args.cpu,
        mem=args.mem,
    )
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError("--timeout must be above 0 seconds")
    client, _ = _client(args)
    if args.dry_run:
        preview = client.post(f"{SESSIONS}preview/", body)
        if args.output == "json":
            _emit_json({"request": body, "preview": preview})
            return OK
        pairs = _request_pairs(body) + [
            ("Configuration", preview.get("configuration")),
            ("Fits now", "yes" if preview.get("fits_now") else "no"),
            ("Node", preview.get("node")),
        ]
        if preview.get("reason"):
            pairs.append(("Reason", preview["reason"]))
        band = preview.get("eta")  # when it would start (servers before issue 32 send none)
        if band and not preview.get("fits_now") and band.get("outcome") != "never":
            pairs.append(("Would start", eta_start({**band, "fits_now": False})))
            if band.get("reason"):
                pairs.append(("Why", band["reason"]))
            pairs.append(("Place in queue", band.get("position")))
        print(key_values(pairs))
        if preview.get("devices"):
            print()
            print(_allocation_table(preview["devices"]))
        return OK
    session = _launch_post(client, body)
    label = session.get("name") or short_id(session["id"])
    _info(
        f"session {label} ({session['id']}) {session['status']}"
        + (f": {session['status_reason']}" if session.get("status_reason") else "")
    )
    if args.wait:
        session = _wait_running(client, session, args.timeout)
    if args.output == "json":
        _emit_json(session)
    else:
        print(session["id"])
    if session["status"] == "TERMINATED" and session.get("exit_code"):
        return FAILED
    return OK


def _request_pairs(body: dict) -> list[tuple[str, str]]:
    """What a dry run says was asked: the preset (when named), the request and the image."""
    if "preset" not in body:
        return [("Request", json.dumps(body["resources"])), ("Image", body.get("image") or "the default")]
    request = (json.dumps(body["resources"]) + ", over the preset's") if body.get("resources") else "the preset's"
    return [("Preset", body["preset"]), ("Request", request), ("Image", body.get("image") or "the preset's")]


def _launch_post(client: Client, body: dict) -> dict:
    """POST the launch with a fresh `Idempotency-Key`; after no answer (a dropped connection, a
    timeout) or a 502/503/504, send it again with the same key, after each of
    LAUNCH_RETRY_DELAYS: the server answers a repeated key with the first launch, so a launch
    that was made before the answer got lost is not made twice."""
    headers = {"Idempotency-Key": str(uuid.uuid4())}
    for delay in LAUNCH_RETRY_DELAYS:
        try:
            return client.post(SESSIONS, body, headers=headers)
        except (ApiError, Unreachable) as exc:
            if isinstance(exc, ApiError) and exc.status not in LAUNCH_RETRY_STATUSES:
                raise
            _info(
                f"fgpu: {exc.detail if isinstance(exc, ApiError) else exc}; sending the launch again in {delay:g} s "
                "(same Idempotency-Key: it is made once)"
            )
            time.sleep(delay)
    return client.post(SESSIONS, body, headers=headers)


def _wait_running(client: Client, session: dict, timeout) -> dict:
    """Poll until RUNNING (or, for a batch command, until it ran and ended); a final state →
    Failed with the reason; `timeout` seconds → Failed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    seen = (session["status"], session.get("status_reason"))
    label = session.get("name") or short_id(session["id"])
    while True:
        status = session["status"]
        if status == "RUNNING":
            return session
        if status in FINAL_STATUSES:
            if status == "TERMINATED" and session.get("command") and session.get("started_at"):
                _info(f"session {label} ran and exited with code {session.get('exit_code')}")
                return session
            reason = session.get("status_reason") or "no reason given"
            raise Failed(f"session {label} is {status}: {reason}")
        if deadline is not None and time.monotonic() >= deadline:
            reason = f" ({session['status_reason']})" if session.get("status_reason") else ""
            raise Failed(
                f"timed out after {timeout:g} s: session {label} is still {status}{reason}; "
                f"it keeps waiting (fgpu rm {short_id(session['id'])} to cancel it)"
            )
        time.sleep(POLL_INTERVAL)
        session = client.get(f"{SESSIONS}{session['id']}/")
        now = (session["status"], session.get("status_reason"))
        if now != seen:
            seen = now
            _info(f"session {label} {now[0]}" + (f": {now[1]}" if now[1] else ""))


def cmd_ps(args) -> int:
    client, creds = _client(args)
    query = {}
    if args.status:
        query["status"] = args.status.upper()
    elif not args.all:
        query["status"] = ",".join(LIVE_STATUSES)
    if args.owner:
        query["owner"] = args.owner
    if args.node:
        query["node"] = args.node
    sessions = client.get_all(SESSIONS, query)
    if args.output == "json":
        _emit_json(sessions)
        return OK
    rows = []
    for s in sessions:
        reason = s.get("status_reason") if s["status"] in ("PENDING", "ERROR") else ""
        if s["status"] == "RUNNING":
            reason = _notice_text(s) or reason
        if reason and len(reason) > 60:
            reason = reason[:59] + "…"
        rows.append(
            [
                short_id(s["id"]),
                s.get("name"),
                s.get("owner"),
                s["status"],
                s.get("node"),
                s.get("configuration"),
                age(s.get("created_at")),
                reason,
            ]
        )
    print(table(["ID", "NAME", "OWNER", "STATUS", "NODE", "RESOURCES", "AGE", "REASON"], rows))
    return OK


def _notice_text(session: dict) -> str:
    """A running session's coming end it did not ask for, as `fgpu ps` says it: "preempted in 4m
    (SIGTERM sent)", "terminated in 9m: reached its maximum lifetime of 1 h", "terminated in 9m
    unless used: idle for 10 min (…)"; "" for none (or a server from before these fields)."""
    if session.get("preempt_at"):
        return f"preempted {until(session['preempt_at'])} ({session.get('preempt_signal') or 'SIGTERM'} sent)"
    if not session.get("deadline"):
        return ""
    why = session.get("deadline_reason") or "reclaimed"
    unless = "" if why.startswith("reached its maximum lifetime") else " unless used"
    return f"terminated {until(session['deadline'])}{unless}: {why}"


def _allocation_table(allocations: list[dict]) -> str:
    rows = [
        [
            a.get("device_index"),
            a.get("device"),
            a.get("model_name"),
            gib(a["memory"]),
            decimal_text(a.get("procs")),
            shares_text(a.get("shares")),
            "released" if a.get("released_at") else ("" if "released_at" not in a else "held"),
        ]
        for a in allocations
    ]
    return table(["INDEX", "DEVICE", "MODEL", "MEMORY (GiB)", "SMs", "fGPU", "STATE"], rows)


def _preemptible_text(session: dict) -> str:
    """ "yes (after 600 s)", "no", or "yes" for a server from before preemption (no field)."""
    if "preemptible" not in session:
        return "—"
    if not session["preemptible"]:
        return "no"
    runtime = session.get("min_runtime") or 0
    return f"yes (after {runtime} s)" if runtime else "yes"


def _preemption_pairs(session: dict) -> list[tuple[str, str]]:
    """What `fgpu describe` says of a session's preemption: its notice while it stands (when it
    is stopped, how long from now, the signal it was sent, for which session), its signal, and
    the sessions it was requeued as or from."""
    pairs = []
    if session.get("preempt_at") and session["status"] == "RUNNING":
        pairs.append(
            (
                "Preempted at",
                f"{session['preempt_at']} ({until(session['preempt_at'])}; {session.get('preempt_signal') or 'SIGTERM'} "
                f"sent at the notice; for session {short_id(session.get('preempted_for') or '')})",
            )
        )
    if session.get("deadline") and session["status"] == "RUNNING":
        at = session["deadline"]
        pairs.append(("Reclaimed at", f"{at} ({until(at)}; {session.get('deadline_reason') or 'reclaimed'})"))
    if session.get("preempt_signal"):
        requeue = "" if session.get("requeue", True) else ", not requeued"
        pairs.append(("Preempt signal", f"{session['preempt_signal']}{requeue}"))
    for key, label in (("requeued_from", "Requeued from"), ("requeued_as", "Requeued as")):
        if session.get(key):
            pairs.append((label, session[key]))
    return pairs


def cmd_describe(args) -> int:
    client, creds = _client(args)
    session = resolve(client, args.session, username=creds.username)
    allocations = session.get("allocations") or []
    environment = session.get("environment") or {}  # the agent's rule, as the server computes it
    eta = _eta(client, session)
    series = _usage_now(client, session)
    if args.output == "json":
        extra = {"eta": eta} if eta is not None else {}
        if series is not None and "storage" in series:
            extra["storage"] = {k: series.get(k) for k in ("storage", "storage_limit", "storage_t")}
        _emit_json({**session, **extra})
        return OK
    pairs = [("ID", session["id"]), ("Name", session.get("name")), ("Owner", session.get("owner")), ("Status", session["status"])]
    if session.get("status_reason"):
        pairs.append(("Pending reason" if session["status"] == "PENDING" else "Reason", session["status_reason"]))
    pairs += [
        ("Node", session.get("node")),
        ("Image", session.get("image")),
        ("Resources", session.get("configuration")),
        ("Request", json.dumps(session.get("resources"))),
        ("Priority", session.get("priority")),
        ("Preemptible", _preemptible_text(session)),
        *_preemption_pairs(session),
        ("Command", session.get("command") or "(interactive shell)"),
        ("Created", session.get("created_at")),
        ("Started", session.get("started_at")),
    ]
    if session.get("terminated_at"):
        pairs += [("Terminated", session["terminated_at"]), ("Exit code", session.get("exit_code"))]
    if storage_text(series) is not None:
        pairs.append(("Storage", storage_text(series)))
    print(key_values(pairs))
    print()
    if eta is not None:
        print("When will it start:")
        print(key_values(_eta_pairs(eta)))
        print()
    if allocations:
        print("Allocation:")
        print(_allocation_table(allocations))
        print()
        print("Environment limits:")
        print(key_values(list(environment.items())))
    else:
        print("Allocation: none" + (" yet" if session["status"] in ("PENDING",) else ""))
    return OK


def _usage_now(client, session: dict) -> dict | None:
    """The newest of a session that ran (GET /api/v1/sessions/<id>/usage/ over the last minute: its
    storage is the newest measure whatever the range); None for one that never ran, or from a server
    without the endpoint (404)."""
    if not session.get("started_at"):
        return None
    try:
        return client.get(f"{SESSIONS}{session['id']}/usage/", query={"since": int(time.time()) - 60})
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def _eta(client, session: dict) -> dict | None:
    """A PENDING session's ETA (GET /api/v1/sessions/<id>/eta/); None for another status, or from a
    server without the endpoint (404) or after the session left PENDING (409)."""
    if session.get("status") != "PENDING":
        return None
    try:
        return client.get(f"{SESSIONS}{session['id']}/eta/")
    except ApiError as exc:
        if exc.status in (404, 409):
            return None
        raise


def _eta_pairs(eta: dict) -> list[tuple[str, object]]:
    pairs: list[tuple[str, object]] = [("Estimated start", eta_start(eta))]
    if eta.get("reason"):
        pairs.append(("Why", eta["reason"]))
    pairs += [("Place in queue", eta.get("position")), ("Fits now", "yes" if eta.get("fits_now") else "no")]
    after = []
    for row in eta.get("fits_after") or []:
        who = row.get("name") or "another user's session"
        ends = eta_band(row.get("ends_earliest"), row.get("ends_latest")) if row.get("ends_earliest") else "no known end"
        after.append(f"{who} on {row.get('node')} ends {ends} ({row.get('basis')})")
    if after:
        pairs.append(("Fits once these end", "; ".join(after)))
    smaller = [f"{o.get('profile')} ({int(o.get('memory') or 0) / (1 << 30):.1f} GiB)" for o in eta.get("mig_now") or []]
    if smaller:
        pairs.append(("Smaller MIG now", ", ".join(smaller)))
    return pairs


def cmd_rm(args) -> int:
    client, creds = _client(args)
    failures, ended = 0, []
    for ref in args.sessions:
        try:
            session = resolve(client, ref, username=creds.username)
            session = client.delete(f"{SESSIONS}{session['id']}/")
        except (ApiError, NotFound) as exc:
            if isinstance(exc, ApiError) and exc.status in (401,):
                raise
            failures += 1
            _error(f"{ref}: {exc.detail if isinstance(exc, ApiError) else exc}")
            continue
        ended.append(session)
        if args.output != "json":
            print(f"{session['id']}  {session['status']}")
    if args.output == "json":
        _emit_json(ended)
    return FAILED if failures else OK


def cmd_logs(args) -> int:
    """Print a session's output (`GET /sessions/<id>/logs/`), running or ended; with --follow,
    keep asking from the cursor until the log is complete (the session ended)."""
    client, creds = _client(args)
    session = resolve(client, args.session, username=creds.username)
    path = f"{SESSIONS}{session['id']}/logs/"
    plain = not sys.stdout.isatty()  # terminal output has CRLF line ends: plain LF into files and pipes
    since, texts, body, held = 0, [], {}, ""
    while True:
        body = client.get(path, query={"since": since})
        text = body.get("text", "")
        if args.output == "json":
            texts.append(text)
        elif text:
            if plain:
                text = (held + text).replace("\r\n", "\n")
                text, held = (text[:-1], "\r") if text.endswith("\r") else (text, "")
            sys.stdout.write(text)
            sys.stdout.flush()
        moved = body.get("next", since) != since
        since = body.get("next", since)
        if body.get("complete"):
            break
        if not moved:
            if not args.follow:
                break
            time.sleep(POLL_INTERVAL)
    if held:
        sys.stdout.write(held)
    if args.output == "json":
        _emit_json(
            {
                "id": session["id"],
                "text": "".join(texts),
                "next": since,
                "complete": bool(body.get("complete")),
                "truncated": bool(body.get("truncated")),
            }
        )
    elif args.follow:
        ended = client.get(f"{SESSIONS}{session['id']}/")
        code = f" (exit code {ended['exit_code']})" if ended.get("exit_code") is not None else ""
        _info(f"fgpu: session {ended.get('name') or short_id(ended['id'])} ended: {ended['status']}{code}")
    return OK


def cmd_exec(args) -> int:
    """Run a command on the session's node (`POST /sessions/<id>/exec/` with `"stream": true`),
    print its stdout and stderr to ours as they come (`GET …/exec/<exec_id>/?since=`), exit
    with its status. Ctrl-C stops the remote command (`DELETE …/exec/<exec_id>/`) and exits 130.
    `-o json` prints the result object (`{"exit_code", "stdout", "stderr", …}`) at the end instead."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError("exec needs a command: fgpu exec SESSION -- CMD [ARG…]")
    client, creds = _client(args)
    session = _running_session(client, creds, args.session)
    command = argv[0] if len(argv) == 1 else argv  # one argument: a shell command line
    path = f"{SESSIONS}{session['id']}/exec/"
    started = client.post(path, {"command": command, "timeout": args.timeout, "stream": True})
    if not isinstance(started, dict) or "id" not in started:
        raise Failed(f"{client.url} answered no exec id to a streamed exec: is it an fGPU Console?")
    url = f"{path}{started['id']}/"
    try:
        state, stdout, stderr = _exec_follow(client, url, echo=args.output != "json")
    except KeyboardInterrupt:
        return _exec_stop(client, url)
    if state["state"] == "timed_out":
        raise Failed(f"the command ran longer than its timeout of {state['timeout']} s and was killed; pass a larger --timeout")
    if state["state"] == "failed":
        raise Failed(state.get("error") or "the command could not be run")
    if state["state"] == "cancelled":
        raise Failed(
            "the remote command was cancelled"
            + (f" (exit code {state['exit_code']})" if state.get("exit_code") is not None else "")
        )
    result = {
        "exit_code": state["exit_code"],
        "stdout": stdout,
        "stderr": stderr,
        "truncated": state["truncated"],
        "duration_ms": state["duration_ms"],
    }
    return _exec_result(args, result, printed=True)


def _exec_follow(client: Client, url: str, *, echo: bool) -> tuple[dict, str, str]:
    """Read a streamed exec from its start until `complete`, writing each chunk to our stdout or
    stderr as it comes when `echo`. Returns the last read and all of stdout and stderr."""
    since = 0
    seen: dict[str, list[str]] = {"stdout": [], "stderr": []}
    while True:
        body = client.get(url, query={"since": since})
        for chunk in body.get("chunks") or []:
            name = "stderr" if chunk.get("stream") == "stderr" else "stdout"
            seen[name].append(chunk.get("data", ""))
            if echo:
                target = sys.stderr if name == "stderr" else sys.stdout
                target.write(chunk.get("data", ""))
                target.flush()
        moved = body.get("next", since) != since
        since = body.get("next", since)
        if body.get("complete"):
            return body, "".join(seen["stdout"]), "".join(seen["stderr"])
        if not moved:
            time.sleep(EXEC_POLL_INTERVAL)


def _exec_stop(client: Client, url: str) -> int:
    """After Ctrl-C: stop the remote command and say how that went; 130 (as a shell after SIGINT)."""
    sys.stderr.write("\n")
    try:
        state = client.delete(url) or {}
    except KeyboardInterrupt:
        _info("fgpu: interrupted again: the remote command may run on until its timeout")
        return 130
    except (ApiError, Unreachable) as exc:
        _error(f"could not stop the remote command ({exc}); it runs on until its timeout")
        return 130
    code = f" (exit code {state['exit_code']})" if state.get("exit_code") is not None else ""
    if state.get("running"):
        _info("fgpu: asked the server to stop the remote command; it has not confirmed yet")
    elif state.get("cancelled"):
        _info(f"fgpu: the remote command was stopped{code}")
    else:
        _info(f"fgpu: the remote command had already ended{code}")
    return 130


def _exec_result(args, result: dict, *, printed: bool) -> int:
    """Print an exec's result `{"exit_code", "stdout", "stderr", "truncated", "duration_ms"}` (the
    object with -o json; else its output, unless `printed` already) and return its exit status."""
    if args.output == "json":
        _emit_json(result)
    else:
        if not printed:
            sys.stdout.write(result.get("stdout", ""))
            sys.stdout.flush()
            sys.stderr.write(result.get("stderr", ""))
            sys.stderr.flush()
        if result.get("truncated"):
            _info("fgpu: the output was cut at 1 MiB per stream")
    code = result.get("exit_code", FAILED)
    return code if isinstance(code, int) and 0 <= code <= 255 else FAILED


def cmd_terminal(args) -> int:
    client, creds = _client(args)
    session = _running_session(client, creds, args.session)
    url = _terminal_url(client, session)
    if sys.stdin.isatty():
        _info(f"Connected to {session.get('name') or short_id(session['id'])}; Ctrl-] detaches.")
    return _run_async(terminal.interactive(url))


def cmd_cp(args) -> int:
    """Copy a file into a RUNNING session or out of it (fgpu_cli.files), as scp does."""
    source, target = files.split_remote(args.source), files.split_remote(args.target)
    remote = source or target
    if remote is None or (source is None) == (target is None):
        raise UsageError("give one SESSION:PATH and one local path (a local name with a colon: ./a:b)")
    client, creds = _client(args)
    session = _running_session(client, creds, remote[0])
    name = printable(session.get("name") or short_id(session["id"]))
    try:
        if target is not None:
            entry = files.upload(client, session["id"], args.source, target[1])
            _info(f"copied {entry.get('size')} bytes to {name}:{entry.get('name')}")
            if args.output == "json":
                _emit_json(entry)
        else:
            written = files.download(client, session["id"], remote[1], args.target)
            if args.target != "-":
                _info(f"copied {written} bytes from {name}:{remote[1]}")
    except (files.CopyError, OSError) as exc:
        raise Failed(str(exc)) from None
    return OK


def _node_processes(client: Client, nodes: list[dict], output: str) -> int:
    """`fgpu nodes --processes`: the host's view of each alive node's GPUs
    (`GET /api/v1/nodes/<name>/processes/`, administrators): which process of which session holds
    how much memory of which GPU. A node that is not alive, or whose agent does not answer, is
    named on stderr; the others are still listed."""
    answers, failed = [], False
    for n in nodes:
        if n.get("status") != "ALIVE":
            _info(f"fgpu: node {n['name']} is {n.get('status')}: its GPUs' processes cannot be asked")
            continue
        try:
            answers.append(client.get(f"/api/v1/nodes/{urllib.parse.quote(n['name'], safe='')}/processes/"))
        except ApiError as exc:
            if exc.status in (401, 403):
                raise
            _error(f"node {n['name']}: {exc.detail}")
            failed = True
    if output == "json":
        _emit_json(answers)
        return 1 if failed else OK
    rows = []
    for answer in answers:
        for p in answer["processes"]:
            session = p.get("session") or {}
            rows.append(
                [
                    answer["node"],
                    p.get("index"),
                    short_id(p["device"]) if p.get("device") else "",
                    p["pid"],
                    session.get("name", "—"),
                    session.get("owner", "—"),
                    size(p.get("memory")),
                    size(session.get("granted_memory")),
                    p.get("kind"),
                    printable(p.get("command", ""))[:60],
                ]
            )
    print(
        table(["NODE", "GPU", "UUID", "PID", "SESSION", "OWNER", "GPU MEMORY", "GRANTED", "SOURCE", "COMMAND"], rows)
        if rows
        else "no process holds a GPU on the alive nodes"
    )
    return 1 if failed else OK


def cmd_nodes(args) -> int:
    client, _ = _client(args)
    nodes = client.get_all("/api/v1/nodes/")
    if getattr(args, "processes", False):
        return _node_processes(client, nodes, args.output)
    if args.output == "json":
        _emit_json(nodes)
        return OK
    formats = _slot_formats(client)
    rows = []
    for n in nodes:
        devices = n.get("devices") or []
        slot = devices[0]["slot_name"] if devices else "cuda"

        def total(key, devices=devices):
            values = [Decimal(d[key]) for d in devices if d.get(key) is not None]
            return sum(values, Decimal(0)) if values else None

        rows.append(
            [
                n["name"],
                n.get("status"),
                n.get("resource_group"),
                n.get("cpu_count"),
                size(n.get("memory_size")),
                len(devices),
                _fgpu(total("capacity_fgpu"), formats, slot),
                _fgpu(total("allocated_fgpu"), formats, slot),
                _fgpu(total("free_fgpu"), formats, slot),
                age(n.get("last_heartbeat")),
                (n.get("drain") or {}).get("label") or "-",
            ]
        )
    header = ["NODE", "STATUS", "GROUP", "CPU", "MEMORY", "DEVICES", "CAPACITY", "ALLOCATED", "FREE", "HEARTBEAT", "DRAIN"]
    print(table(header, rows))
    return OK


def cmd_nodes_drain(args) -> int:
    """`fgpu nodes drain NAME [--evict] [--reason TEXT]` and `fgpu nodes undrain NAME`
    (administrators): `POST /api/v1/nodes/<NAME>/drain/` or `…/undrain/`; prints the node's
    drain state ("n1: draining: 2 sessions left"), or with -o json the API's answer."""
    client, _ = _client(args)
    path = f"/api/v1/nodes/{urllib.parse.quote(args.node, safe='')}/{args.nodes_command}/"
    body = {"evict": args.evict, "reason": args.reason} if args.nodes_command == "drain" else {}
    try:
        state = client.post(path, body)
    except ApiError as exc:
        if exc.status == 404:
            raise Failed(f"no node {args.node!r}") from None
        raise
    if args.output == "json":
        _emit_json(state)
        return OK
    extra = []
    if state.get("evict") and state.get("sessions_left"):
        extra.append("evicting: each gets the preemption notice and grace, then is requeued")
    if state.get("reason"):
        extra.append(f"reason: {state['reason']}")
    print(f"{state['node']}: {state['label']}" + "".join(f"; {e}" for e in extra))
    return OK


def _all_devices(client: Client, node: str | None) -> list[dict]:
    """Every device with its node's name and the memory and SMs held and the session count
    (`/api/v1/devices/`)."""
    return client.get_all("/api/v1/devices/", {"node": node} if node else None)


def cmd_devices(args) -> int:
    client, _ = _client(args)
    devices = _all_devices(client, args.node)
    if args.node and not devices:
        raise Failed(f"no node {args.node!r}, or it has no devices")
    if args.output == "json":
        _emit_json(devices)
        return OK
    formats = _slot_formats(client)
    usage = any("allocated_memory" in d for d in devices)
    rows = []
    for d in devices:
        model = (d.get("model_name") or "") + (f" ({d['mig_profile']})" if d.get("mig_profile") else "")
        row = [
            d.get("node"),
            d.get("index"),
            model,
            size(d.get("memory_size")),
            d.get("subproc_count"),
            _fgpu(d.get("capacity_fgpu"), formats, d.get("slot_name")),
            _fgpu(d.get("allocated_fgpu"), formats, d.get("slot_name")),
            _fgpu(d.get("free_fgpu"), formats, d.get("slot_name")),
        ]
        if usage:
            row += [size(d.get("allocated_memory")), decimal_text(d.get("allocated_procs")), d.get("session_count")]
        rows.append(row)
    headers = ["NODE", "INDEX", "MODEL", "MEMORY", "SMs", "CAPACITY", "ALLOCATED", "FREE"]
    print(table(headers + (["MEM HELD", "SMs HELD", "SESSIONS"] if usage else []), rows))
    return OK


_QUOTA_FIGURES = (("fgpu", "fGPU"), ("devices", "devices"), ("gpu_memory", "GPU memory"), ("sessions", "sessions"))


def _quota_figure(key: str, value, formats: dict) -> str:
    if value is None:
        return "unlimited"
    if key == "fgpu":
        return _fgpu(value, formats, "cuda")
    if key == "gpu_memory":
        return size(value)
    return str(value)


def _headroom_text(headroom: dict, formats: dict) -> str:
    """ "1.50 fGPU, unlimited devices, 6 GiB GPU memory, 3 sessions"."""
    parts = [_quota_figure("fgpu", headroom.get("fgpu"), formats) + ("" if headroom.get("fgpu") is not None else " fGPU")]
    parts += [f"{_quota_figure(key, headroom.get(key), formats)} {label}" for key, label in _QUOTA_FIGURES[1:]]
    return ", ".join(parts)


def cmd_quota(args) -> int:
    client, _ = _client(args)
    quota = client.get("/api/v1/quota/", query={"user": args.user} if args.user else None)
    if args.output == "json":
        _emit_json(quota)
        return OK
    if not (isinstance(quota, dict) and isinstance(quota.get("quotas"), list)):
        print(key_values(flatten(quota)) if quota else "No quota applies.")  # a shape this CLI does not know
        return OK
    formats = _slot_formats(client) if quota["quotas"] else {}
    if not quota["quotas"]:
        print(f"No quota applies to {quota.get('user')}: everything is unlimited.")
        return OK
    rows = []
    for q in quota["quotas"]:
        for key, label in _QUOTA_FIGURES:
            rows.append(
                [
                    f"{q.get('scope')} {q.get('name')}",
                    label,
                    _quota_figure(key, (q.get("limits") or {}).get(key), formats),
                    _quota_figure(key, (q.get("used") or {}).get(key), formats),
                    _quota_figure(key, (q.get("remaining") or {}).get(key), formats),
                ]
            )
    print(f"Quotas of {quota.get('user')}:")
    print(table(["QUOTA", "RESOURCE", "LIMIT", "USED", "REMAINING"], rows))
    headroom = quota.get("headroom") or {}
    print()
    print("Headroom (what you may still launch): " + _headroom_text(headroom, formats))
    return OK


def _get_known(client: Client, path: str, query: dict | None, *, missing: str, every: bool = False):
    """GET `path` (every page of a list with `every`); a 404 is Failed("<missing> (GET <path> answered 404)")."""
    try:
        return client.get_all(path, query) if every else client.get(path, query=query)
    except ApiError as exc:
        if exc.status == 404:
            raise Failed(f"{missing} (GET {path} answered 404)") from None
        raise


def cmd_images(args) -> int:
    """The registered session images (`GET /api/v1/images/`): what `fgpu launch --image` takes,
    the default marked, and the alive nodes that hold each."""
    client, _ = _client(args)
    images = _get_known(client, "/api/v1/images/", None, missing="this server has no session images", every=True)
    if args.output == "json":
        _emit_json(images)
        return OK
    rows = [
        [
            i.get("reference"),
            "yes" if i.get("is_default") else "",
            i.get("display_name"),
            ", ".join(i.get("accelerators") or []) or "any",
            ", ".join(i.get("nodes") or []) or "none (sessions wait)",
        ]
        for i in images
    ]
    print(table(["IMAGE", "DEFAULT", "NAME", "ACCELERATORS", "ON NODES"], rows) if rows else "No images registered.")
    return OK


def cmd_shares(args) -> int:
    """`fgpu shares` lists the shared data folders (`GET /api/v1/shares/`: yours and those shared
    with you, issue 36.5); `fgpu shares add FOLDER (--user U | --project P) [--rw]` shares
    `data` (your ~/data) or `projects/<name>` (administrators), read-only unless --rw; `fgpu
    shares rm ID` revokes one (or leaves one shared with you)."""
    client, _ = _client(args)
    action = getattr(args, "shares_command", None)
    if action == "add":
        if bool(args.user) == bool(args.project):
            raise UsageError("name one of --user and --project")
        body = {"folder": args.folder, "permission": "rw" if args.rw else "ro"}
        body["user" if args.user else "project"] = args.user or args.project
        share = client.post("/api/v1/shares/", body)
        if args.output == "json":
            _emit_json(share)
            return OK
        permission = "read-write" if share["permission"] == "rw" else "read-only"
        grantee = share["user"] or f"project {share['to_project']}"
        print(f"{share['folder']}/ shared {permission} with {grantee}: they see it at ~/shared/{share['name']} ({share['id']})")
        return OK
    if action == "rm":
        try:
            client.delete(f"/api/v1/shares/{urllib.parse.quote(args.id, safe='')}/")
        except ApiError as exc:
            if exc.status == 404:
                raise Failed(f"no share {args.id!r}") from None
            raise
        print(f"share {args.id} removed")
        return OK
    listed = client.get("/api/v1/shares/")
    if args.output == "json":
        _emit_json(listed)
        return OK
    rows = [
        [
            s["id"],
            f"{s['folder']}/" + (f" of {s['owner']}" if s["received"] and s["owner"] else ""),
            s["user"] or f"project {s['to_project']}",
            "read-only" if s["permission"] == "ro" else "read-write",
            f"~/shared/{s['name']}",
        ]
        for s in listed["shares"]
    ]
    print(
        table(["ID", "FOLDER", "SHARED WITH", "PERMISSION", "SEEN AT"], rows) if rows else "No folder is shared by or with you."
    )
    return OK


def cmd_presets(args) -> int:
    """The resource presets you may launch (`GET /api/v1/presets/`): what `fgpu launch --preset`
    takes, each with its request in words, resource group and image."""
    client, _ = _client(args)
    presets = _get_known(client, "/api/v1/presets/", None, missing="this server has no resource presets", every=True)
    if args.output == "json":
        _emit_json(presets)
        return OK
    rows = [
        [
            p.get("name"),
            p.get("configuration") or json.dumps(p.get("request")),
            p.get("resource_group") or "any",
            p.get("image") or "default",
            p.get("description"),
        ]
        for p in presets
    ]
    print(table(["PRESET", "REQUEST", "GROUP", "IMAGE", "DESCRIPTION"], rows) if rows else "No presets you may use.")
    return OK


def cmd_usage(args) -> int:
    """GPU-hours, fGPU-hours and GPU-memory-hours, granted and used (`GET /api/v1/usage/`):
    administrators see everyone, others their own sessions."""
    client, _ = _client(args)
    query = {"group_by": args.by, **{k: v for k, v in (("from", args.since), ("to", args.until)) if v}}
    report = _get_known(client, "/api/v1/usage/", query, missing="this server has no usage API")
    if args.output == "json":
        _emit_json(report)
    elif args.csv:
        sys.stdout.write(usage_csv(report))
    else:
        print(usage_text(report))
    return OK


def cmd_mig_profiles(args) -> int:
    """Each GPU model's MIG profiles (`GET /api/v1/mig/profiles/`), built-in or read from NVML."""
    client, _ = _client(args)
    catalogs = client.get_all("/api/v1/mig/profiles/", {"model": args.model} if args.model else None)
    if args.output == "json":
        _emit_json(catalogs)
    else:
        print(profiles_text(catalogs))
    return OK


def cmd_mig_layout(args) -> int:
    """Every MIG GPU's instances and free slices (`GET /api/v1/mig/layouts/`), or one node's MIG
    mode, fixed layout and GPUs (`GET /api/v1/nodes/<NODE>/mig/`)."""
    client, _ = _client(args)
    if not args.node:
        layouts = client.get_all("/api/v1/mig/layouts/")
        if args.output == "json":
            _emit_json(layouts)
        else:
            print(layout_text(layouts))
        return OK
    try:
        node = client.get(f"/api/v1/nodes/{urllib.parse.quote(args.node, safe='')}/mig/")
    except ApiError as exc:
        if exc.status == 404:
            raise Failed(f"no node {args.node!r}") from None
        raise
    if args.output == "json":
        _emit_json(node)
    else:
        print(node_text(node))
    return OK


# --- the parser -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-o",
        "--output",
        choices=["table", "json"],
        default=argparse.SUPPRESS,
        help="table (default) or json: the API's objects, for scripts",
    )
    parser = argparse.ArgumentParser(
        prog="fgpu",
        description="fGPU Console from the command line: launch GPU-sharing sessions, run commands "
        "in them, see nodes and devices.",
        epilog="Exit codes: 0 ok, 1 refused or failed, 2 bad usage, 3 server unreachable or not logged in "
        "(fgpu exec: the command's own). FGPU_URL and FGPU_TOKEN override the stored login.",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=["table", "json"],
        default="table",
        help="table (default) or json: the API's objects, for scripts",
    )
    parser.add_argument("--http-timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"fgpu {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name, handler, help_text, **kw):
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text, **kw)
        p.set_defaults(handler=handler)
        return p

    p = add("login", cmd_login, "log in: store a token for URL in ~/.config/fgpu/config.json (mode 0600)")
    p.add_argument("url", metavar="URL", help="the console, e.g. http://127.0.0.1:8000")
    p.add_argument("-u", "--username")
    p.add_argument("--password-stdin", action="store_true", help="read the password from stdin's first line")

    add("logout", cmd_logout, "forget the stored token")
    add("whoami", cmd_whoami, "who the token belongs to: administrator or not, projects, quota headroom")

    p = add("launch", cmd_launch, "launch a session (one GPU request style at most)")
    p.add_argument("--name", help="the session's name")
    p.add_argument(
        "--preset",
        metavar="NAME",
        help="a resource preset's name or id (fgpu presets lists them): its "
        "request and image; other flags given replace its parts",
    )
    gpu = p.add_argument_group("GPU request (one style)")
    gpu.add_argument(
        "--gpu",
        metavar="F",
        help="Run:ai style: a fraction of one GPU (0.5 = half its memory and SMs) or a whole number of whole GPUs",
    )
    gpu.add_argument("--gpu-memory", metavar="SIZE", help="GPU memory per device, e.g. 4G (HAMi / Run:ai)")
    gpu.add_argument("--gpu-cores", metavar="PCT", type=int, help="with --gpu-memory: percent of each device's SMs")
    gpu.add_argument("--gpus", metavar="N", type=int, help="with --gpu-memory: how many devices (default 1)")
    gpu.add_argument(
        "--isolation",
        choices=("shared", "mig", "any"),
        help="with --gpu-memory: a shared slice (default), the smallest MIG instance that holds it, or either",
    )
    gpu.add_argument("--fgpu", metavar="AMOUNT", help="fGPU amount (Backend.AI), may span devices, e.g. 2.5")
    gpu.add_argument("--slot", default="cuda", help=argparse.SUPPRESS)
    gpu.add_argument("--mig-profile", metavar="PROFILE", help="a MIG profile, e.g. 2g.20gb")
    p.add_argument("--cpu", type=int, metavar="N", help="CPU cores (default 1)")
    p.add_argument("--mem", metavar="SIZE", help="host memory, e.g. 8G (default 1G)")
    p.add_argument("--command", metavar="CMD", help="a batch command (default: an interactive shell)")
    p.add_argument(
        "--image",
        metavar="REF",
        help="a registered session image, e.g. nvcr.io/nvidia/pytorch:24.05-py3 "
        "(fgpu images lists them; default: the server's default image)",
    )
    p.add_argument("--priority", type=int, help="queue priority (above 0: administrators only)")
    p.add_argument(
        "--preemptible",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether it may be stopped, warned first, for a waiting session of higher priority or of an "
        "owner under its fair share (default: yes for --command, no for a shell)",
    )
    p.add_argument("--min-runtime", type=int, metavar="S", help="seconds after its start it is never preempted")
    p.add_argument(
        "--preempt-signal",
        metavar="SIG",
        help="the signal it gets when chosen for preemption, at the start of its grace (Slurm's --signal), "
        "e.g. USR1 (default: its image's, else TERM)",
    )
    p.add_argument(
        "--requeue",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="once preempted (or moved by a compaction), launch it again as a new session keeping its place (default: yes)",
    )
    p.add_argument("--wait", action="store_true", help="wait until RUNNING (exit 1 if it ends or errs instead)")
    p.add_argument("--timeout", type=float, metavar="S", help="with --wait: give up after S seconds (exit 1)")
    p.add_argument("--dry-run", action="store_true", help="show what the request would get now; create nothing")

    p = add("ps", cmd_ps, "list sessions (live ones unless --all or --status)")
    p.add_argument("-a", "--all", action="store_true", help="ended sessions too")
    p.add_argument("--status", metavar="S", help="only these statuses, comma-separated (e.g. PENDING,RUNNING)")
    p.add_argument("--owner", metavar="USER", help="administrators: only this user's sessions")
    p.add_argument("--node", metavar="NODE", help="only sessions on this node")

    p = add("describe", cmd_describe, "a session: allocation per device, environment limits, pending reason")
    p.add_argument("session", metavar="SESSION", help="id, unique id prefix, or name")

    p = add("rm", cmd_rm, "terminate sessions")
    p.add_argument("sessions", metavar="SESSION", nargs="+")

    p = add("logs", cmd_logs, "print a session's output (running or ended)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing output until the session ends")
    p.add_argument("session", metavar="SESSION")

    p = add(
        "exec",
        cmd_exec,
        "run a command in a session (its node, environment and working directory); "
        "print its output as it comes, exit with its status (Ctrl-C stops it)",
        usage="fgpu exec [-h] [-o {table,json}] [--timeout S] SESSION -- CMD [ARG ...]",
    )
    p.add_argument(
        "--timeout",
        type=int,
        default=30,
        metavar="S",
        help="seconds before the server kills the command (default 30, at most 300)",
    )
    p.add_argument("session", metavar="SESSION")
    p.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="CMD",
        help="one argument: a shell command line; several: a command and its arguments",
    )

    p = add("terminal", cmd_terminal, "an interactive terminal on a session in this TTY (Ctrl-] detaches)")
    p.add_argument("session", metavar="SESSION")

    p = add(
        "cp",
        cmd_cp,
        "copy a file into a session (fgpu cp FILE SESSION:PATH) or out of it (fgpu cp "
        "SESSION:PATH FILE; - for stdout); PATH is relative to its home, data/ your persistent folder",
    )
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("target", metavar="TARGET")

    p = add("nodes", cmd_nodes, "GPU nodes with their capacity, allocated and free fGPU, and their drain")
    p.add_argument(
        "--processes",
        action="store_true",
        help="administrators: what holds each alive node's GPUs now, as the node sees it (NVML's running "
        "processes; a mock node: each session's declared use): GPU, pid, session, owner, memory, command",
    )
    nodes_sub = p.add_subparsers(dest="nodes_command", metavar="NODES_COMMAND", required=False)
    q = nodes_sub.add_parser(
        "drain",
        parents=[common],
        help="administrators: place no new session on NODE (kubectl drain, Slurm DRAIN); running ones go on, or "
        "with --evict get the preemption notice and grace and are requeued",
    )
    q.set_defaults(handler=cmd_nodes_drain)
    q.add_argument("node", metavar="NODE")
    q.add_argument("--evict", action="store_true", help="evict running sessions: notice, grace, then requeued")
    q.add_argument("--reason", default="", metavar="TEXT", help="why (shown with the node's state, at most 200 chars)")
    q = nodes_sub.add_parser("undrain", parents=[common], help="administrators: put NODE back in service")
    q.set_defaults(handler=cmd_nodes_drain)
    q.add_argument("node", metavar="NODE")
    p = add("devices", cmd_devices, "every device with its allocated and free fGPU")
    p.add_argument("--node", help="only this node's devices")
    add("images", cmd_images, "session images to launch in (--image): the default, accelerators, nodes that hold each")
    add("presets", cmd_presets, "resource presets to launch (--preset): request, resource group, image")
    p = add("shares", cmd_shares, "shared data folders: yours and those shared with you (at ~/shared/<name>)")
    shares_sub = p.add_subparsers(dest="shares_command", metavar="SHARES_COMMAND", required=False)
    q = shares_sub.add_parser(
        "add", parents=[common], help="share FOLDER (data: your ~/data; projects/<name>: administrators) read-only, or --rw"
    )
    q.set_defaults(handler=cmd_shares)
    q.add_argument("folder", metavar="FOLDER")
    q.add_argument("--user", metavar="U", help="with this user")
    q.add_argument("--project", metavar="P", help="with this project's members")
    q.add_argument("--rw", action="store_true", help="read-write (default: read-only, mounted read-only on the node)")
    q = shares_sub.add_parser("rm", parents=[common], help="revoke share ID (or leave one shared with you)")
    q.set_defaults(handler=cmd_shares)
    q.add_argument("id", metavar="ID")
    p = add("quota", cmd_quota, "your quotas: limits, what is in use, what is left")
    p.add_argument("--user", help="administrators: another user's quotas")

    p = add(
        "usage",
        cmd_usage,
        "GPU-hours, fGPU-hours and GPU-memory-hours, granted and used, per user, project "
        "or node (yours; administrators: everyone's)",
    )
    p.add_argument(
        "--from", dest="since", metavar="WHEN", help="start: a date (2026-01-01) or ISO time (default: 30 days before --to)"
    )
    p.add_argument("--to", dest="until", metavar="WHEN", help="end, exclusive (default: now)")
    p.add_argument("--by", choices=("user", "project", "node"), default="user", help="how rows are grouped")
    p.add_argument("--csv", action="store_true", help="print CSV (six decimals) instead of a table")

    p = add("mig", None, "MIG: the profiles of each GPU model, the layout of each MIG GPU")
    mig_sub = p.add_subparsers(dest="mig_command", metavar="MIG_COMMAND", required=True)
    q = mig_sub.add_parser(
        "profiles",
        parents=[common],
        help="each GPU model's MIG profiles: slices, memory, SMs, max instances, allowed starts (built-in or from NVML)",
    )
    q.set_defaults(handler=cmd_mig_profiles)
    q.add_argument("--model", metavar="M", help='one GPU model: H100-80GB, H100, "NVIDIA A100-SXM4-40GB", …')
    q = mig_sub.add_parser(
        "layout",
        parents=[common],
        help="each MIG GPU's instances (in use, idle, unknown) and "
        "free and stranded slices; with NODE, that node's MIG mode "
        "and fixed layout too",
    )
    q.set_defaults(handler=cmd_mig_layout)
    q.add_argument("node", metavar="NODE", nargs="?", help="one node")
    return parser


def _error(message: str) -> None:
    sys.stderr.write(f"fgpu: error: {printable(' '.join(str(message).split()))}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as exc:
        _error(str(exc))
        return USAGE
    except config.ConfigError as exc:
        _error(str(exc))
        return UNREACHABLE
    except (Unreachable, terminal.TerminalUnreachable) as exc:
        _error(str(exc))
        return UNREACHABLE
    except ApiError as exc:
        if exc.status == 401:
            _error(f"{exc.detail} (run `fgpu login URL --username USER`)")
            return UNREACHABLE
        _error(exc.detail)
        return FAILED
    except (Failed, NotFound, terminal.TerminalError) as exc:
        _error(str(exc))
        return getattr(exc, "code", FAILED)
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return FAILED


if __name__ == "__main__":
    sys.exit(main())
