"""`DistributedConfig.resolve`: the flags of one engine over several processes, from the
command line or the environment; bad values (a port outside 1..65535, a timeout that is
not a number of seconds up to a day) are refused naming the flag, and a taken
coordinator port before anything starts. The supervisor's reading of the runtime's
last words (`FaultLog`), on lines the runtime wrote."""

from __future__ import annotations

import socket

import pytest

from jaxkv.engine.distributed_config import BIND_ADDRESS_ENV, check_port_free
from jaxkv.engine.multihost import DEFAULT_TIMEOUT_S, DistributedConfig
from jaxkv.engine.supervisor import FaultLog


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
        (("h:0", 2, 0), r"PORT must be an integer in 1\.\.65535, got '0'"),
        (("h:99999", 2, 0), r"PORT must be an integer in 1\.\.65535, got '99999'"),
        (("h:http", 2, 0), r"PORT must be an integer in 1\.\.65535, got 'http'"),
        *(
            (
                ("h:1", 2, 0, t),
                rf"--distributed-timeout must be a number of seconds in \(0, 86400\], got {t}",
            )
            for t in (0, -1.0, 1e12, float("inf"), float("nan"))
        ),
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


def _generate(*flags: str) -> list[str]:
    return ["generate", "--model", "m", "--prompt-token-ids", "1,2", "--num-processes", "2",
            *flags]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--distributed-timeout", "1e12"], "--distributed-timeout"),
        (["--distributed-timeout", "inf"], "--distributed-timeout"),
        (["--distributed-timeout", "nan"], "--distributed-timeout"),
        (["--distributed-timeout", "0"], "--distributed-timeout"),
        (["--distributed-timeout", "-3"], "--distributed-timeout"),
        (["--coordinator-address", "127.0.0.1:0"], "--coordinator-address '127.0.0.1:0'"),
        (["--coordinator-address", "127.0.0.1:99999"], "--coordinator-address '127.0.0.1:99999'"),
    ],
)
def test_bad_distributed_flags_exit_2_with_one_line(flags, named, capsys) -> None:
    """Refused before any process starts: exit 2, one `jaxkv: error:` line naming the flag
    (1e12 was a TypeError traceback, inf an OverflowError; ports 0 and 99999 never met)."""
    from jaxkv.cli import main

    defaults = {"--coordinator-address": "127.0.0.1:1", "--process-id": "1"}
    for flag, value in defaults.items():
        if flag not in flags:
            flags = [*flags, flag, value]
    assert main(_generate(*flags)) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("jaxkv: error: " + named), err


def _listening() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener


def test_a_taken_port_is_refused_naming_it() -> None:
    with _listening() as listener:
        port = listener.getsockname()[1]
        with pytest.raises(ValueError, match=f"'127.0.0.1:{port}': port {port} is taken"):
            check_port_free(f"127.0.0.1:{port}")
    check_port_free(f"127.0.0.1:{port}")  # closed: free again
    with pytest.raises(ValueError, match="192.0.2.1 is not an address of this machine"):
        check_port_free("192.0.2.1:5000")  # TEST-NET-1: never local


def test_process_0_with_a_taken_port_exits_2_before_starting(capsys) -> None:
    """The coordinator's bind would crash process 0 (SIGSEGV after gRPC's "Failed to add
    port"); the command refuses it before any worker starts."""
    from jaxkv.cli import main

    with _listening() as listener:
        port = listener.getsockname()[1]
        flags = ["--coordinator-address", f"127.0.0.1:{port}", "--process-id", "0"]
        assert main(_generate(*flags)) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"port {port} is taken" in err[0], err


def test_the_coordinator_listens_on_the_address_given(monkeypatch) -> None:
    config = DistributedConfig("127.0.0.1:4000", 2, 0)
    monkeypatch.delenv(BIND_ADDRESS_ENV, raising=False)
    assert config.bind_address == "127.0.0.1:4000"  # JAX's default: [::]:4000
    monkeypatch.setenv(BIND_ADDRESS_ENV, "[::]:4000")
    assert config.bind_address == "[::]:4000"


# Lines the runtime wrote before it aborted a process (jaxlib 0.10, CPU, loopback).
_ABORT = ("F1205 05:31:07.273822    9782 client.h:80] Terminating process because the JAX "
          "distributed service detected fatal errors. This most likely indicates that another "
          "task died; see the other task logs for more details. absl::Status: ")  # fmt: skip
_HEARTBEATS = [
    _ABORT + "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n",
    "1\n",
    "The tasks have crashed. Check the task logs for an earlier error, or scheduler events\n",
    "RPC: /xla.coordination.CoordinationService/PollForError\n",
]
_COORDINATOR_GONE = [
    _ABORT + "UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task "
    "was preempted/died/restarted unexpectedly or this task is experiencing network issues.\n",
    ':UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}\n',
]
_DUPLICATE = [
    "E1205 05:28:53.070343    8525 coordination_service.cc:518] [1387825] 1 unexpectedly "
    "tried to connect with a different incarnation. It has likely restarted.\n",
    "jaxkv: error: process 0: process 1 stopped (no heartbeat) within 10 s "
    "(--distributed-timeout); the engine cannot go on without every process\n",
]


@pytest.mark.parametrize(
    ("lines", "returncode", "verdict"),
    [
        (_HEARTBEATS, -6, "process 0: process 1 stopped (no heartbeat) within 10 s"),
        (_COORDINATOR_GONE, -6, "process 0: the coordinator (process 0) stopped answering"),
        (_DUPLICATE, 1, "process 0: a second process with --process-id 1 tried to join"),
        (_DUPLICATE[1:], 1, "process 0: process 1 stopped (no heartbeat)"),  # its own line
        (
            [_ABORT + "INTERNAL: something else\n"],
            -6,
            "runtime ended this process (SIGABRT): INTERNAL: something else",
        ),  # fmt: skip
        (["E0000 gRPC Failed to add port to server '[::]:4000'\n"], -11, "port is taken"),
        ([], -9, "process 0: the worker process died of SIGKILL"),
        ([], 0, None),
    ],
)
def test_the_supervisor_names_the_cause_of_a_workers_death(lines, returncode, verdict) -> None:
    log = FaultLog(DistributedConfig("127.0.0.1:4000", 2, 0, 10))
    held = [line for line in lines if log.read(line)]
    assert held == [line for line in lines if line.startswith("jaxkv: error: ")]
    if verdict is None:
        assert log.verdict(returncode) is None
    else:
        assert verdict in (log.verdict(returncode) or ""), log.verdict(returncode)
