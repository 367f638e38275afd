"""Input that used to answer a 5xx is a 400 naming the field: JSON nested 1,000 deep, amounts
that are not finite or far too large ("1e309"), sizes past a 64-bit column, `?limit=` past
the page size, exec commands with a NUL byte or of 2 MiB, text the database cannot hold; session
names refuse control characters. What still fails under /api/ answers JSON in the error shape:
500 for a bug, 503 when the broker (Redis) cannot be reached, 400 for a body Django refuses."""
from __future__ import annotations

import json
import socket
from decimal import Decimal

import kombu
import pytest
from django.test import override_settings
from django.urls import path
from rest_framework.decorators import api_view

import console.urls
from protocol.units import MAX_SIZE, SizeError, parse_binary_size, parse_decimal
from common.api_parsers import MAX_DEPTH, too_deep
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import ComputeSession
from tests.conftest import assert_error_shape, client_for
from tests.test_mig_scheduling import mig_node

pytestmark = pytest.mark.django_db

BIG = "9999999999999999999999999"  # 25 digits: more bytes than a BigIntegerField holds
SESSIONS = "/api/v1/sessions/"


def dead_port() -> int:
    """A local TCP port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_client(user):
    """client_for(user), answering 5xx as a real server would instead of raising them in the test."""
    client = client_for(user)
    client.raise_request_exception = False
    return client


def post(client, body, path: str = SESSIONS):
    return client.post(path, body if isinstance(body, str) else json.dumps(body), content_type="application/json")


# --- JSON nested too deep ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", [SESSIONS, f"{SESSIONS}preview/"])
def test_json_nested_1000_deep_in_a_field_is_a_400_naming_it(demo_cluster, alice, path):
    deep = "[" * 1000 + "]" * 1000
    body = assert_error_shape(post(api_client(alice), '{"name": "s", "resources": {"x": ' + deep + "}}", path), 400)

    assert body["field_errors"] == {"resources.x": [f"nested deeper than {MAX_DEPTH} levels"]}
    assert not ComputeSession.objects.exists()


def test_a_body_that_is_itself_nested_1000_deep_is_a_400(demo_cluster, alice):
    objects = assert_error_shape(post(api_client(alice), "{" + '"a":{' * 999 + "}" * 1000), 400)
    arrays = assert_error_shape(post(api_client(alice), "[" * 1000 + "]" * 1000), 400)

    assert objects["field_errors"] == {".".join(["a"] * MAX_DEPTH): ["nested deeper than 32 levels"]}
    assert arrays["type"] == "parse-error" and "nested deeper than 32 levels" in arrays["detail"]


def test_the_depth_scan_counts_brackets_not_text_and_names_the_keys():
    at_limit = '{"a": ' * (MAX_DEPTH - 1) + "[]" + "}" * (MAX_DEPTH - 1)
    assert json.loads(at_limit) and too_deep(at_limit) is None
    assert too_deep('{"a": ' * MAX_DEPTH + "[]" + "}" * MAX_DEPTH) == ".".join(["a"] * MAX_DEPTH)
    assert too_deep(json.dumps({"name": "[" * 100 + '\\"{' * 100, "ok": [1]})) is None  # brackets inside strings
    assert too_deep('{"r": {"say \\"hi\\"": ' + "[" * 40 + "]" * 40 + "}}") == 'r.say "hi"'
    assert too_deep("[" * 33 + "]" * 33) == ""  # no key leads there: the body itself


# --- amounts: finite, bounded, few digits ---------------------------------------------------------------

@pytest.mark.parametrize("resources, named, problem", [
    ({"cuda.shares": "1e309"}, "resources.cuda.shares", "too large"),
    ({"cuda.shares": "1E+400000000"}, "resources.cuda.shares", "too large"),
    ({"cuda.shares": "1000000000"}, "resources.cuda.shares", "too large"),
    ({"cuda.shares": "NaN"}, "resources.cuda.shares", "not a finite number"),
    ({"cuda.shares": "-Infinity"}, "resources.cuda.shares", "not a finite number"),
    ({"cuda.shares": "1e-309"}, "resources.cuda.shares", "too many digits after the point"),
    ({"cuda.shares": "0." + "1" * 40}, "resources.cuda.shares", "too many digits after the point"),
    ({"cuda.device": "1e309"}, "resources.cuda.device", "too large"),
    ({"gpu_fraction": "1e-309"}, "resources.gpu_fraction", "too many digits after the point"),
    ({"gpu": 1, "gpu_memory": "1G", "gpu_cores": "1e309"}, "resources.gpu_cores", "too large"),
])
@pytest.mark.parametrize("path", [SESSIONS, f"{SESSIONS}preview/"])
def test_non_finite_or_absurd_amounts_are_a_400_naming_the_field(demo_cluster, alice, path, resources, named,
                                                                    problem):
    body = assert_error_shape(post(api_client(alice), {"resources": resources}, path), 400)

    assert body["type"] == "invalid-resources"
    [message] = body["field_errors"]["resources"]
    assert message.startswith(f"{named}: ") and problem in message and len(message) < 200, message
    assert not ComputeSession.objects.exists()


def test_amounts_inside_the_bounds_still_parse():
    assert parse_decimal("999999999.999999", what="x") == Decimal("999999999.999999")
    assert parse_decimal("0.500000000", what="x") == Decimal("0.5")  # trailing zeros are not digits of value
    assert parse_decimal("25E-2", what="x") == Decimal("0.25")
    with pytest.raises(ValueError, match="too many digits"):
        parse_decimal("0.0000001", what="x")


# --- sizes and counts: no more than the columns hold ------------------------------------------------------

@pytest.mark.parametrize("resources, named", [
    ({"gpu": 1, "gpu_memory": BIG}, "resources.gpu_memory"),
    ({"cuda.shares": "0.5", "mem": BIG}, "resources.mem"),
    ({"cuda.shares": "0.5", "mem": int(BIG)}, "resources.mem"),
    ({"gpu": 1, "gpu_memory": "1025P"}, "resources.gpu_memory"),
    ({"nvidia.com/gpumem": BIG}, "resources.nvidia.com/gpumem"),  # a bare number of MiB
    ({"nvidia.com/gpumem": 1 << 41}, "resources.nvidia.com/gpumem"),  # 2 EiB in MiB
    ({"nvidia.com/gpumem": "9" * 5000}, "resources.nvidia.com/gpumem"),  # more digits than int() reads
    ({"egpu": {"GPU_MEM_PER_DEVICE": int(BIG)}}, "resources.egpu.GPU_MEM_PER_DEVICE"),
])
def test_sizes_larger_than_1_eib_are_a_400_naming_the_field(demo_cluster, alice, resources, named):
    body = assert_error_shape(post(api_client(alice), {"resources": resources}), 400)

    [message] = body["field_errors"]["resources"]
    assert message.startswith(f"{named}: ") and "at most 1 EiB" in message and len(message) < 200, message


@pytest.mark.parametrize("resources, named, problem", [
    ({"gpu_memory": "15G", "isolation": "mig", "mem": BIG}, "resources.mem", "at most 1 EiB"),  # bigint out of range
    ({"mig_profile": "1g.10gb", "cpu": 99999999999}, "resources.cpu", "at most 65536 cores"),  # integer out of range
    ({"mig_profile": "1g.10gb", "cpu": BIG}, "resources.cpu", "at most 65536 cores"),
    ({"gpu": BIG}, "resources.gpu", "too large (at most 65536)"),
])
def test_sizes_and_counts_past_their_columns_are_refused_before_they_reach_them(alice, resources, named, problem):
    mig_node()  # MIG requests were checked against no node's memory or cores before being written

    body = assert_error_shape(post(api_client(alice), {"resources": resources}), 400)

    [message] = body["field_errors"]["resources"]
    assert message.startswith(f"{named}: ") and problem in message, message


def test_the_size_bound_is_1_eib_exactly():
    assert parse_binary_size("1E") == parse_binary_size(MAX_SIZE) == 1 << 60
    for too_large in ("1025P", MAX_SIZE + 1, "1.0000001E", "9" * 5000):
        with pytest.raises(SizeError, match="at most 1 EiB"):
            parse_binary_size(too_large)


# --- text the database cannot hold ------------------------------------------------------------------------

@pytest.mark.parametrize("resources, named", [
    ({"cuda.shares": "0.5", "resource_group": "a\x00"}, "resources.resource_group"),
    ({"cuda.shares": "0.5", "resource_group": "\ud800"}, "resources.resource_group"),
    ({"cuda.shares": "0.5", "exclude": ["GPU-1", "x\x00"]}, "resources.exclude.1"),
    ({"egpu": {"GPU_MEM_PER_DEVICE": "1G", "NVIDIA_VISIBLE_DEVICES": "\ud83d"}},
     "resources.egpu.NVIDIA_VISIBLE_DEVICES"),
])
@pytest.mark.parametrize("path", [SESSIONS, f"{SESSIONS}preview/"])
def test_nul_characters_and_lone_surrogates_in_resources_are_a_400_naming_the_key(demo_cluster, alice, path,
                                                                                   resources, named):
    body = assert_error_shape(post(api_client(alice), {"resources": resources}, path), 400)

    [message] = body["field_errors"]["resources"]
    assert message.startswith(f"{named}: ") and "NUL character or an unpaired surrogate" in message, message


# --- list pages ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/v1/sessions/", "/api/v1/nodes/", "/api/v1/devices/", "/api/v1/quotas/"])
@pytest.mark.parametrize("query, named", [
    ("limit=99999999999999999999", "limit"),
    ("limit=1001", "limit"),
    ("limit=" + "9" * 5000, "limit"),
    ("offset=99999999999999999999", "offset"),
])
def test_a_limit_past_the_page_size_or_an_offset_past_64_bits_is_a_400_naming_it(demo_cluster, alice, staff,
                                                                                 path, query, named):
    admission.session_create(owner=staff, name="one", resources={"cuda.shares": "0.5"})  # every list has a row

    body = assert_error_shape(api_client(staff).get(f"{path}?{query}"), 400)

    assert list(body["field_errors"]) == [named] and "from" in body["field_errors"][named][0]


def test_a_limit_of_1000_is_served(demo_cluster, staff):
    response = api_client(staff).get("/api/v1/devices/?limit=1000")

    assert response.status_code == 200 and response.json()["count"] == 1


# --- commands -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, problem", [
    ("nvidia-smi\x00; reboot", "NUL character"),
    (["echo", "a\x00b"], "NUL character"),
    ("x" * (2 << 20), "at most 64 KiB"),
    (["echo"] + ["y" * 1024] * 64, "at most 64 KiB"),
    ("echo \udc80", "unpaired surrogate"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_exec_refuses_nul_bytes_and_commands_over_64_kib_naming_command(alices_session, alice, command, problem,
                                                                      stream):
    body = assert_error_shape(post(api_client(alice), {"command": command, "timeout": 1, "stream": stream},
                                   f"{SESSIONS}{alices_session.pk}/exec/"), 400)

    assert list(body["field_errors"]) == ["command"] and problem in body["field_errors"]["command"][0]


def test_a_batch_command_over_64_kib_is_a_400_naming_command(demo_cluster, alice):
    body = assert_error_shape(post(api_client(alice), {"resources": {"cuda.shares": "0.5"},
                                                       "command": "echo " + "x" * (64 << 10)}), 400)

    assert "at most 64 KiB" in body["field_errors"]["command"][0]
    at_limit = post(api_client(alice), {"resources": {"cuda.shares": "0.5"}, "command": "x" * (64 << 10)})
    assert at_limit.status_code == 201


# --- session names ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["\x1b]0;pwned\x07evil", "two\nlines", "a\tb", "del\x7f", "csi\x9b31m", "n\x85el"])
def test_a_session_name_with_a_control_character_is_a_400_naming_name(demo_cluster, alice, name):
    body = assert_error_shape(post(api_client(alice), {"name": name, "resources": {"cuda.shares": "0.5"}}), 400)

    assert list(body["field_errors"]) == ["name"] and "control characters" in body["field_errors"]["name"][0]
    assert not ComputeSession.objects.exists()


def test_names_in_any_script_and_with_spaces_are_kept(demo_cluster, alice):
    response = post(api_client(alice), {"name": "  Ärger über 日本 — v2  ", "resources": {"cuda.shares": "0.5"}})

    assert response.status_code == 201 and response.json()["name"] == "Ärger über 日本 — v2"


# --- what still fails answers JSON under /api/ --------------------------------------------------------------

DEAD_BROKER = f"redis://127.0.0.1:{dead_port()}//"


@api_view(["POST"])
def publish_to_a_dead_broker(request):
    with kombu.Connection(DEAD_BROKER, connect_timeout=1) as broker:
        broker.ensure_connection(max_retries=1)


def broken(request):
    raise RuntimeError("a bug")


def broken_broker(request):
    with kombu.Connection(DEAD_BROKER, connect_timeout=1) as broker:
        broker.ensure_connection(max_retries=1)


# This module is also the URLconf of the tests marked `urls`: the project's, plus views that fail,
# with the project's own error handlers.
urlpatterns = [
    path("api/v1/test/bug/", api_view(["GET"])(broken)),
    path("api/v1/test/publish/", publish_to_a_dead_broker),
    path("api/v1/test/plain-bug/", broken),
    path("api/v1/test/plain-broker/", broken_broker),
    path("test/bug/", broken),
    *console.urls.urlpatterns,
]
handler400, handler404, handler500 = console.urls.handler400, console.urls.handler404, console.urls.handler500


@pytest.mark.urls(__name__)
@pytest.mark.parametrize("path", ["/api/v1/test/bug/", "/api/v1/test/plain-bug/"])
def test_a_server_error_under_api_is_a_json_500_in_the_error_shape(alice, path):
    body = assert_error_shape(api_client(alice).get(path), 500)

    assert body["type"] == "server-error" and "a bug" not in body["detail"]


@pytest.mark.urls(__name__)
def test_a_server_error_outside_api_is_djangos_page(alice):
    response = api_client(alice).get("/test/bug/")

    assert response.status_code == 500 and response["Content-Type"].startswith("text/html")


@pytest.mark.urls(__name__)
@pytest.mark.parametrize("method, path", [("post", "/api/v1/test/publish/"), ("get", "/api/v1/test/plain-broker/")])
def test_a_broker_that_cannot_be_reached_is_a_json_503_to_retry(alice, method, path):
    response = getattr(api_client(alice), method)(path)

    body = assert_error_shape(response, 503)
    assert body["type"] == "service-unavailable" and response["Retry-After"] == "5"


def test_exec_while_redis_is_down_is_a_json_503(alices_session, alice):
    layer = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                         "CONFIG": {"hosts": [{"address": DEAD_BROKER.rstrip("/")}]}}}
    with override_settings(CHANNEL_LAYERS=layer):
        response = post(api_client(alice), {"command": ["nvidia-smi"], "timeout": 1},
                        f"{SESSIONS}{alices_session.pk}/exec/")

    assert assert_error_shape(response, 503)["type"] == "service-unavailable"


def test_a_body_larger_than_django_reads_is_a_json_400(demo_cluster, alice):
    response = post(api_client(alice), {"resources": {"cuda.shares": "0.5"}, "command": "x" * (3 << 20)})

    assert assert_error_shape(response, 400)["type"] == "bad-request"


def test_an_empty_node_status_filter_is_a_400_naming_it(demo_cluster, alice):
    body = assert_error_shape(api_client(alice).get("/api/v1/nodes/?status="), 400)

    assert body["field_errors"] == {"status": ["expected one of ALIVE, LOST"]}
    assert api_client(alice).get("/api/v1/nodes/?status=ALIVE").json()["count"] == 1


@pytest.mark.django_db
@pytest.mark.parametrize("query, field", [("node=a%00b", "node"), ("node=a%20b", "node"), ("owner=x%01", "owner"),
                                          ("node=%0A", "node"), ("owner=alice%0A", "owner")])  # $ passes a final newline
def test_a_session_list_filter_outside_what_names_can_be_is_a_400_naming_it(alice, query, field):
    response = client_for(alice).get(f"/api/v1/sessions/?{query}")

    assert response.status_code == 400, response.content
    assert field in response.json()["field_errors"]


@pytest.mark.django_db
def test_a_session_list_filter_by_a_proper_node_name_answers(alice):
    response = client_for(alice).get("/api/v1/sessions/?node=gpu-node_1.a&owner=alice")

    assert response.status_code == 200 and response.json()["results"] == []
