"""CPU: the DP controller busy-polls when idle, whatever `--sleep-on-idle` says.

`DataParallelController.event_loop` drains the tokenizer socket with non-blocking receives and, when
it is empty, starts over at once: an idle DP-attention engine keeps one core busy (60-92% measured
on configuration (c) beside the schedulers' 3% each with `--sleep-on-idle`). The schedulers honour
the flag (SGLang's `IdleSleeper` polls their sockets for up to 1 s); the DP controller never reads it.

Fix: AROUND `event_loop`: with `sleep_on_idle`, the loop gets the tokenizer socket behind a thin view
whose non-blocking receive first waits (zmq poll, up to 1 s, as `IdleSleeper`) for a message. A
message ends the wait at once; an idle loop turns once a second (the soft watchdog is fed each turn).
Without the flag the loop runs unchanged.

Releases up to 0.5.16 have the same `event_loop` (same fingerprint), but their DP controller process
(spawned) never calls `load_plugins()`, so no plugin hook can reach it there (not-needed).
"""
from sglang_patches.registry import Fix, Hook

from . import cpu_idle_reason

TARGET = "sglang.srt.managers.data_parallel_controller.DataParallelController.event_loop"
CONTROLLER_PROCESS = "sglang.srt.managers.data_parallel_controller.run_data_parallel_controller_process"
POLL_MS = 1000  # SGLang's IdleSleeper.maybe_sleep waits as long
TEST = "tests/test_cpu_fixes.py::test_fix_needed_and_effective[cpu-dp-controller-idle]"


class WaitingSocket:
    """A zmq socket whose non-blocking receives first wait up to `timeout_ms` for a message."""

    def __init__(self, sock, timeout_ms: int = POLL_MS):
        self.sock = sock
        self.timeout_ms = timeout_ms

    def _wait(self, flags: int) -> None:
        import zmq

        if flags & zmq.NOBLOCK:
            self.sock.poll(self.timeout_ms, zmq.POLLIN)

    def recv(self, flags: int = 0, **kwargs):
        self._wait(flags)
        return self.sock.recv(flags=flags, **kwargs)

    def recv_pyobj(self, flags: int = 0):
        self._wait(flags)
        return self.sock.recv_pyobj(flags=flags)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def sleep_when_idle(original, self, *args, **kwargs):
    if getattr(self.server_args, "sleep_on_idle", False) and not isinstance(self.recv_from_tokenizer, WaitingSocket):
        self.recv_from_tokenizer = WaitingSocket(self.recv_from_tokenizer)
    return original(self, *args, **kwargs)


SLEEP_WHEN_IDLE = Hook(TARGET, sleep_when_idle, "around")

FIX = Fix(
    name="cpu-dp-controller-idle",
    family="cpu",
    defect=(
        "DataParallelController.event_loop spins on a non-blocking recv and ignores --sleep-on-idle. An idle "
        "DP-attention engine keeps one core busy in its DP controller (60-92% measured) while its schedulers sleep."
    ),
    reference="found measuring idle CPU engines",
    test=TEST,
    when=cpu_idle_reason,
)
