"""``raytron serve --tracking-*``: the server's trackers as the ``tracking`` section a spec without one
gets, checked as a spec's is, a flag missing its partner named (the served path:
tests/service/server/test_serve_tracking.py)."""

import argparse

import pytest

from api.cli.serve_cmd import add_arguments, default_tracking


def _args(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_no_flags_no_default():
    assert default_tracking(_args()) is None


def test_flags_make_the_section():
    args = _args("--tracking-mlflow-uri", "http://mlflow:5000", "--tracking-wandb-project", "p",
                 "--tracking-wandb-mode", "offline")
    assert default_tracking(args) == {"mlflow": {"tracking_uri": "http://mlflow:5000"},
                                      "wandb": {"project": "p", "mode": "offline"}}


@pytest.mark.parametrize("argv, words", [
    (("--tracking-mlflow-experiment", "e"), "--tracking-mlflow-experiment needs --tracking-mlflow-uri"),
    (("--tracking-wandb-mode", "offline"), "need --tracking-wandb-project"),
])
def test_a_flag_without_its_partner_is_one_line(argv, words):
    with pytest.raises(ValueError, match=words):
        default_tracking(_args(*argv))
