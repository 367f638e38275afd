"""What typing the heartbeat's state costs (issue 34.1): the manager's decoding of one heartbeat and
its reading of the state for the reconcile, and the agent's building and encoding of it, in
microseconds per heartbeat, this tree against a baseline tree (an earlier commit unpacked with
`git archive <commit> | tar -x -C DIR`), A/B interleaved.

    python benchmarks/heartbeat_state.py --base DIR [--sessions 200] [--ended 50] [--rounds 7]

Each round runs one process per tree (their order alternating from round to round); each process
times both sides with timeit (the best of 5 repeats of a loop of about 0.2 s) on a heartbeat of
`--sessions` running sessions and `--ended` ended ones. A tree without protocol.messages.AgentState
is measured as the untyped dict was used: the manager decoded the heartbeat (its state taken as a
dict) and the reconcile filtered its `sessions` and `ended` (sessions.lifecycle.reconcile before
issue 34.1; it read an end's fields only for the sessions still active, left out here); the agent
built the dict and encoded the heartbeat. Only protocol/ is imported (no Django). Prints the median
and spread of the rounds per tree, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time, timeit, uuid
sys.path.insert(0, sys.argv[1])
from protocol import messages as m

n_sessions, n_ended = int(sys.argv[2]), int(sys.argv[3])
running = {str(uuid.UUID(int=i)): ("RUNNING", "PREPARING", "TERMINATING")[i % 3] for i in range(n_sessions)}
ended = {str(uuid.UUID(int=10**6 + i)): ("TERMINATED", "the process exited with code 0", 0) for i in range(n_ended)}
wire = {"node": "gpu-1", "running": list(running), "mig_digest": None, "images": {"host": "host"},
        "state": {"sessions": running, "ended": {k: {"status": s, "reason": r, "exit_code": c} for k, (s, r, c) in ended.items()},
                  "at": 1_790_000_000.25}}
typed = hasattr(m, "AgentState")
AGENT_STATES = ("PREPARING", "RUNNING", "TERMINATING")

def manager():
    beat = m.Heartbeat.decode(wire)
    if typed:
        state = beat.state
        return state.statuses, state.ends, state.unreadable, state.at
    state = beat.state
    reported = {str(k): v for k, v in (state.get("sessions") or {}).items() if v in AGENT_STATES}
    ends = {str(k): v for k, v in (state.get("ended") or {}).items() if isinstance(v, dict)}
    return reported, ends, float(state["at"])

def agent():
    if typed:
        state = m.AgentState(at=time.time(), sessions=tuple(m.SessionState(m.SessionId(k), v) for k, v in running.items()),
                             ended=tuple(m.SessionEnd(m.SessionId(k), s, r, c) for k, (s, r, c) in ended.items()))
    else:
        ends = {k: {"status": s, "reason": r, "exit_code": c} for k, (s, r, c) in ended.items()}
        state = {"sessions": dict(running), "ended": ends, "at": time.time()}
    return m.Heartbeat(node=m.NodeName("gpu-1"), running=tuple(running), state=state, images={"host": "host"}).encode()

assert json.dumps(agent()["state"]["sessions"]) == json.dumps(running)
out = {"typed": typed}
for name, fn in (("manager", manager), ("agent", agent)):
    timer = timeit.Timer(fn)
    loops, _ = timer.autorange()
    loops = max(1, loops)
    out[name] = min(timer.repeat(5, loops)) / loops * 1e6
print(json.dumps(out))
"""


def measure(root: Path, sessions: int, ended: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(sessions), str(ended)], check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the baseline tree (git archive <commit> | tar -x -C DIR)")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--ended", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    trees = {"base": args.base.resolve(), "this": ROOT}
    print(f"load average before: {os.getloadavg()}")
    print(f"a heartbeat of {args.sessions} running and {args.ended} ended sessions; {args.rounds} rounds, A/B alternating")
    figures: dict[str, dict[str, list[float]]] = {name: {"manager": [], "agent": []} for name in trees}
    for i in range(args.rounds):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))
        for name in order:
            got = measure(trees[name], args.sessions, args.ended)
            for side in ("manager", "agent"):
                figures[name][side].append(got[side])
            print(f"  round {i + 1} {name} (typed: {got['typed']}): manager {got['manager']:.1f} us, agent {got['agent']:.1f} us")
    for side in ("manager", "agent"):
        base, this = (statistics.median(figures[name][side]) for name in ("base", "this"))
        spread = {name: (min(figures[name][side]), max(figures[name][side])) for name in trees}
        print(
            f"{side}: base {base:.1f} us ({spread['base'][0]:.1f}-{spread['base'][1]:.1f}), "
            f"this {this:.1f} us ({spread['this'][0]:.1f}-{spread['this'][1]:.1f}): x{this / base:.2f}"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
