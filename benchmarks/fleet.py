"""The fleet overview at 1,000 nodes (issue 36.4): how long `GET /api/v1/fleet/` takes to answer
and the page takes to draw, with how many queries.

    DATABASE_URL=postgres://… python benchmarks/fleet.py [--nodes 1000] [--sessions 1500]
        [--repeat 7] [--screenshots DIR] [--out benchmarks/results/fleet.txt]

Creates a throw-away database (`bench_fleet_<name>`, dropped afterwards) filled as tests/seed.py
fills a real cluster: `--nodes` nodes of 8 mock GPUs registered by `node_inventory_apply` and a
dynamic-MIG node of 4 H100s, spread over four resource groups, one node in 50 LOST, and
`--sessions` sessions of one user in every request style placed by the scheduler; one usage
sample per GPU (what each agent's sampler reports: memory used, utilisation). Then measures:

1. `accelerators.fleet.fleet_overview` in this process (median of `--repeat`), with its queries,
   for the default page (50 nodes) and for a filtered one;
2. `GET /api/v1/fleet/` from outside against one uvicorn web process (median and worst of
   `--repeat`), and the answer's size;
3. with `--screenshots`: the admin's fleet overview page in headless Chromium (Playwright, an
   administrator logged in): the time from navigation until the first answer is drawn
   (`#fleet[data-loaded]`), and screenshots (light) of the page and of a filtered view.

Needs PostgreSQL; runs without Redis (no GET here uses it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

PASSWORD = "fleet-bench-password"  # the throw-away database's administrator, for the browser's log-in


def seed(*, nodes: int, sessions: int) -> str:
    """The cluster, its groups and states, the sessions and one sample per GPU; returns an
    administrator's API token."""
    from django.contrib.auth import get_user_model
    from django.db import transaction

    from accelerators.models import Device, Node, NodeStatus, ResourceGroup
    from accounts.services import login_token_issue
    from tests.seed import gpu_cluster, sessions_in_every_style
    from usage.models import DeviceSample

    with transaction.atomic():
        gpu_cluster(nodes=nodes, gpus=8, mig_gpus=4)
        groups = [ResourceGroup.objects.create(name=name) for name in ("training", "inference", "research")]
        names = list(Node.objects.order_by("name").values_list("name", flat=True))
        for i, group in enumerate(groups):  # a quarter of the nodes stay in no group
            Node.objects.filter(name__in=names[i::4]).update(resource_group=group)
    user = get_user_model().objects.create_user("bench")
    sessions_in_every_style(owner=user, count=sessions)
    Node.objects.filter(name__in=names[7::50]).update(status=NodeStatus.LOST)
    now = int(time.time())
    pick = random.Random(36)
    samples = [
        DeviceSample(
            device_id=pk, t=now, memory_used=pick.randrange(0, memory // 2), memory_total=memory, util=pick.randrange(0, 100)
        )
        for pk, memory in Device.objects.filter(is_mig_device=False).values_list("pk", "memory_size")
    ]
    DeviceSample.objects.bulk_create(samples, batch_size=2000)
    admin = get_user_model().objects.create_superuser("root", password=PASSWORD)
    return login_token_issue(user=admin)


def in_process(repeat: int, query: dict) -> tuple[float, int]:
    """Median milliseconds and queries of `fleet_overview` for `query` (API parameters)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from accelerators.api_fleet import FleetQuerySerializer, fleet_response

    parsed = FleetQuerySerializer(data=query)
    parsed.is_valid(raise_exception=True)
    times = []
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as queries:
            began = time.perf_counter()
            fleet_response(parsed.validated_data)
            times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times), len(queries)


def over_http(port: int, token: str, path: str, repeat: int) -> tuple[float, float, int]:
    """Median and worst milliseconds of `repeat` GETs of `path`, and the answer's bytes."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Authorization": f"Token {token}", "Accept": "application/json"}
    times, size = [], 0
    for i in range(repeat + 1):
        began = time.perf_counter()
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        body = response.read()
        assert response.status == 200, body[:300]
        if i:  # the first one warms the process up
            times.append((time.perf_counter() - began) * 1000)
        size = len(body)
    json.loads(body)
    return statistics.median(times), max(times), size


def browser(port: int, out: Path, repeat: int) -> list[str]:
    """The page in headless Chromium: time to the first drawn answer, and screenshots."""
    from playwright.sync_api import sync_playwright

    lines = []
    out.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{port}"
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path="/usr/bin/chromium")
        page = chromium.new_page(viewport={"width": 1440, "height": 900}, color_scheme="light")
        page.goto(base + "/admin/login/?next=/admin/")
        page.fill("#id_username", "root")
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        page.wait_for_url(base + "/admin/")
        drawn = []
        for _ in range(repeat):
            began = time.perf_counter()
            page.goto(base + "/admin/accelerators/node/fleet/")
            page.wait_for_selector("#fleet[data-loaded]", timeout=120_000)
            drawn.append((time.perf_counter() - began) * 1000)
        cells = page.locator(".fleet-heat-grid .fleet-cell").count()
        lines.append(
            f"page drawn (navigation → first answer drawn, {cells} heat-map cells): "
            f"median {statistics.median(drawn):.0f} ms, worst {max(drawn):.0f} ms"
        )
        page.screenshot(path=str(out / "fleet-overview-1000.png"), full_page=True)
        page.screenshot(path=str(out / "fleet-overview-1000-top.png"))
        page.goto(base + "/admin/accelerators/node/fleet/?state=ready&resource_group=training&sort=-load")
        page.wait_for_selector("#fleet[data-loaded]", timeout=120_000)
        page.screenshot(path=str(out / "fleet-overview-filtered.png"), full_page=True)
        page.goto(base + "/admin/accelerators/node/fleet/?model=H100-80GB")
        page.wait_for_selector("#fleet[data-loaded]", timeout=120_000)
        page.screenshot(path=str(out / "fleet-overview-mig.png"))
        began = time.perf_counter()
        page.goto(base + "/admin/accelerators/node/")
        page.wait_for_load_state("load")
        lines.append(f"admin node list with capacity columns (100 nodes a page): {(time.perf_counter() - began) * 1000:.0f} ms")
        page.screenshot(path=str(out / "node-list-capacity.png"))
        page.goto(base + "/sessions/")  # My resources: the MIG node's slices under "Free GPU capacity"
        try:
            page.wait_for_selector("#resources-groups tbody tr", state="attached", timeout=60_000)
            page.locator("#resources-groups").screenshot(path=str(out / "my-resources-mig.png"))
        except Exception as exc:  # the figures above stand without it
            lines.append(f"(no screenshot of My resources: {type(exc).__name__})")
        chromium.close()
    return lines


