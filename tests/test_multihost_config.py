"""`DistributedConfig.resolve`: the flags of one engine over several processes, from the
command line or the environment; bad values are refused naming the flag."""

from __future__ import annotations

import pytest

from jaxkv.engine.multihost import DEFAULT_TIMEOUT_S, DistributedConfig


def test_flags_win_over_the_environment_and_fill_from_it() -> None:
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
           "JAX_PROCESS_ID": "3"}  # fmt: skip
    assert DistributedConfig.resolve(environ=env) == DistributedConfig(
        "10.0.0.1:1234", 4, 3, DEFAULT_TIMEOUT_S
    )
    got = DistributedConfig.resolve("h:1", None, 0, 5, environ=env)
    assert got == DistributedConfig("h:1", 4, 0, 5.0)
    assert DistributedConfig.resolve(environ={}) is None  # one process


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("h:1", None, 0), "--num-processes is required"),
        (("h:1", 2, None), "--process-id is required"),
        (("h:1", 2, 2), r"--process-id must be in \[0, 2\), got 2"),
        (("h:1", 0, 0), "--num-processes must be >= 1"),
        (("h:1", "two", 0), "--num-processes must be an integer, got 'two'"),
        (("nohost", 2, 0), "must be HOST:PORT"),
        ((None, 2, 0), "need --coordinator-address"),
        (("h:1", 2, 0, 0), "--distributed-timeout must be > 0"),
    ],
)
def test_bad_settings_name_the_flag(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        DistributedConfig.resolve(*args, environ={})


def test_command_line_default_timeout_is_the_engines() -> None:
    from jaxkv.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--coordinator-address", "h:1", "--num-processes", "2",
                              "--process-id", "1", "--prompt", "hi", "--model", "m"])  # fmt: skip
    assert args.distributed_timeout is None  # resolved by DistributedConfig, not the parser
    help_text = next(
        a.help
        for a in parser._subparsers._group_actions[0].choices["generate"]._actions
        if a.dest == "distributed_timeout"
    )
    assert f"(default: {DEFAULT_TIMEOUT_S:g})" in help_text


def test_after_process_0_stops_no_call_or_step_goes_on() -> None:
    from jaxkv.engine.multihost import RequestStream

    stream = RequestStream()  # one process: the source
    stream.is_source = False  # as on process 1, once process 0 called stop()
    stream.stopped = True
    for call in ("add_request", "abort"):
        with pytest.raises(RuntimeError, match=f"{call} on process 0: process 0 shut"):
            stream.check_source(call)
    with pytest.raises(RuntimeError, match="step on process 0: process 0 shut the engine"):
        stream.exchange()
