"""Under ``/e2b`` every answer is E2B's error shape, routes sandcell does not serve too.

E2B's API checks a request against its OpenAPI spec before any handler: a path it has
no operation for is a 404, a known path with another method a 405, both as
``{"code", "message"}`` (the SDK reads ``message``). Outside ``/e2b`` the serve app's
own body stays.
"""

from __future__ import annotations

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import SandboxException

from tests.e2b_api.conftest import KEY_A, E2bServe


def _e2b_shaped(answer: httpx.Response, status: int) -> dict[str, object]:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert isinstance(body, dict)
    assert set(body) == {"code", "message", "error_code"}, body
    assert body["code"] == status
    return body


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/e2b/no-such-route", 404),
        ("GET", "/e2b", 404),
        # No redirect to ``/templates/`` (a route Starlette would otherwise find there).
        ("POST", "/e2b/templates", 404),
        ("GET", "/e2b/templates/", 404),
        ("GET", "/e2b/templates/some-template/builds/b1/status", 404),
        ("PUT", "/e2b/templates/some-template", 405),
        ("GET", "/e2b/templates/team-slug/some-template", 405),
        ("PATCH", "/e2b/sandboxes", 405),
        ("PUT", "/e2b/sandboxes/aaaaaaaaaaaaaaaaaaaa/metrics", 405),
        ("DELETE", "/e2b/snapshots", 405),
    ],
)
def test_unrouted_and_wrong_method_answer_e2bs_shape(
    e2b_serve: E2bServe, method: str, path: str, status: int
) -> None:
    answer = httpx.request(method, e2b_serve.url + path, headers={"X-API-KEY": KEY_A})
    body = _e2b_shaped(answer, status)
    wanted = "no matching operation was found" if status == 404 else "method not allowed"
    assert body["message"] == wanted
    if status == 405:
        assert answer.headers["Allow"]
        assert method not in answer.headers["Allow"].split(", ")


def test_an_unknown_template_delete_is_e2bs_404(e2b_serve: E2bServe) -> None:
    """``DELETE /templates/{id}`` of a template that is neither served nor the tenant's
    snapshot: E2B's 404 body, and the SDK's ``delete_snapshot`` reads it as False."""
    answer = httpx.delete(
        f"{e2b_serve.url}/e2b/templates/no-such-snapshot", headers={"X-API-KEY": KEY_A}
    )
    assert _e2b_shaped(answer, 404)["error_code"] == "not_found"
    assert Sandbox.delete_snapshot("no-such-snapshot", **e2b_serve.opts()) is False


def test_the_sdk_raises_the_message_of_an_unrouted_answer(e2b_serve: E2bServe) -> None:
    """A route the SDK knows and sandcell does not serve fails with E2B's words, not a
    parse error of another body."""
    with pytest.raises(SandboxException, match=r"method not allowed|no matching operation"):
        Template.get_tags("some-template", **e2b_serve.opts())


def test_outside_the_prefix_the_apps_own_404_stays(e2b_serve: E2bServe) -> None:
    answer = httpx.get(f"{e2b_serve.url}/e2bx/nothing")
    assert answer.status_code == 404
    assert "error" in answer.json()
    answer = httpx.get(f"{e2b_serve.url}/v1/no-such-route")
    assert answer.status_code == 404
    assert "error" in answer.json()
