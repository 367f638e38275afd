"""Characters PostgreSQL refuses never reach it (issue 33.2): a NUL in a path id is a 404, in a
query parameter a 400 naming the parameter, in the API's error shape, for every method; the pages
answer Django's 404 and ignore such a parameter. Schemathesis then drives every operation of the schema against
PostgreSQL (the test database) with a NUL and control characters put into every string it
generates (path parameters, query, body): never a 5xx, every refusal in the error shape."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from sessions.models import ComputeSession
from tests.conftest import assert_error_shape, client_for
from tests.test_openapi import SCHEMA, served_schema
from tests.test_openapi import wsgi_in_test_transaction  # noqa: F401 (a fixture: the WSGI handler keeps the test's connection)

pytestmark = pytest.mark.django_db

METHODS = ("get", "put", "patch", "delete", "post")

# Every path the schema has with an id or a name in it, the NUL where the id goes.
ID_PATHS = [
    "/api/v1/slot-formats/%00/", "/api/v1/fractional-settings/%00/", "/api/v1/resource-groups/%00/",
    "/api/v1/nodes/%00/", "/api/v1/nodes/%00/mig/", "/api/v1/nodes/%00/usage/", "/api/v1/nodes/%00/processes/",
    "/api/v1/devices/%00/", "/api/v1/projects/%00/", "/api/v1/quotas/%00/", "/api/v1/images/%00/",
    "/api/v1/presets/%00/", "/api/v1/sessions/%00/", "/api/v1/sessions/%00/eta/", "/api/v1/sessions/%00/logs/",
    "/api/v1/sessions/%00/files/", "/api/v1/sessions/a%00b/", "/api/v1/slot-formats/cuda.shares%00/",
]
# The query parameters that are looked up in the database, as the issue found them and beyond.
QUERIES = [
    ("/api/v1/fragmentation/", "group"), ("/api/v1/mig/layouts/", "node"), ("/api/v1/mig/profiles/", "model"),
    ("/api/v1/nodes/", "status"), ("/api/v1/devices/", "node"), ("/api/v1/sessions/", "status"),
    ("/api/v1/usage/", "user"), ("/api/v1/usage/", "project"), ("/api/v1/quota/", "resource_group"),
    ("/api/v1/launch-options/", "resource_group"), ("/api/v1/my-resources/", "resource_group"),
    ("/api/v1/scheduler/what-if/", "session"), ("/api/v1/fairshare/", "user"), ("/api/v1/usage/latest/", "node"),
]


def api(user):
    client = client_for(user)
    client.raise_request_exception = False  # a 5xx is answered, as a real server would
    return client


@pytest.mark.parametrize("path", ID_PATHS)
def test_a_nul_in_a_path_id_is_a_404_in_the_error_shape_for_every_method(demo_cluster, admin, path):
    client = api(admin)
    for method in METHODS:
        response = getattr(client, method)(path, HTTP_IF_MATCH="*")
        body = assert_error_shape(response, 404)
        assert body["type"] == "not-found", (method, body)


@pytest.mark.parametrize("path, name", QUERIES)
def test_a_nul_in_a_query_parameter_is_a_400_naming_it(demo_cluster, admin, path, name):
    for value in ("%00", "a%00", "%00b%01"):
        body = assert_error_shape(api(admin).get(f"{path}?{name}={value}"), 400)
        assert body["type"] == "invalid-parameter"
        assert list(body["field_errors"]) == [name], body
        assert name in body["detail"] and "NUL" in body["detail"]


def test_the_issues_five_requests_answer_4xx_not_500(demo_cluster, admin):
    """The five the fault probe found answering 500 (DataError) on PostgreSQL."""
    client = api(admin)
    for path in ("/api/v1/slot-formats/%00/", "/api/v1/fractional-settings/%00/"):
        assert client.get(path).status_code == 404
    for method in METHODS:
        assert getattr(client, method)("/api/v1/resource-groups/%00/", HTTP_IF_MATCH="*").status_code == 404
    assert client.get("/api/v1/fragmentation/?group=%00").status_code == 400
    assert client.get("/api/v1/mig/layouts/?node=%00").status_code == 400


def test_every_parameter_holding_a_nul_is_named_and_a_nul_in_a_name_is_shown_escaped(demo_cluster, admin):
    body = assert_error_shape(api(admin).get("/api/v1/sessions/?status=RUNNING&x%00y=1&limit=%00&ok=1"), 400)

    assert list(body["field_errors"]) == ["x\\x00y", "limit"]
    assert "\x00" not in body["detail"]


def test_a_nul_is_refused_for_anyone_before_authentication_and_a_clean_query_still_works(demo_cluster, admin, alice):
    assert assert_error_shape(api(None).get("/api/v1/nodes/?status=%00"), 400)["type"] == "invalid-parameter"
    assert api(alice).get("/api/v1/nodes/?status=ALIVE").status_code == 200
    assert api(admin).get("/api/v1/slot-formats/cuda.shares/").status_code in (200, 404)


def test_the_pages_answer_a_nul_in_the_path_with_djangos_404_and_ignore_a_parameter_holding_one(demo_cluster, admin):
    """As they ignore any filter they cannot use; the admin's search, which filtered by it, too."""
    client = api(admin)
    client.force_login(admin)

    page = client.get("/sessions/%00/terminal/")
    assert page.status_code == 404 and not page["Content-Type"].startswith("application/json")
    assert client.get("/sessions/?page=%00&node=%00").status_code == 200
    for path in ("/admin/accelerators/node/?q=%00", "/admin/compute_sessions/computesession/?q=a%00"):
        assert client.get(path).status_code == 200, path


