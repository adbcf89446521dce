"""The plugins' routing rule (``directives.routing.route_namespace``), case by case: a
foreign key is left alone; a Leyline namespace (or the anonymous one, for a request that
names none) serves the request once it holds its start, the plain namespace before."""

from __future__ import annotations

from leyline_agent.directives.routing import route_namespace


def _route(key: str | None, holding: set[str]) -> str | None:
    return route_namespace(key, "ours/anon", lambda k: k.startswith("ours/"), holding.__contains__)


def test_a_namespace_serves_its_requests_once_it_holds_their_start():
    assert _route("ours/s", set()) is None  # nothing of it yet: the plain namespace
    assert _route("ours/s", {"ours/s"}) == "ours/s"
    assert _route("ours/s", {"ours/anon", "ours/t"}) is None  # never another session's


def test_a_request_naming_no_namespace_is_the_anonymous_sessions():
    assert _route(None, set()) is None
    assert _route(None, {"ours/anon"}) == "ours/anon"


def test_a_foreign_key_is_left_alone():
    assert _route("theirs", set()) == "theirs"
    assert _route("theirs", {"ours/anon", "theirs"}) == "theirs"