def serve(work: Path):
    """The web process on the benchmark's database, once its log-in page answers (not the API
    schema tests.stack waits for: generating it took over a minute on a loaded machine)."""
    import urllib.request

    from tests.stack import Proc, database_url_default, free_port, wait_until, web_command

    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/", timeout=10) as response:
                return response.status == 200
        except OSError:
            return False

    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url_default(), "FGPU_DATA_DIR": str(work / "data"), "FGPU_LOG_LEVEL": "WARNING"}
    env.pop("REDIS_URL", None)
    web = Proc("web", web_command(port), env=env, log_dir=work)
    try:
        wait_until(answers, timeout=300, what="the web process to answer")
    except BaseException:
        web.stop()
        raise
    return web, port


def run(args) -> list[str]:
    began = time.perf_counter()
    if args.database:  # seeded by an earlier run (--keep): its administrator's new token
        from django.contrib.auth import get_user_model

        from accounts.services import login_token_issue

        token = login_token_issue(user=get_user_model().objects.get(username="root"))
        from usage.models import DeviceSample

        DeviceSample.objects.update(t=int(time.time()) + 600)  # its one sample a GPU stays "newest" through the run
    else:
        token = seed(nodes=args.nodes, sessions=args.sessions)
    lines = [
        f"{args.nodes:,} nodes × 8 GPUs (+ a 4-GPU dynamic-MIG node), {args.sessions} sessions placed by the scheduler, "
        f"one sample per GPU; seeded in {time.perf_counter() - began:.0f} s; {os.cpu_count()} CPU(s) shared",
        "",
        f"{'fleet_overview in process':<58} {'median ms':>9} {'queries':>7}",
    ]
    for label, query in (
        ("default page (50 nodes, heat map of all)", {}),
        ("state=ready&resource_group=training&sort=-load", {"state": "ready", "resource_group": "training", "sort": "-load"}),
        ("min_free_fgpu=15 page_size=200", {"min_free_fgpu": "15", "page_size": "200"}),
    ):
        ms, queries = in_process(args.repeat, query)
        lines.append(f"  {label:<56} {ms:>9.0f} {queries:>7}")
    lines += ["", f"{'GET over HTTP (one uvicorn)':<58} {'median ms':>9} {'worst':>7} {'bytes':>9}"]
    with tempfile.TemporaryDirectory() as scratch:
        web, port = serve(Path(scratch))
        try:
            for path in ("/api/v1/fleet/", "/api/v1/fleet/?page_size=200", "/api/v1/fleet/?state=lost"):
                median, worst, size = over_http(port, token, path, args.repeat)
                lines.append(f"  {path:<56} {median:>9.0f} {worst:>7.0f} {size:>9,}")
            if args.screenshots:
                lines += ["", *browser(port, args.screenshots, args.repeat)]
        finally:
            web.stop()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=1500)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--screenshots", type=Path, default=None)
    parser.add_argument("--database", default="", help="a database an earlier run seeded (not dropped): no seeding")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fleet.txt")
    args = parser.parse_args()
    os.environ.pop("REDIS_URL", None)
    os.environ.setdefault("FGPU_LOG_LEVEL", "WARNING")
    os.environ.setdefault("FGPU_SECRET_KEY", secrets.token_urlsafe(48))  # this process's and its web process's
    import django

    django.setup()
    from django.db import connection

    from benchmarks.database import throwaway_database
    from benchmarks.output import figures_write

    if connection.vendor != "postgresql":
        sys.exit("benchmarks/fleet.py needs PostgreSQL: set DATABASE_URL=postgres://…")
    began = time.perf_counter()
    if args.database:
        connection.settings_dict["NAME"] = args.database
        os.environ["DATABASE_URL"] = os.environ["DATABASE_URL"].rsplit("/", 1)[0] + "/" + args.database
        lines = run(args)
    else:
        with throwaway_database("bench_fleet"):
            lines = run(args)
    command = f"python benchmarks/fleet.py --nodes {args.nodes} --sessions {args.sessions} --repeat {args.repeat}"
    figures_write(lines, began=began, command=command, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