def test_every_operation_that_reads_a_query_parameter_documents_its_400():
    for path, item in SCHEMA["paths"].items():
        for method, operation in item.items():
            if any(p["in"] == "query" for p in operation.get("parameters", [])):
                assert "400" in operation["responses"], f"{method.upper()} {path}"


# --- Schemathesis, every string spiked with a NUL and control characters --------------------------------

SPIKE = "\x00\x01\x1b\x7f\x9f"  # NUL, SOH, ESC, DEL, a C1 control


def spiked(value):
    """`value` with SPIKE put into every string (dict keys too), at its front and in its middle."""
    if isinstance(value, str):
        middle = len(value) // 2
        return SPIKE + value[:middle] + SPIKE + value[middle:]
    if isinstance(value, dict):
        return {spiked(k): spiked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [spiked(v) for v in value]
    return value


# The schema tests/test_openapi.py fetched from the WSGI app while collecting (drf-spectacular builds it
# once a run; a fetch of its own here built it again), loaded as `from_wsgi` would load it.
every_operation = served_schema()


@pytest.fixture
def spike_admin_token(demo_cluster, django_user_model, wsgi_in_test_transaction) -> str:
    from accounts.services import login_token_issue

    return login_token_issue(user=django_user_model.objects.create_user("spiker", is_staff=True))


@every_operation.parametrize()
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
def test_every_operation_refuses_nul_and_control_characters_in_every_string_with_a_4xx(case, spike_admin_token):
    """Every method of every path, as an administrator (writes with `If-Match: *`), each string of
    the generated path parameters, query and body spiked: no 5xx (the database never sees a NUL),
    and a 4xx answers the error shape."""
    if case.path_parameters:
        case.path_parameters = {name: spiked(value) for name, value in case.path_parameters.items()}
    if case.query:
        case.query = spiked(case.query)
    if isinstance(case.body, (dict, list, str)):
        case.body = spiked(case.body)
    headers = {"Authorization": f"Token {spike_admin_token}", "If-Match": "*"}
    response = case.call(headers=headers)

    assert response.status_code < 500, (case.method, case.formatted_path, case.query, case.body,
                                        response.status_code, response.text[:300])
    if response.status_code >= 400 and response.headers.get("Content-Type", [""])[0].startswith("application/json"):
        assert set(response.json()) == {"type", "title", "detail", "field_errors"}, response.text[:300]
    if case.path_parameters:
        assert response.status_code == 404 or response.status_code == 405, (case.formatted_path, response.status_code)
    assert not ComputeSession.objects.filter(name__contains="\x01").exists()
