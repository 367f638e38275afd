"""`fgpu ps` and `fgpu describe` say a running session's coming end it did not ask for (issue
36.3): preemption, idle reclamation (averted by using it) and the maximum lifetime (not), with
how long is left, from the API's `preempt_at` and `deadline` fields. The server is tests.test_cli's
stand-in (the network is what is mocked)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from fgpu_cli import main as cli
from tests.test_cli import SID, api, session  # noqa: F401 (a fixture and helpers)


def in_minutes(minutes: float) -> str:
    return (datetime.now(timezone.utc) + timedelta(minutes=minutes, seconds=20)).isoformat()


def test_ps_says_preemption_idle_reclamation_and_the_lifetime_with_the_time_left(api, capsys):  # noqa: F811
    rows = [
        session(id="00000000-0000-0000-0000-00000000000" + str(i), name=name, **fields)
        for i, (name, fields) in enumerate(
            [
                ("preempted", {"preempt_at": in_minutes(4), "preempt_signal": "SIGTERM"}),
                ("idle", {"deadline": in_minutes(9), "deadline_reason": "idle for 10 min (GPU utilisation < 1 %)"}),
                ("old", {"deadline": in_minutes(30), "deadline_reason": "reached its maximum lifetime of 1 h"}),
                ("calm", {"deadline": None, "deadline_reason": ""}),
            ]
        )
    ]
    api.routes[("GET", "/api/v1/sessions/")] = (200, {"count": 4, "next": None, "results": rows})

    assert cli.main(["ps"]) == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()[1:]}

    assert "preempted in 4m (SIGTERM sent)" in lines["preempted"]
    assert "terminated in 9m unless used: idle for 10 min" in lines["idle"]
    assert "terminated in 30m: reached its maximum lifetime of 1 h" in lines["old"]
    assert "terminated" not in lines["calm"] and "preempted" not in lines["calm"]


def test_describe_names_the_reclamation_time_and_reason(api, capsys):  # noqa: F811
    at = in_minutes(9)
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (
        200,
        session(deadline=at, deadline_reason="reached its maximum lifetime of 1 h"),
    )

    assert cli.main(["describe", SID]) == 0

    out = capsys.readouterr().out
    assert f"{at} (in 9m; reached its maximum lifetime of 1 h)" in out
