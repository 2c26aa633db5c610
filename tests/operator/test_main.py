import pytest
from slimspec_operator import main


def test_defaults_and_flags(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("SLIMSPEC_OPERATOR_NAMESPACES", raising=False)
    monkeypatch.delenv("SLIMSPEC_OPERATOR_STANDALONE", raising=False)
    monkeypatch.delenv("SLIMSPEC_OPERATOR_PEERING", raising=False)
    a = main.parse_args([])
    assert not a.standalone and a.namespace == [] and a.metrics_port == 9100
    assert a.peering is None
    assert a.liveness == "http://0.0.0.0:8080/healthz"
    b = main.parse_args(["--standalone", "-n", "a", "-n", "b", "--metrics-port", "0"])
    assert b.standalone and b.namespace == ["a", "b"] and b.metrics_port == 0
    monkeypatch.setenv("SLIMSPEC_OPERATOR_NAMESPACES", "x,y")
    assert main.parse_args([]).namespace == ["x", "y"]


def test_optional_handler_modules_are_imported_only_when_present(
    monkeypatch: pytest.MonkeyPatch,
):
    absent = ("slimspec_operator.not_there", "slimspec_operator.no_package.handlers")
    monkeypatch.setattr(main, "OPTIONAL_HANDLER_MODULES", absent)
    assert main.load_handlers() == ["slimspec_operator.rollout.handlers"]
