"""A keystroke's two channel-layer hops in standalone mode, in-process: a `pty.input` group send to
the agent's group and its receive, then a `terminal.output` group send to the terminal's group and
its receive, on common.layers' in-memory layer beside --other-groups groups of one member each (a
console's other terminals, session lists and agents' groups). Prints the CPU (process time) a
keystroke, best of 5 blocks of --keys; compare trees by running it from each (cd TREE; PYTHONPATH=.).

    .venv/bin/python benchmarks/terminal_layer.py [--keys 3000] [--other-groups 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")


async def keystroke_cpu_us(keys: int, other_groups: int) -> list[float]:
    from common.layers import FlowControlledInMemoryChannelLayer

    layer = FlowControlledInMemoryChannelLayer()
    agent, terminal = await layer.new_channel("agent."), await layer.new_channel()
    await layer.group_add("pty.node.s1", agent)
    await layer.group_add("term.node.s1", terminal)
    for i in range(other_groups):
        await layer.group_add(f"user-{i}", await layer.new_channel())
    blocks = []
    for _ in range(5):
        started = time.process_time()
        for i in range(keys):
            await layer.group_send("pty.node.s1", {"type": "pty.input", "data": "a", "session_id": "s1"})
            await layer.receive(agent)
            await layer.group_send("term.node.s1", {"type": "terminal.output", "data": "a", "offset": i, "n": i})
            await layer.receive(terminal)
        blocks.append((time.process_time() - started) / keys * 1e6)
    return blocks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=3000)
    parser.add_argument("--other-groups", type=int, default=0)
    args = parser.parse_args()
    blocks = asyncio.run(keystroke_cpu_us(args.keys, args.other_groups))
    print(
        f"{Path.cwd()}: {args.other_groups} other groups: CPU a keystroke's two layer hops {min(blocks):.1f} µs "
        f"(best of 5; all {' '.join(f'{b:.1f}' for b in blocks)}), load {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
